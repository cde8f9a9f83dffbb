"""How fast a fault ends a step: time from the fault to the error, and to the last exit.

Runs ``tests/test_faults.py``'s cases. Through ``orgel.pipeline`` (2 local ranks,
a 6 s timeout): one good step, the fault, a step; the table gives the seconds
until that step raised and until every worker process was gone. Then
``tests/test_faults_tp.py``'s lone member (2 pipeline ranks of 2 tensor-parallel
members, a 30 s timeout: one member raises in a stage, its partner does not). Through
``orgel run`` (fresh rank interpreters): the seconds from the fault (written by
the failing rank) until the command returned. Last, the first line of the
report::

    python benchmarks/faults.py
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from orgel.runtime.comm import MEMBERS_AGREE_S  # noqa: E402
from test_faults import (  # noqa: E402 - the test's cases
    API_FAULTS,
    CLI_FAULTS,
    TIMEOUT_S,
    _gone,
    orgel_run,
    run_fault,
    workload_file,
)
from test_faults_tp import Net as TpNet  # noqa: E402 - the tensor-parallel case
from test_faults_tp import _batches as tp_batches  # noqa: E402
from test_faults_tp import lone_member_fault  # noqa: E402
from test_faults_tp import start as tp_start  # noqa: E402


def main() -> None:
    from orgel.cli import main as orgel

    print(f"2 local ranks, timeout {TIMEOUT_S:g} s, load {os.getloadavg()[0]:.1f}")
    print(f"{'entry':<6} {'fault':<10} {'raised s':>8} {'exited s':>8} {'bound s':>7}  "
          "first line of the report")
    for fault, (_, bound) in API_FAULTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            message, raised, pids, begin = run_fault(Path(tmp) / "fault", fault)
            while not all(_gone(p) for p in pids):
                time.sleep(0.01)
            exited = time.monotonic() - begin
        print(f"{'API':<6} {fault:<10} {raised:>8.2f} {exited:>8.2f} {bound:>7.1f}  "
              f"{message.splitlines()[0][:100]}")
    with tempfile.TemporaryDirectory() as tmp:  # tp=2: one member raises, its partner not
        torch.manual_seed(0)
        pipe = tp_start(Path(tmp) / "fault", TpNet())
        pids = pipe.worker_pids
        try:
            x, y = tp_batches()[0]
            pipe.step((x,), y)
            error, raised = lone_member_fault(pipe, Path(tmp) / "fault")
            begin = time.monotonic() - raised
        finally:
            pipe.close()
        while not all(_gone(p) for p in pids):
            time.sleep(0.01)
        print(f"{'API':<6} {'tp-member':<10} {raised:>8.2f} {time.monotonic() - begin:>8.2f} "
              f"{MEMBERS_AGREE_S + 2:>7.1f}  {str(error).splitlines()[0][:100]}")
    for fault, (_, bound) in CLI_FAULTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            spec, times = workload_file(Path(tmp), fault)
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                orgel(orgel_run(spec, *(("--check-finite",) if fault == "nan" else ())))
            returned = time.time() - float(times.read_text())
        line = err.getvalue().splitlines()[1] if err.getvalue().count("\n") > 1 else ""
        print(f"{'CLI':<6} {fault:<10} {returned:>8.2f} {returned:>8.2f} {bound:>7.1f}  "
              f"{line[:100]}")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
