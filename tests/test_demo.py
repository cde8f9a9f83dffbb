"""orgel demo: the plan, the reference check, the trace and PNG, and its option errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from orgel.cli import main
from orgel.explicit.demo import run_demo
from test_timeline import gantt_kinds

pytestmark = pytest.mark.slow


def test_demo_trains_checks_and_writes_the_timeline(tmp_path: Path) -> None:
    out = io.StringIO()
    result = run_demo(model="gpt", ranks=2, steps=3, microbatches=2, batch_size=8,
                      out=tmp_path, stream=out, progress=False)
    text = out.getvalue()
    assert "plan: " in text and "schedule:" in text and "rank1: " in text
    assert "vs single-process" in text and ": match" in text
    assert result.first_loss_matches
    assert result.losses[0] == pytest.approx(result.reference_loss, rel=1e-4)
    assert len(result.losses) == 3 and result.measured_step > 0
    trace = json.loads(Path(result.files["trace"]).read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1", "predicted rank 0", "predicted rank 1"} <= names
    assert any(e.get("ph") == "X" and e["pid"] == 1 for e in trace["traceEvents"])
    drawn = gantt_kinds(Path(result.files["png"]))  # the plan's actions, drawn
    assert drawn["F"] > 200 and (drawn["B"] > 200 or drawn["W"] > 200)
    assert json.loads(Path(result.files["plan"]).read_text())["num_ranks"] == 2


def test_demo_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--batch-size", "6", "--microbatches", "4"]) == 2
    assert "must be divisible by --microbatches" in capsys.readouterr().err
