"""Fresh local processes: spawned, or forked from orgel's fork server (``orgel run``'s CPU
ranks). From a script without a ``__main__`` guard the children must not re-run it; a
child of the server takes the environment of the process that starts it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = '''
import json, operator, sys
from orgel.launch.spawn import spawn
print("script ran", flush=True)  # once: the children never import this file
print(json.dumps(spawn(operator.add, 2, timeout=30.0, context=sys.argv[1])))  # rank + world
'''


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawn_from_an_unguarded_script(context: str, tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), context], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines.count("script ran") == 1
    assert lines[-1] == "[2, 3]"


def _seen(rank: int, world: int, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getppid()


def test_the_fork_servers_children_take_the_callers_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server keeps the environment it started with; each child takes the caller's, and
    a variable the libraries read at import (``TORCH...``) starts a new server."""
    from orgel.launch.spawn import spawn

    def run() -> list[tuple[str | None, int]]:
        return spawn(_seen, 2, "ORGEL_FORK_TEST", timeout=30.0, context="forkserver")

    monkeypatch.setenv("ORGEL_FORK_TEST", "one")
    first = run()
    monkeypatch.setenv("ORGEL_FORK_TEST", "two")
    second = run()
    assert [v for v, _ in first] == ["one", "one"] and [v for v, _ in second] == ["two", "two"]
    servers = {p for _, p in first + second}
    assert len(servers) == 1 and os.getpid() not in servers  # one server, reused
    monkeypatch.setenv("TORCH_FORK_TEST", "1")
    third = run()
    assert {p for _, p in third}.isdisjoint(servers)


def test_gloo_ranks_fork_from_the_server_by_default() -> None:
    """``spawn`` without a context forks gloo ranks from the fork server (seconds faster to
    start than fresh interpreters)."""
    from orgel.launch import forkserver
    from orgel.launch.spawn import spawn

    got = spawn(_seen, 2, "ORGEL_FORK_TEST", timeout=30.0)
    assert {p for _, p in got} == {forkserver.lifeline().parent} != {os.getpid()}
