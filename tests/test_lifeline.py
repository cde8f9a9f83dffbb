"""No process orgel starts outlives the process that started it.

A script that profiles (the profiler's busy companions), trains (``orgel.pipeline``'s
forked ranks) or spawns ranks as ``orgel run`` does (from orgel's fork server) is killed
with SIGKILL or SIGTERM; within a few seconds no process it started is left (found by a
marker in their environment, which children inherit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MARKER = "ORGEL_LIFELINE_TEST"

SCRIPT = '''
import sys, time
import torch
from torch import nn
import orgel

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
x, y = torch.randn(8, 8), torch.randn(8, 4)
loss_fn = nn.functional.mse_loss

if sys.argv[1] == "profile":
    from orgel.profile.contention import companions

    def work():
        loss_fn(model(x), y).backward()

    with companions(2, work):  # what the profiler runs while it times the blocks
        print("ready", flush=True)
        time.sleep(600)
elif sys.argv[1] == "links":  # the link benchmark: its ranks (forked, for gloo)
    from orgel.profile.links import measure_link_samples

    print("ready", flush=True)
    measure_link_samples(2, sizes=(4, 1 << 20), repeats=1_000_000)
elif sys.argv[1] == "server":  # orgel run's CPU ranks: forked from orgel's fork server
    from orgel.launch.spawn import spawn
    from orgel.profile.links import _ping_pong

    print("ready", flush=True)
    spawn(_ping_pong, 2, "gloo", (4, 1 << 20), 1_000_000, 60.0, context="forkserver")
else:
    from orgel.plan.balanced import balanced_plan

    plan = balanced_plan(orgel.capture(model, (x[:4],)), ranks=2, microbatches=2)
    pipe = orgel.pipeline(model, (x,), y, loss_fn, ranks=2, microbatches=2, plan=plan,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01), threads=1)
    pipe.step((x,), y)
    print("ready", flush=True)
    while True:
        pipe.step((x,), y)
'''


def _marked(token: str, command: str = "") -> list[int]:
    """Live processes (not zombies) whose environment holds ``MARKER=token`` (and whose
    command line holds ``command``)."""
    found = []
    needle = f"{MARKER}={token}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if command.encode() not in (proc / "cmdline").read_bytes():
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
@pytest.mark.parametrize("phase", ["profile", "links", "train", "server"])
def test_nothing_outlives_a_killed_script(phase: str, sig: signal.Signals,
                                          tmp_path: Path) -> None:
    token = os.urandom(6).hex()
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, MARKER: token}
    proc = subprocess.Popen([sys.executable, str(script), phase], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
        # the benchmark's two ranks both running (and the fork server they came from)
        wanted = {"links": 2, "server": 3}.get(phase, 0)
        deadline = time.monotonic() + 60.0
        while len([p for p in _marked(token) if p != proc.pid]) < wanted:
            assert time.monotonic() < deadline and proc.poll() is None, "no ranks started"
            time.sleep(0.1)
        started = [p for p in _marked(token) if p != proc.pid]
        assert len(started) >= 2, "the script started no process to watch"
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5.0
        while (left := _marked(token)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"{phase}: processes outlived the {sig.name}ed script: {left}"
    finally:
        for pid in _marked(token):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_ranks_started_in_a_thread_outlive_the_thread() -> None:
    """The kernel's parent-death signal follows the thread that started a child: a pipeline
    built in a worker thread keeps its ranks after that thread returns."""
    from orgel.launch.processes import LocalGroup

    groups: list[LocalGroup] = []
    thread = threading.Thread(target=lambda: groups.append(LocalGroup(2, _Echo, threads=1)))
    thread.start()
    thread.join()
    group = groups[0]
    try:
        time.sleep(1.0)
        assert group.call("echo", 3) == [3, 3]
    finally:
        group.close()


class _Echo:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def echo(self, value: int) -> int:
        return value
