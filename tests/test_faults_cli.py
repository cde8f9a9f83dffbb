"""Faults through the CLI: ``orgel run`` reports a failing workload once and exits nonzero.

The workload fails inside fresh rank interpreters (the cases, :data:`CLI_FAULTS`, and the
faulty workload are in ``test_faults.py``, beside the API's): an exception in a stage or
the loss, a NaN loss, a rank killed or stopped; each report names the rank and the action
within its bound. A failed run leaves no semaphore behind; a plan that deadlocks or was
made for another model is refused before any process starts; a port taken before rank 0
binds it is replaced (through the API too).
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import orgel
from orgel.launch.errors import WorkerError
from test_faults import CLI_FAULTS, _batch, orgel_run, start, workload_file

pytestmark = pytest.mark.slow  # starts rank processes


def run_cli_fault(tmp_path: Path, fault: str,
                  capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    """``orgel run`` on a workload that fails with ``fault``: (exit code, stderr, seconds
    from the fault to the command's return)."""
    from orgel.cli import main

    spec, times = workload_file(tmp_path, fault)
    extra = ("--check-finite",) if fault == "nan" else ()
    code = main(orgel_run(spec, *extra))
    return code, capsys.readouterr().err, time.time() - float(times.read_text())


@pytest.mark.parametrize("fault", list(CLI_FAULTS))
def test_orgel_run_reports_a_failing_workload_once_and_exits_nonzero(
        fault: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The workload's own error under a header naming it, with the rank and the action."""
    code, err, seconds = run_cli_fault(tmp_path, fault, capsys)
    pattern, bound = CLI_FAULTS[fault]
    assert code == 1
    assert err.startswith(
        f"orgel run: the workload {tmp_path / f'faulty_{fault}.py'}:workload failed\n"), err
    assert re.search(pattern, err), err
    assert err.count("Traceback (most recent call last)") == (
        1 if fault in ("stage", "loss") else 0), err
    assert seconds < bound, f"{fault}: orgel run returned {seconds:.2f} s after the fault"


def test_a_failed_orgel_run_leaves_no_semaphore_behind(tmp_path: Path) -> None:
    """The ranks are killed when one fails; what their libraries registered (tqdm's lock)
    must not make the resource tracker warn at exit (checked in a process of its own)."""
    import subprocess
    import sys

    spec, _ = workload_file(tmp_path, "sigkill")
    code = f"from orgel.cli import main; raise SystemExit(main({orgel_run(spec)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "died during run (killed by signal 9)" in out.stderr
    assert "leaked semaphore" not in out.stderr, out.stderr[-2000:]


def test_orgel_run_refuses_a_plan_that_deadlocks_or_was_made_for_another_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both are refused before any process starts, saying why and what to do."""
    from orgel.cli import main
    from orgel.plan.balanced import balanced_plan
    from orgel.workload import load_workload

    spec, _ = workload_file(tmp_path, "none")
    work = load_workload(spec)
    model, inputs = work.model, work.inputs
    good = balanced_plan(orgel.capture(model, tuple(t[:4] for t in inputs)), ranks=2,
                         microbatches=2)
    deadlock = good.to_dict()
    deadlock["schedule"] = ["F0.0 B0.0 F0.1 B0.1", "F1.0 F1.1 B1.0 B1.1"]
    (tmp_path / "deadlock.json").write_text(json.dumps(deadlock))
    other = balanced_plan(orgel.capture(nn.Sequential(nn.Linear(8, 4), nn.ReLU(),
                                                      nn.Linear(4, 4)), (inputs[0][:4],)),
                          ranks=2, microbatches=2)
    (tmp_path / "other.json").write_text(other.to_json())

    start_s = time.monotonic()
    assert main(orgel_run(spec, "--plan", str(tmp_path / "deadlock.json"))) == 2
    err = capsys.readouterr().err
    assert "deadlock: rank 0 at position 1 (B0.0) waits for gradient of edge 0->1 micro-batch 0 "\
        "from rank 1, which is stuck at position 1 (F1.1); rank 1 at position 1 (F1.1) waits" \
        in err, err
    assert main(orgel_run(spec, "--plan", str(tmp_path / "other.json"))) == 2
    err = capsys.readouterr().err
    assert "the plan does not match this model" in err and "plan again" in err, err
    assert time.monotonic() - start_s < 30  # no rank was started, no timeout waited out


def test_a_port_taken_before_rank_0_binds_it_is_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The local ranks meet on a port that was free when chosen; if another process takes it
    first, orgel chooses another; if every try is taken, the error says so: through the API
    and through orgel run."""
    import orgel.launch.processes as launch
    from orgel.cli import main

    spec, _ = workload_file(tmp_path, "none")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        real = launch.free_port
        ports = iter([taken])
        monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or real())
        flag = Path("/nonexistent/orgel-fault")
        with start(flag, "none") as pipe:  # the first port is taken: started on the second
            x, y = _batch()
            assert torch.isfinite(torch.tensor(pipe.step((x,), y)))
        ports = iter([taken])
        assert main(orgel_run(spec)) == 0
        capsys.readouterr()
        monkeypatch.setattr(launch, "free_port", lambda: taken)
        with pytest.raises(WorkerError, match="EADDRINUSE"):
            start(flag, "none")
        assert main(orgel_run(spec)) == 1
        assert "EADDRINUSE" in capsys.readouterr().err
