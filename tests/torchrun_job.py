"""One torchrun job of local processes, for the tests that run a script under torchrun.

:func:`torchrun` starts ``python -m torch.distributed.run`` on a script, its output going to
a file (a pipe held open by a stray rank would keep a reader waiting after torchrun itself
has ended), in a session of its own so that a job past its time is killed with every
process it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from orgel.launch.processes import free_port


def torchrun(script: Path, *args: str, processes: int, log: Path, timeout_s: float,
             pythonpath: Sequence[Path] = ()) -> int:
    """Run ``script`` with ``args`` on ``processes`` local processes; its exit code.

    ``pythonpath``: folders the script imports from besides ``tests/``. Past ``timeout_s``
    the job and every process it started are killed and :class:`subprocess.TimeoutExpired`
    is raised.
    """
    # a rank that crashes (SIGSEGV, SIGABRT) prints every thread's Python stack to the log
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    # the tests' folder first: a script measures its gap to one process with gaps.py
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *map(str, pythonpath),
                                         os.environ.get("PYTHONPATH", "")])
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
             *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            # ranks torchrun started in sessions of their own: those of this job only (the
            # script with these arguments; another job may run the same script)
            _kill_running([str(script), *args])
            proc.wait()
            raise


def _kill_running(markers: Sequence[str]) -> None:
    """SIGKILL every process whose command line mentions each of ``markers``."""
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            line = (proc_dir / "cmdline").read_bytes().decode(errors="replace")
            if all(m in line for m in markers):
                os.kill(int(proc_dir.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def gloo_threads() -> list[str]:
    """The names of gloo's threads in this process (for a script under torchrun, Linux)."""
    names = [(Path("/proc/self/task") / t / "comm").read_text().strip()
             for t in os.listdir("/proc/self/task")]
    return [n for n in names if "gloo" in n]
