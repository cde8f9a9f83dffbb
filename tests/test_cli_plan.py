"""``orgel plan``: table and JSON output from a costs file, plan file, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orgel.cli import main
from orgel.commands.plan import parse_size
from orgel.schedule.ir import Plan

MiB = 1 << 20


def write_costs(path: Path, n: int = 12, **extra: object) -> Path:
    blocks = [{"fwd": 1.0 + (i % 3) * 0.5, "bwd": 2.0 + (i % 3), "params": MiB,
               "activations": 2 * MiB, "output": MiB} for i in range(n)]
    path.write_text(json.dumps({"blocks": blocks, "link": {"latency": 0.02, "per_mib": 0.05},
                                "optimizer_factor": 4, **extra}))
    return path


def test_plan_json_and_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs = write_costs(tmp_path / "costs.json")
    out = tmp_path / "plan.json"
    code = main(["plan", "--costs", str(costs), "--ranks", "2", "--microbatches", "4",
                 "--max-loops", "2", "--json", "--out", str(out)])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("step_time", "search_seconds", "planner", "schedule", "stages", "peak_memory",
                "baselines"):
        assert key in data
    assert len(data["peak_memory"]) == 2
    assert set(data["baselines"]) == {"uniform-layers", "uniform-params", "uniform-time"}
    plan = Plan.load(out)
    assert plan.num_ranks == 2 and plan.microbatches == 4
    assert sorted(b for s in plan.stage_graph.stages for b in s.blocks) == list(range(12))
    assert plan.prediction is not None and plan.meta["planner"] == data["planner"]


def test_plan_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs = write_costs(tmp_path / "costs.json")
    assert main(["plan", "--costs", str(costs), "--ranks", "3", "--planner",
                 "uniform-time"]) == 0
    text = capsys.readouterr().out
    assert "planner uniform-time: schedule 1f1b on 3 ranks, 6 micro-batches" in text
    assert "predicted step" in text and "baselines (1F1B)" in text and "search" in text


def test_plan_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs = write_costs(tmp_path / "costs.json")
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--memory", "lots"]) == 2
    assert "--memory: cannot read the size 'lots'" in capsys.readouterr().err
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--memory", "1MiB"]) == 2
    assert "no plan fits in 1MiB per rank on 2 ranks" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"blocks": [{"fwd": 1}]}')
    assert main(["plan", "--costs", str(bad), "--ranks", "2"]) == 2
    assert "blocks[0] is missing 'bwd'" in capsys.readouterr().err
    assert main(["plan", "--ranks", "2"]) == 2
    assert "give either a WORKLOAD" in capsys.readouterr().err


def test_plan_max_replicas_and_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs = write_costs(tmp_path / "costs.json", n=6)
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--dp", "auto",
                 "--rows", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(len(s["ranks"]) == 1 for s in data["stages"])  # 3 rows: no two replicas
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--planner", "graph",
                 "--max-replicas", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(len(s["ranks"]) == 1 for s in data["stages"])
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--max-replicas", "0"]) == 2
    assert "--max-replicas must be at least 1" in capsys.readouterr().err


def test_plan_a_batch_from_a_costs_file(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    costs = write_costs(tmp_path / "costs.json", rows=4, action_overhead=0.5)
    out = tmp_path / "plan.json"
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--batch", "48", "--max-loops",
                 "2", "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch"] == 48
    search = {c["microbatches"]: c for c in data["microbatch_search"]}
    assert set(search) <= {2, 3, 4, 6, 8, 12, 16} and {2, 4, 8, 16} <= set(search)
    assert all(c["rows"] * m == 48 for m, c in search.items())
    fastest = min((c["step_time"], m) for m, c in search.items() if c["feasible"])[1]
    assert data["microbatches"] == fastest == Plan.load(out).microbatches
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--batch", "48",
                 "--microbatches", "6", "--max-loops", "2"]) == 0
    text = capsys.readouterr().out
    assert "micro-batch counts tried for a batch of 48 rows (chosen: 6;" in text
    assert "<- chosen" in text and "rows/s" in text


def test_plan_batch_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    no_rows = write_costs(tmp_path / "costs.json")
    assert main(["plan", "--costs", str(no_rows), "--ranks", "2", "--batch", "16"]) == 2
    assert 'add "rows": N to the costs file' in capsys.readouterr().err
    assert main(["plan", "--costs", str(no_rows), "--ranks", "2", "--microbatches",
                 "auto"]) == 2
    assert "--microbatches auto with --costs needs --batch" in capsys.readouterr().err
    rows = write_costs(tmp_path / "rows.json", rows=2)
    assert main(["plan", "--costs", str(rows), "--ranks", "2", "--batch", "16",
                 "--microbatches", "5"]) == 2
    assert "--microbatches 5 does not divide --batch 16" in capsys.readouterr().err
    assert main(["plan", "--costs", str(rows), "--ranks", "2", "--batch", "16", "--rows",
                 "2"]) == 2
    assert "--rows follows from --batch" in capsys.readouterr().err
    assert main(["plan", "--costs", str(rows), "--ranks", "2", "--microbatches", "many"]) == 2
    assert "--microbatches must be a number or 'auto'" in capsys.readouterr().err
    assert main(["plan", "x.py:f", "--ranks", "2", "--batch", "16"]) == 2
    assert "--batch is for --costs" in capsys.readouterr().err


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError, match="e.g. 2GiB"):
        parse_size("2 parsecs")


WORKLOAD = '''
import torch
from torch import nn

def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    return model, (torch.randn(8, 8),), torch.randn(8, 4), nn.functional.mse_loss
'''


@pytest.mark.slow
def test_plan_from_workload_runs_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ORGEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.py"
    source.write_text(WORKLOAD)
    out = tmp_path / "plan.json"
    # no --microbatches: the count is chosen for the example batch of 8 rows
    assert main(["plan", f"{source}:tiny", "--ranks", "2", "--blocks", "4", "--no-link",
                 "--planner", "uniform-time", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "micro-batch counts tried for a batch of 8 rows" in captured.out
    assert "profiling and planning 2 micro-batches of 4 rows (batch 8)" in captured.err
    plan = Plan.load(out)
    assert all(s.nodes and s.blocks for s in plan.stage_graph.stages)
    assert plan.meta["block_graph"]["target_blocks"] == 4
    assert {c["microbatches"] for c in plan.meta["microbatch_search"]} == {2, 4, 8}
    m = str(plan.microbatches)
    assert main(["run", f"{source}:tiny", "--ranks", "2", "--microbatches", m, "--plan",
                 str(out), "--steps", "1", "--check"]) == 0
    assert "-> OK" in capsys.readouterr().out


def test_plan_families(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs = write_costs(tmp_path / "costs.json")
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--microbatches", "4",
                 "--planner", "beam", "--families", "gpipe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"].startswith("gpipe")
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--families", "zb-v"]) == 2
    assert "families must name some of gpipe" in capsys.readouterr().err
