"""Profiler: positive times, bytes consistent with parameter counts, cache, link fit, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from orgel.cli import main
from orgel.profile.blocks import measure_block
from orgel.profile.links import fit_link
from orgel.profile.timing import Timer
from orgel.profile.workload import profile_workload
from orgel.split.types import StageModule
from orgel.workload import Workload

WORKLOAD = '''
import torch
from torch import nn

def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    return model, (torch.randn(8, 16),), torch.randn(8, 4), nn.functional.mse_loss
'''


def tiny() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    return Workload(model, (torch.randn(8, 16),), torch.randn(8, 4), nn.functional.mse_loss)


def test_profile_tiny_model(cache: Path) -> None:
    w = tiny()
    costs = profile_workload(w, microbatches=2, blocks=3, link=False, repeats=3,
                             progress=False)
    assert costs.num_blocks == 3
    assert all(t > 0 for t in costs.fwd) and all(t > 0 for t in costs.bwd)
    assert all(0 <= wg <= b for wg, b in zip(costs.wgrad, costs.bwd, strict=True))
    total_params = sum(p.numel() * 4 for p in w.model.parameters())
    assert sum(costs.params) == total_params
    # Outputs of a micro-batch of 4 rows: the last block returns 4 x 4 floats.
    assert costs.output[-1] == 4 * 4 * 4
    assert costs.rows == 4  # so `orgel plan --costs --batch` can rescale a saved table
    assert all(a > 0 for a in costs.activations)
    assert costs.edges == [(0, 1), (1, 2)]
    assert costs.action_overhead > 0
    assert costs.meta["target_blocks"] == 3 and costs.meta["microbatches"] == 2
    # Second call: served from the cache (same numbers) when not re-checked.
    again = profile_workload(w, microbatches=2, blocks=3, link=False, repeats=3,
                             progress=False, recheck=None)
    assert again.fwd == costs.fwd
    assert any(p.name.startswith("blocks-") for p in cache.iterdir())


def test_a_cached_table_of_other_blocks_is_not_reused(cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The same graph and block count coarsened another way (an orgel that counts FLOPs
    otherwise) is profiled anew, not served the old table of other blocks (it crashed)."""
    import orgel.graph
    from orgel.graph import coarsen

    w = tiny()
    first = profile_workload(w, microbatches=2, blocks=3, link=False, repeats=2,
                             progress=False, recheck=None)
    assert first.num_blocks == 3
    monkeypatch.setattr(orgel.graph, "coarsen", lambda graph, blocks: coarsen(graph, 2))
    other = profile_workload(w, microbatches=2, blocks=3, link=False, repeats=2,
                             progress=False, recheck=None)
    assert other.num_blocks == 2 and len(other.fwd) == 2


def test_measure_block_saved_and_param_bytes() -> None:
    lin = nn.Linear(8, 16)

    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (torch.tanh(lin(x)),)

    block = Block()
    block.lin = lin
    stage = StageModule(index=0, module=block, inputs=["x"], outputs=["y"])
    m = measure_block(stage, [torch.randn(4, 8)], Timer(torch.device("cpu"), warmup=1,
                                                           repeats=2))
    assert m.params == (8 * 16 + 16) * 4
    assert m.output == 4 * 16 * 4
    # linear saves its input (4x8), tanh its output (4x16); the weight is not counted.
    # The input comes from another block: apart, counted when a stage boundary feeds it.
    assert m.activations == 4 * 16 * 4 and m.input_saved == 4 * 8 * 4
    assert m.fwd > 0 and m.bwd > 0 and 0 < m.wgrad <= m.bwd


def test_fit_link() -> None:
    link = fit_link([(0, 0.1), (1 << 20, 0.6), (4 << 20, 2.1)])
    assert link.latency == pytest.approx(0.1)
    assert link.per_mib == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least two"):
        fit_link([(1, 1.0)])


def test_cli_profile(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.py"
    path.write_text(WORKLOAD)
    out = tmp_path / "costs.json"
    code = main(["profile", f"{path}:tiny", "--microbatches", "2", "--blocks", "3",
                 "--no-link", "--repeats", "2", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "action overhead" in text and "total" in text
    data = json.loads(out.read_text())
    assert len(data["blocks"]) == 3
    assert main(["plan", "--costs", str(out), "--ranks", "2", "--microbatches", "2",
                 "--max-loops", "1"]) == 0
    assert main(["profile", f"{tmp_path}/missing.py:tiny"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["profile", f"{path}:tiny", "--ranks", "1"]) == 2
    assert "--ranks at least 2" in capsys.readouterr().err


def test_live_bytes_counts_storages_once_and_frees() -> None:
    from orgel.profile.memory import LiveBytes

    x = torch.randn(256)  # made before the mode: not counted
    with LiveBytes() as mode:
        y = x * 2  # 1 KiB
        view = y[:10]  # a view: same storage
        z = y + 1  # another 1 KiB
        del z
        peak_then = mode.peak
    assert peak_then == 2 * 256 * 4
    assert mode.now == 256 * 4 and view.numel() == 10


def test_optimizer_temporary() -> None:
    from orgel.profile.memory import optimizer_temporary

    params = [torch.randn(64, 64), torch.randn(64)]
    assert optimizer_temporary(params, "sgd") == 0.0
    assert optimizer_temporary(params, "adamw") > 0.5
    with pytest.raises(ValueError, match="optimizer must be one of"):
        optimizer_temporary(params, "lion")


def test_fit_overhead_recovers_the_overhead() -> None:
    from orgel.profile.overhead import fit_overhead
    from orgel.schedule.costs import Costs, Link, StageCost
    from orgel.schedule.families import build_schedule
    from orgel.sim import simulate

    link = Link(0.2, 0.0)
    plan = build_schedule("1f1b", 2, 8)
    stage = StageCost(fwd=0.0, bwd=0.0)
    step = simulate(plan, Costs([stage, stage], link=link, action_overhead=0.7)).step_time
    assert fit_overhead(step, 8, link) == pytest.approx(0.7, rel=1e-6)
