"""The mesh end to end: `orgel plan` picks TP x DP x FSDP, `orgel run --plan` trains it exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orgel.cli import main

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py") + ":workload"


@pytest.mark.slow
def test_a_planned_tp_fsdp_mesh_runs_from_its_plan_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plan file carries tp, sequence parallelism and the stages' shard; `orgel run
    --plan` takes the process count from it (no --ranks) and matches one process."""
    path = tmp_path / "mesh.json"
    assert main(["plan", GPT, "--ranks", "4", "--tp", "2", "--dp", "2", "--shard", "fsdp",
                 "--microbatches", "2", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("mesh: PP 1 x TP 2 x DP 2 (4 GPUs), replicas sharded (fsdp), sequence parallel"
            in out)
    data = json.loads(path.read_text())
    assert data["tp"] == 2 and data["num_ranks"] == 2
    assert data["sequence_parallel"]  # priced so by the search, run so by orgel run
    assert [s.get("shard") for s in data["stages"]] == ["fsdp"]
    assert main(["run", GPT, "--plan", str(path), "--steps", "2", "--check"]) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks" in out and "-> OK" in out
