"""DualPipeV: the order DeepSeek published (as torch's ScheduleDualPipeV runs it), its bubble in
the simulator, the planner choosing it when it wins, and exact training on local ranks."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from orgel.cli import main
from orgel.costs.blocks import BlockCosts
from orgel.explicit.api import pipeline
from orgel.graph.capture import capture
from orgel.models import build
from orgel.plan import plan
from orgel.plan.balanced import balanced_plan
from orgel.schedule.costs import Costs, Link
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import PlanError
from orgel.sim.simulate import simulate
from orgel.workload import Workload, microbatches

MiB = 1 << 20


def _torch_order(ranks: int, m: int) -> list[list[tuple[str, int, int]]]:
    """torch's ScheduleDualPipeV order, its overlapped pairs flattened, in orgel's letters."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV")
    names = {schedules.FORWARD: "F", schedules.FULL_BACKWARD: "B",
             schedules.BACKWARD_INPUT: "I", schedules.BACKWARD_WEIGHT: "W"}

    class Sizes:  # what the order computation reads of the schedule object
        pp_group_size = ranks
        _n_microbatches = m

    out = []
    for r in range(ranks):
        flat: list[tuple[str, int, int]] = []
        for a in schedules.ScheduleDualPipeV._calculate_single_rank_operations(Sizes(), r):
            for sub in (a.sub_actions or ()) if a.computation_type not in names else (a,):
                flat.append((names[sub.computation_type], sub.stage_index,
                             sub.microbatch_index))
        out.append(flat)
    return out


@pytest.mark.parametrize("ranks,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 13)])
def test_the_order_is_deepseeks_as_torch_runs_it(ranks: int, m: int) -> None:
    ours = build_schedule("dualpipev", ranks, m)
    assert ours.placement == [(s if s < ranks else 2 * ranks - 1 - s,) for s in range(2 * ranks)]
    assert [[(a.kind, a.stage, a.microbatch) for a in actions] for actions in ours.schedule] \
        == _torch_order(ranks, m)


def test_its_bubble_under_uniform_costs_is_below_zero_bubble_and_1f1b() -> None:
    """The same model on 4 ranks, 16 micro-batches: 1F1B and ZB-H1 on 4 stages of forward
    2, backward 4 (weight gradient 2); DualPipeV on 8 stages of half that. The work is
    96 per rank; what is left over is the bubble."""
    steps = {name: simulate(build_schedule(name, 4, 16), Costs.uniform(n, f, b, bwd_weight=w))
             .step_time for name, n, f, b, w in [("1f1b", 4, 2.0, 4.0, 2.0),
                                                 ("zb-h1", 4, 2.0, 4.0, 2.0),
                                                 ("dualpipev", 8, 1.0, 2.0, 1.0)]}
    assert steps == pytest.approx({"1f1b": 96 + 18, "zb-h1": 96 + 6, "dualpipev": 96 + 3})


def test_too_few_microbatches_say_how_many() -> None:
    with pytest.raises(PlanError, match="at least 2 \\* ranks = 8 micro-batches, got 6"):
        build_schedule("dualpipev", 4, 6)


def test_the_planner_chooses_it_when_it_wins() -> None:
    """Under a memory cap the interleaved schedules do not fit; DualPipeV holds fewer
    micro-batches' activations and beats the ZB-H1 the search settled on before."""
    rng = random.Random(0)
    fwd = [rng.uniform(0.9, 1.1) for _ in range(32)]
    costs = BlockCosts(fwd=fwd, bwd=[2 * f for f in fwd], wgrad=list(fwd),
                       params=[4 * MiB if i % 2 else 0 for i in range(32)],
                       activations=[64 * MiB] * 32, output=[MiB] * 32, temporary=[0] * 32,
                       edges=[(i, i + 1) for i in range(31)], link=Link(0.001, 0.001))
    capped = plan(costs, 4, 8, memory=3 << 30)
    assert capped.plan.meta["schedule_label"] == "dualpipev"
    assert max(capped.sim.peak_memory) <= 3 << 30
    zb = plan(costs, 4, 8, memory=3 << 30, families=["zb-h1"])
    assert capped.step_time < zb.step_time
    free = plan(costs, 4, 8)  # without the cap an interleaved schedule is faster
    assert free.plan.meta["schedule_label"] != "dualpipev"
    assert free.step_time < capped.step_time


@pytest.mark.slow
def test_orgel_run_trains_it_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "examples/gpt.py:workload", "--ranks", "2", "--schedule", "dualpipev",
                 "--microbatches", "4", "--steps", "2", "--check", "--optimizer", "adamw",
                 "--lr", "1e-3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dualpipev schedule" in out and "-> OK" in out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 128, (16, 32), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


@pytest.mark.slow
def test_orgel_pipeline_trains_it_exactly() -> None:
    """2 ranks, 4 stages in a V (the loss on rank 0 with the embedding), 4 micro-batches,
    AdamW: losses and weights equal one process accumulating the same micro-batches."""
    model, _, _, loss_fn = build("gpt", batch_size=16, seed=0, n_layers=4, d_model=32)
    reference = copy.deepcopy(model)
    tokens, targets = _batch(0)
    first, _ = microbatches(Workload(copy.deepcopy(model), (tokens,), targets, loss_fn), 4)[0]
    the_plan = balanced_plan(capture(copy.deepcopy(model), first), ranks=2, microbatches=4,
                             schedule="dualpipev")

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(list(params), lr=1e-2, weight_decay=0.1)

    with pipeline(model, (tokens,), targets, loss_fn, ranks=2, microbatches=4, plan=the_plan,
                  optimizer=adamw, threads=1) as pipe:
        assert pipe.plan.meta["schedule"] == "dualpipev"
        losses = [pipe.step(*_batch(s)) for s in range(2)]
        state = pipe.state_dict()
    opt = adamw(reference.parameters())
    expected = []
    for s in range(2):
        x, y = _batch(s)
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            loss = loss_fn(reference(xs), ys) / 4
            loss.backward()
            total += loss.item()
        opt.step()
        expected.append(total)
    assert losses == pytest.approx(expected, rel=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)
