"""plan(): picks the fastest feasible plan, honours memory, recomputes or explains."""

from __future__ import annotations

import random
import re

import pytest

from orgel.costs.blocks import BlockCosts
from orgel.plan import InfeasibleError, plan
from orgel.schedule.costs import Link
from orgel.schedule.ir import Plan
from orgel.schedule.validate import validate

MiB = 1 << 20


def chain(n: int = 24, seed: int = 0) -> BlockCosts:
    rng = random.Random(seed)
    fwd = [rng.uniform(0.5, 2.0) for _ in range(n)]
    return BlockCosts(fwd=fwd, bwd=[2 * f for f in fwd], wgrad=list(fwd),
                      params=[4 * MiB if i % 2 else 0 for i in range(n)],
                      activations=[rng.randint(1, 8) * MiB for _ in range(n)],
                      output=[MiB] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)], link=Link(0.02, 0.05))


def test_auto_beats_or_matches_every_baseline_and_round_trips() -> None:
    result = plan(chain(), 4, 8, max_loops=3)
    validate(result.plan)
    assert result.planner in ("beam", "uniform-layers", "uniform-params", "uniform-time")
    for name, step in result.baselines.items():
        assert step is not None and result.step_time <= step + 1e-9, name
    again = Plan.from_dict(result.plan.to_dict())
    assert [s.blocks for s in again.stage_graph.stages] == \
        [s.blocks for s in result.plan.stage_graph.stages]
    covered = sorted(b for s in again.stage_graph.stages for b in s.blocks)
    assert covered == list(range(24))
    summary = result.summary()
    for key in ("step_time", "search_seconds", "planner", "schedule", "stages",
                "peak_memory", "baselines"):
        assert key in summary


def test_baselines_are_reported_with_the_end_of_step_like_the_plan() -> None:
    costs = chain()
    costs.step_overhead = 50.0  # far more than any split changes
    result = plan(costs, 2, 4, planner="uniform-time")
    assert result.baselines["uniform-time"] == pytest.approx(result.step_time)
    assert all(step is not None and step > 50.0 for step in result.baselines.values())


@pytest.mark.parametrize("planner", ["beam", "uniform-time"])
def test_memory_cap_is_respected(planner: str) -> None:
    costs = chain()
    loose = plan(costs, 4, 8, planner=planner, max_loops=2)
    cap = int(max(loose.sim.peak_memory) * 0.9)
    tight = plan(costs, 4, 8, planner="beam", memory=cap, max_loops=2)
    assert max(tight.sim.peak_memory) <= cap


def test_recompute_when_memory_is_tight() -> None:
    costs = chain()
    costs.activations = [64 * MiB] * 24
    loose = plan(costs, 4, 8, planner="beam", max_loops=1)
    cap = int(min(loose.sim.peak_memory) * 0.5)
    tight = plan(costs, 4, 8, planner="beam", memory=cap, max_loops=1)
    assert any(tight.plan.recompute)
    assert max(tight.sim.peak_memory) <= cap
    assert tight.step_time > loose.step_time  # recompute costs a forward


def test_infeasible_memory_names_what_would_fit() -> None:
    costs = chain()
    with pytest.raises(InfeasibleError, match=r"no plan fits in 10MiB per rank on 4 ranks: "
                       r"the smallest plan found needs [0-9.]+MiB per rank: give --memory"):
        plan(costs, 4, 8, memory=10 * MiB, max_loops=1)


def test_infeasible_sizes_read_right_at_every_scale() -> None:
    """``memory=1024`` said "fits in 0MiB ... needs 1MiB: give --memory 1MiB"."""
    from orgel.commands.plan import parse_size

    tiny = BlockCosts(fwd=[1.0] * 4, bwd=[2.0] * 4, wgrad=[1.0] * 4, params=[700] * 4,
                      activations=[300] * 4, output=[100] * 4, temporary=[0] * 4,
                      edges=[(i, i + 1) for i in range(3)], link=Link(0.02, 0.05))
    with pytest.raises(InfeasibleError) as info:
        plan(tiny, 2, 2, memory=1024, max_loops=1)
    match = re.search(r"fits in (\S+) per rank .* needs (\S+) per rank: give --memory (\S+) ",
                      str(info.value))
    assert match, str(info.value)
    have, need, give = match.groups()
    assert have == "1KiB" and need == give and need != have
    assert parse_size(give) > 1024


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown planner 'fast'"):
        plan(chain(), 2, 2, planner="fast")
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        plan(chain(), 2, 0)
    with pytest.raises(ValueError, match="use at most 24 ranks"):
        plan(chain(), 30, 2)


def test_data_parallel_replicas() -> None:
    costs = chain(12)
    costs.params = [0] * 12  # free all-reduce: replicas only help
    two = plan(costs, 4, 4, planner="uniform-time", dp=2)
    validate(two.plan)
    assert all(len(r) == 2 for r in two.plan.placement)
    assert two.plan.meta["dp"] == 2
    best = plan(costs, 4, 4, max_loops=1, dp=None)
    assert best.step_time <= two.step_time + 1e-9
    with pytest.raises(ValueError, match="dp must be a positive integer that divides ranks=4"):
        plan(costs, 4, 4, dp=3)


def test_families_restrict_the_sequential_search() -> None:
    costs = chain()
    free = plan(costs, 4, 8, planner="beam")
    only = plan(costs, 4, 8, planner="beam", families=["gpipe"])
    assert only.plan.meta["schedule_label"] == "gpipe"
    assert free.step_time <= only.step_time
    with pytest.raises(ValueError, match="families must name some of gpipe, 1f1b"):
        plan(costs, 4, 8, families=["zb-v"])
    with pytest.raises(ValueError, match="families"):
        plan(costs, 4, 8, families=[])


def test_gloo_plans_hold_every_receive_buffer() -> None:
    from dataclasses import replace

    from orgel.plan.predict import held_sends, predict
    from orgel.plan.scorer import Scorer
    from orgel.plan.templates import Template
    from orgel.schedule.comm import derive_comm
    from orgel.schedule.families import build_schedule
    from orgel.sim import simulate

    nccl = chain()
    gloo = replace(nccl, meta={"device": "cpu"})  # profiled on the CPU: runs on gloo
    assert gloo.receives_posted_ahead and not nccl.receives_posted_ahead
    one = Template("1f1b", "1f1b", {}, build_schedule("1f1b", 2, 4))
    scorer = Scorer(gloo)
    p = scorer.to_plan(one, [range(0, 12), range(12, 24)])
    # every message a rank receives in a step, posted at its start into a kept buffer
    posted = [0, 0]
    for m in derive_comm(p).messages:
        posted[m.dst_rank] += m.nbytes
    assert min(posted) > 0
    on_gloo, on_nccl = predict(p, gloo).peak_memory, predict(p, nccl).peak_memory
    # held all the time (not only from a transfer to its receiving action)
    assert all(g >= n for g, n in zip(on_gloo, on_nccl, strict=True)) and on_gloo != on_nccl
    assert on_gloo == [a + b for a, b in zip(
        simulate(p, receives_kept=True).peak_memory, held_sends(p), strict=True)]
    # the search charges them too: its score's peak is the prediction's
    assert scorer.score_chain(one, [12]).peak_memory.tolist() == on_gloo


def test_the_default_search_budget_scales_with_the_problem(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """plan() hands the sequential search search_budget(blocks, ranks) by default, nothing
    with time_limit=None (orgel plan --thorough), and refuses a budget that is no time."""
    import orgel.plan.planner as planner_module
    from orgel.commands.plan import _time_limit

    seen: list[object] = []
    real = planner_module.sequential_plan

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(kwargs["time_limit"])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(planner_module, "sequential_plan", spy)
    costs = BlockCosts(fwd=[1.0] * 12, bwd=[2.0] * 12, wgrad=[1.0] * 12,
                       params=[1 << 20] * 12, activations=[1 << 20] * 12, output=[1 << 20] * 12,
                       temporary=[0] * 12, edges=[(i, i + 1) for i in range(11)],
                       link=Link(0.01, 0.1))
    plan(costs, 4, 8, planner="beam")
    plan(costs, 4, 8, planner="beam", time_limit=None)
    assert seen == [planner_module.search_budget(12, 4), None]
    assert planner_module.search_budget(400, 4) == pytest.approx(0.46)
    assert planner_module.search_budget(2048, 1024) == planner_module.MAX_SEARCH_S
    with pytest.raises(ValueError, match="time_limit must be positive seconds"):
        plan(costs, 4, 8, time_limit=0)

    class Args:
        thorough, time_limit = False, None

    assert _time_limit(Args()) == "auto"  # type: ignore[arg-type]
    Args.thorough = True
    assert _time_limit(Args()) is None  # type: ignore[arg-type]
