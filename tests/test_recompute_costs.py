"""Recompute priced per policy: what ``"layer"`` and ``"selective"`` keep, rebuild and run
again, from the capture through the block table and the simulator to the planner's choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from orgel.costs.blocks import BlockCosts, stage_cost
from orgel.costs.recompute import BlockRecompute, stage_policies
from orgel.graph import capture, coarsen
from orgel.graph.kept import kept_bytes
from orgel.plan import plan
from orgel.plan.transforms import runnable_recompute
from orgel.schedule import Costs, StageCost
from orgel.schedule.costs import PolicyCost
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import Plan
from orgel.sim import simulate

LAYER = PolicyCost("layer", kept=300, rebuilt=200, again=4.0)
SELECTIVE = PolicyCost("selective", kept=400, rebuilt=500, again=1.0)


@pytest.mark.parametrize("policy,again,kept,rebuilt", [
    (False, 0.0, 1000, 0), (True, 5.0, 0, 1000), ("layer", 4.0, 300, 200),
    ("selective", 1.0, 400, 500)])
def test_each_policy_keeps_rebuilds_and_runs_again_what_its_facts_say(
        policy: bool | str, again: float, kept: int, rebuilt: int) -> None:
    # one rank, GPipe over M micro-batches: the step is M forwards and M backwards (each
    # backward runs its policy's forward again); the peak is at the first backward: every
    # micro-batch's kept bytes, the gradients, the temporary and what it rebuilds
    m = 3
    stage = StageCost(fwd=5.0, bwd=10.0, params=100, activations=1000, temporary=10,
                      recompute=(LAYER, SELECTIVE))
    p = dataclasses.replace(build_schedule("gpipe", 1, m), recompute=[policy])
    result = simulate(p, Costs([stage]))
    assert result.step_time == pytest.approx(m * (5.0 + 10.0 + again))
    assert max(result.peak_memory) == stage.static_bytes + m * kept + 10 + rebuilt


def test_a_policy_without_facts_is_priced_as_the_stage_whole() -> None:
    stage = StageCost(fwd=5.0, bwd=10.0, params=100, activations=1000, temporary=10)
    whole, layer = (simulate(dataclasses.replace(build_schedule("gpipe", 1, 2), recompute=[r]),
                             Costs([stage])) for r in (True, "layer"))
    assert layer.step_time == whole.step_time
    assert layer.peak_memory == whole.peak_memory


class Blocks(torch.nn.Module):
    """Four transformer-like layers in a ModuleList: what ``"layer"`` checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 32)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_block_facts_add_up_to_what_the_capture_says_each_policy_keeps() -> None:
    from orgel.costs.devices import DEVICES
    from orgel.profile.roofline import estimate_costs

    graph = capture(Blocks(), (torch.randn(8, 16),))
    bg = coarsen(graph, 5)
    table = estimate_costs(graph, DEVICES["h100-80gb"], blockgraph=bg, loss=False)
    assert len(table.recompute) == table.num_blocks
    whole = list(range(table.num_blocks))
    names = [n for b in bg.blocks for n in b.nodes]
    layer, selective = stage_policies(table.recompute, whole)
    # "layer": each layer's inputs and what the nodes outside the layers save, as the one
    # rule (graph.kept) says for the whole model; the largest layer rebuilt at once
    assert (layer.kept, layer.rebuilt) == kept_bytes(graph, names, "layer")
    assert 0 < layer.again < sum(table.fwd)  # the embedding is not run again
    saved = sum(graph.nodes[n].saved_bytes for n in names)
    assert 0 < selective.kept < saved and selective.kept + selective.rebuilt == saved
    assert 0 < selective.again < layer.again  # the cheap ops only
    # a stage sums its blocks' facts; a table scaled for larger micro-batches scales them
    assert stage_cost(table, whole).recompute == (layer, selective)
    doubled = table.scaled(2.0).recompute[1]
    assert doubled.layer_kept == 2 * table.recompute[1].layer_kept
    assert BlockRecompute.from_dict(table.recompute[1].to_dict(), "x") == table.recompute[1]
    assert BlockCosts.from_dict(table.to_dict()).recompute == table.recompute


def chain(n: int, activations: int, facts: BlockRecompute) -> BlockCosts:
    """``n`` equal blocks in a chain whose activations dominate, each with ``facts``."""
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[100] * n,
                      activations=[activations] * n, output=[10_000] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)], recompute=[facts] * n)


def test_the_planner_chooses_each_stages_policy_under_memory() -> None:
    # a chain whose activations dominate: with a tight cap the plan recomputes, and with
    # per-layer facts it keeps what fits at the least cost in time instead of the stage whole
    table = chain(16, 200_000, BlockRecompute(
        layer_kept=40_000, layer_rebuilt=30_000, layer_fwd=0.9, selective_kept=120_000,
        selective_rebuilt=80_000, selective_fwd=0.2))
    loose = plan(table, 4, 8, planner="beam", max_loops=1)
    cap = int(max(loose.sim.peak_memory) * 0.5)
    whole = plan(dataclasses.replace(table, recompute=[]), 4, 8, planner="beam",
                 memory=cap, max_loops=1)
    chosen = plan(table, 4, 8, planner="beam", memory=cap, max_loops=1)
    assert set(whole.plan.recompute) <= {False, True}
    assert {"layer", "selective"} & set(chosen.plan.recompute)
    assert max(chosen.sim.peak_memory) <= cap
    assert chosen.step_time < whole.step_time  # less forward run again
    # a plan file keeps what each policy costs its stages
    assert Plan.from_json(chosen.plan.to_json()).costs == chosen.plan.costs


def test_the_runtime_takes_the_planners_policies_where_it_can_run_them() -> None:
    p = dataclasses.replace(build_schedule("zb-h1", 2, 4), recompute=["selective", "layer"])
    assert runnable_recompute(p).recompute == ["layer", "layer"]
    one = dataclasses.replace(build_schedule("1f1b", 2, 4), recompute=["selective", False])
    assert runnable_recompute(one) is one


def test_where_no_stage_fits_recomputed_whole_the_planner_checkpoints_each_layer() -> None:
    # a stage recomputed whole rebuilds all its activations at once before its backward;
    # one layer at a time fits where that does not
    table = chain(8, 1_000_000, BlockRecompute(
        layer_kept=10_000, layer_rebuilt=1_000_000, layer_fwd=1.0, selective_kept=900_000,
        selective_rebuilt=100_000, selective_fwd=0.1))
    cap = 2_500_000
    with pytest.raises(Exception, match="memory"):
        plan(dataclasses.replace(table, recompute=[]), 2, 4, planner="beam", memory=cap,
             max_loops=1)
    chosen = plan(table, 2, 4, planner="beam", memory=cap, max_loops=1)
    assert "layer" in chosen.plan.recompute and max(chosen.sim.peak_memory) <= cap
