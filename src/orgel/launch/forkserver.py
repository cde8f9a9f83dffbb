"""Fresh local processes in a fraction of a second: orgel's own fork server.

``orgel run`` starts its CPU ranks as fresh interpreters (:func:`orgel.launch.spawn.spawn`),
not as forks of the calling process: a child forked from a process that ran GNU OpenMP
hangs at its first parallel op, and ``--threads`` needs one. A fresh interpreter spends
about 3 s of a core importing torch, orgel and Dynamo before it does anything (2 spawned
ranks: 3.0 s to start on this 2-core host). A fork server (multiprocessing's
``"forkserver"`` start method) imports them once, in a process that runs nothing else, and
forks every child from it: the children are as fresh as spawned ones (no OpenMP threads,
no CUDA, no process group; they import the parent's ``__main__`` and take its
``sys.path`` as spawned children do) and start in 0.1-0.4 s once the server is up.

orgel runs a server of its own, not multiprocessing's: that one is the user's (its list
of modules, its lifetime) and orgel leaves it alone. What differs from ``spawn``, and how
it is met:

* The server's environment is the one it started with. Each child takes the starting
  process's environment first thing (:func:`run_in`), and the server is started again
  where a variable the libraries read when imported (:data:`IMPORT_TIME`) has changed.
* A child's parent is the server. The server ends when the process that started it ends
  (it reads the end of a pipe that process holds), and each child is tied to the server
  (:func:`orgel.launch.lifeline.tie` on :func:`lifeline`), so nothing outlives the
  process that started it.

Only for ranks on the CPU: ``orgel run --device cuda`` spawns, so that no import in the
server can touch a GPU before its children do.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

from orgel.launch.lifeline import Lifeline

#: what the server imports before it forks anything: what every rank imports (the API and
#: all it imports; ``import orgel`` alone imports its parts on first use)
PRELOAD = ["orgel.explicit.api", "orgel.transparent.backend", "torch._dynamo"]
#: prefixes of the variables libraries read when imported: a change starts a new server
IMPORT_TIME = ("TORCH", "PYTORCH", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS", "CUDA_",
               "NCCL_", "GLOO_", "LD_", "PYTHON", "TRITON", "INDUCTOR", "HF_", "TRANSFORMERS")

_lock = threading.Lock()
_server: forkserver.ForkServer | None = None
_server_env: dict[str, str] = {}


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME)}


def _running() -> forkserver.ForkServer:
    """orgel's server, started (again, where the environment it imported in changed)."""
    global _server, _server_env
    with _lock:
        if _server is not None and _server_env != _import_time_env():
            _server._stop()  # type: ignore[attr-defined]
            _server = None
        if _server is None:
            _server = forkserver.ForkServer()
            _server.set_forkserver_preload(PRELOAD)
            _server_env = _import_time_env()
        _server.ensure_running()
        return _server


def start() -> None:
    """Start orgel's server now (it does not wait for the server's imports): a caller that
    will spawn ranks later lets it import while it does other work."""
    _running()


def lifeline() -> Lifeline:
    """What a child of the server passes to :func:`orgel.launch.lifeline.tie`: its parent
    is the server (single-threaded, so the kernel's parent-death signal is safe)."""
    return Lifeline(int(_running()._forkserver_pid), True)  # type: ignore[attr-defined]


def run_in(env: dict[str, str], target: Callable[..., Any], *args: Any) -> None:
    """In a child of the server: let go of the server, take the starting process's
    environment, run ``target``.

    multiprocessing hands each child of a fork server the write end of the pipe that keeps
    the server alive (so that the child could start processes from it too): the server
    would then wait for its children, and they, tied to it, for the server. Closed here,
    the server ends with the process that started it, and its children with it."""
    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(env)
    target(*args)


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver start, through orgel's server instead of the module's."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = _running().connect_to_new_process(
            self._fds)  # type: ignore[attr-defined]
        parent_w = os.dup(w)  # the child's sentinel of this process, as the stdlib keeps it
        self.finalizer = util.Finalize(self, util.close_fds,  # type: ignore[attr-defined]
                                      (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return _Popen(process_obj)


class Context(mp_context.ForkServerContext):
    """A multiprocessing context whose processes start from orgel's server."""

    Process = _Process  # type: ignore[assignment]


def available() -> bool:
    """Whether this platform can run a fork server (Linux and most POSIX systems)."""
    return reduction.HAVE_SEND_HANDLE
