"""Cost-model accuracy mechanisms: interleaved timing, the loss's attribution, cache
re-checks, the end of step (per-step overhead, per-block optimizer) and its fit."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import orgel.profile.measure as measure_mod
import orgel.profile.workload as profile_mod
from orgel.costs.blocks import BlockCosts, stage_cost
from orgel.plan.planner import plan
from orgel.plan.predict import end_of_step
from orgel.profile.memory import optimizer_jobs
from orgel.profile.overhead import _simulated, fit_overheads
from orgel.profile.timing import Timer, interleaved
from orgel.profile.workload import profile_workload
from orgel.schedule.costs import Link
from test_profile import tiny


def test_rounds_run_every_job_once_each() -> None:
    order: list[str] = []
    jobs = [{"a": (lambda: None, lambda _: order.append("a")),
             "b": (lambda: None, lambda _: order.append("b"))},
            {"c": (lambda: None, lambda _: order.append("c"))}]
    stats: dict[str, float] = {}
    out = interleaved(jobs, Timer(torch.device("cpu"), warmup=1, repeats=3), stats=stats)
    # Round after round, never one job repeated back to back.
    assert order == ["a", "b", "c"] * 4
    assert [sorted(o) for o in out] == [["a", "b"], ["c"]]
    assert stats["wall_per_cpu"] > 0


def test_job_time_is_its_cpu_median_not_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = iter([(4.0, 2.0), (30.0, 10.0), (2.0, 2.0), (2.0, 2.0), (2.0, 2.0),
                    (10.0, 10.0)])

    def fake(self: Timer, setup: Any, work: Any) -> tuple[float, float]:
        return next(samples)

    monkeypatch.setattr(Timer, "sample", fake)
    jobs = [{"small": (lambda: None, lambda _: None)}, {"big": (lambda: None, lambda _: None)}]
    stats: dict[str, float] = {}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = interleaved(jobs, Timer(torch.device("cpu"), warmup=0, repeats=3), stats=stats)
    finally:
        torch.set_num_threads(before)
    # Each job its median CPU time; the load (wall 50 ms over CPU 28 ms) is reported.
    assert out[0]["small"] == pytest.approx(2.0) and out[1]["big"] == pytest.approx(10.0)
    assert stats["wall_per_cpu"] == pytest.approx(50 / 28)


def fixed_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed job takes 1 ms; all blocks in sequence take 2 ms per block (scale 1)."""
    def fake(jobs: list[dict[str, Any]], timer: Timer, **kwargs: Any) -> list[dict[str, float]]:
        blocks = sum(1 for g in jobs if "inp" in g)
        return [{k: (2.0 * blocks if k == "whole" else 1.0) for k in g} for g in jobs]

    monkeypatch.setattr(measure_mod, "interleaved", fake)


def test_the_loss_lands_in_the_last_blocks_forward_and_input_half(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fixed_times(monkeypatch)
    costs = profile_workload(tiny(), microbatches=2, blocks=3, link=False, repeats=1,
                             progress=False, use_cache=False)
    assert costs.meta["in_sequence_scale"] == pytest.approx(1.0)
    # Blocks: fwd 1, bwd 1 (I 1 and W 1 measured: W gets half of bwd). The loss's
    # forward (1) and backward (1) go to the last block, its W stays.
    assert costs.fwd == pytest.approx([1.0, 1.0, 2.0])
    assert costs.bwd == pytest.approx([1.0, 1.0, 2.0])
    assert costs.wgrad == pytest.approx([0.5, 0.5, 0.5])
    # One backward's halves (the table): I = bwd - wgrad over blocks 1 and 2.
    assert stage_cost(costs, [1, 2]).input_grad == pytest.approx(0.5 + 1.5)
    # A split schedule's stage takes the halves measured apart: I 1 + 2, W 1 + 1.
    last = stage_cost(costs, [1, 2], split=True)
    assert (last.input_grad, last.weight_grad) == pytest.approx((1.0 + 2.0, 2.0))
    # The halves as measured (I 1, W 1): the loss's backward is the last block's I too.
    assert costs.split_input == pytest.approx([1.0, 1.0, 2.0])
    assert costs.split_weight == pytest.approx([1.0, 1.0, 1.0])
    # Every block's optimizer step was timed (each block here has parameters).
    assert costs.optimizer_ms == pytest.approx([1.0, 1.0, 1.0])


def test_cached_table_is_measured_again_when_the_blocks_drift(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = tiny()
    first = profile_workload(w, microbatches=2, blocks=3, link=False, repeats=1,
                             progress=False)
    (path,) = [p for p in cache.iterdir() if p.name.startswith("blocks-")]
    data = json.loads(path.read_text())
    assert data["whole_ms"] > 0
    measured: list[int] = []
    real = profile_mod.measure_table

    def spy(*args: Any, **kwargs: Any) -> Any:
        measured.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile_mod, "measure_table", spy)
    # Within any tolerance: the cached table as it is.
    again = profile_workload(w, microbatches=2, blocks=3, link=False, repeats=1,
                             progress=False, recheck=1000.0)
    assert not measured and again.fwd == first.fwd
    # A table whose blocks took 1000x longer than they do now is stale: measured again.
    data["whole_ms"] *= 1000.0
    data["fwd"] = [1e6] * len(data["fwd"])
    path.write_text(json.dumps(data))
    fresh = profile_workload(w, microbatches=2, blocks=3, link=False, repeats=1,
                             progress=False)
    assert measured == [1] and max(fresh.fwd) < 1e6
    assert json.loads(path.read_text())["whole_ms"] < data["whole_ms"]
    with pytest.raises(ValueError, match="recheck"):
        profile_workload(w, microbatches=2, blocks=3, link=False, recheck=0)


def test_drift_check_confirms_a_quick_sample_before_the_table_goes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm start's check is one quick sample; only when it is off does a longer one
    decide: a spike in the quick sample keeps the table, a machine off in both loses it."""
    blocks: Any = SimpleNamespace(split=SimpleNamespace(stages=[]), train=lambda: None,
                                  busy=lambda *_: contextlib.nullcontext())
    repeats: list[int] = []

    def check(*samples: float) -> bool:
        found = iter(samples)

        def timed(jobs: Any, timer: Timer, **_: Any) -> list[dict[str, float]]:
            repeats.append(timer.repeats)
            return [{"whole": next(found)}]

        monkeypatch.setattr(measure_mod, "interleaved", timed)
        monkeypatch.setattr(measure_mod, "spin_up", lambda *_: None)
        repeats.clear()
        return measure_mod.drifted(blocks, {"whole_ms": 10.0}, torch.device("cpu"), 1, 1, 0.25)

    assert not check(11.0) and repeats == [measure_mod.CHECK_REPEATS]
    assert not check(20.0, 10.5) and repeats == [measure_mod.CHECK_REPEATS, 5]
    assert check(20.0, 19.0) and check(5.0, 6.0)
    assert measure_mod.drifted(blocks, {}, torch.device("cpu"), 1, 1, 0.25)  # no whole_ms


def test_optimizer_jobs_step_copies_of_each_group() -> None:
    lin = nn.Linear(4, 4)
    before = lin.weight.detach().clone()
    jobs = optimizer_jobs([list(lin.parameters()), []], "adamw")
    assert list(jobs[0]) == ["optimizer"] and jobs[1] == {}
    setup, work = jobs[0]["optimizer"]
    work(setup())
    assert torch.equal(lin.weight, before)  # the model's own weights are left alone
    with pytest.raises(ValueError, match="optimizer"):
        optimizer_jobs([[lin.weight]], "lion")


def chain(**measured: Any) -> BlockCosts:
    n = 4
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[1 << 20] * n,
                      activations=[1 << 10] * n, output=[1 << 10] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)], link=Link(latency=0.1),
                      optimizer_ms_per_mib=0.5, **measured)


def test_end_of_step_uses_the_measured_step_overhead_and_block_optimizer_times() -> None:
    per_block = [0.1, 0.2, 0.3, 4.0]
    costs = chain(step_overhead=2.0, optimizer_ms=per_block)
    result = plan(costs, 2, 4, planner="uniform-layers")
    p = result.plan
    per_rank = [0.0, 0.0]
    for s, ranks in enumerate(p.placement):
        for r in ranks:
            per_rank[r] += sum(per_block[b] for b in p.stage_graph.stages[s].blocks)
    assert end_of_step(costs, p) == pytest.approx(2.0 + max(per_rank))
    assert p.prediction["end_of_step"] == pytest.approx(2.0 + max(per_rank))
    # Without them: two latencies for the all-reduce and the per-MiB optimizer model.
    old = chain()
    assert end_of_step(old, p) == pytest.approx(0.2 + 0.5 * 2)
    # They travel with the costs file.
    again = BlockCosts.from_dict(costs.to_dict())
    assert (again.step_overhead, again.optimizer_ms) == (2.0, per_block)


def test_fit_overheads_separates_per_action_and_per_step_costs() -> None:
    link = Link(latency=0.3, per_mib=0.1)
    measured = {m: _simulated(m, link)(0.7) + 5.0 for m in (4, 16)}
    action, step = fit_overheads(measured, link)
    assert action == pytest.approx(0.7, rel=1e-6)
    assert step == pytest.approx(5.0, rel=1e-6)
    with pytest.raises(ValueError, match="two"):
        fit_overheads({4: 1.0}, link)


def test_weight_kept_counts_the_output_gradient_w_holds() -> None:
    from orgel.profile.blocks import measure_block
    from orgel.split.types import StageModule

    rows = 64
    stage = StageModule(index=0, module=nn.Linear(128, 256), inputs=["x"], outputs=["y"])
    m = measure_block(stage, [torch.randn(rows, 128)], Timer(torch.device("cpu"), warmup=0,
                                                                repeats=1))
    # A linear layer's weight gradient is grad(y)^T x: W holds the gradient that
    # arrived at its output from I until it runs (the runtime's I keeps it).
    assert m.weight_kept >= rows * 256 * 4


def test_runtime_overhead_is_kept_with_the_blocks_table(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    links = [Link(latency=0.1, per_mib=0.2)]
    fits: list[Link] = []

    def fake_overhead(link: Link) -> tuple[float, float]:
        fits.append(link)
        return 0.3, 4.0

    monkeypatch.setattr(profile_mod, "link_costs", lambda **_: (links[0], {}))
    monkeypatch.setattr(profile_mod, "runtime_overhead", fake_overhead)
    w = tiny()
    costs = profile_workload(w, microbatches=2, blocks=3, repeats=1, progress=False)
    assert fits == [links[0]]
    assert costs.step_overhead == 4.0 and costs.action_overhead >= 0.3
    # The same table again: its overhead comes with it.
    again = profile_workload(w, microbatches=2, blocks=3, repeats=1, progress=False,
                             recheck=None)
    assert len(fits) == 1 and again.step_overhead == 4.0
    # Another link: the per-action fit depends on it, so it is measured again.
    links[0] = Link(latency=0.5, per_mib=0.2)
    profile_workload(w, microbatches=2, blocks=3, repeats=1, progress=False, recheck=None)
    assert fits[-1] == links[0] and len(fits) == 2


def test_runtime_overhead_is_measured_once_per_host(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import orgel.profile.overhead as overhead_mod

    measured: list[Link] = []

    def fake_measure(link: Link) -> tuple[float, float]:
        measured.append(link)
        return 0.3, 4.0

    monkeypatch.setattr(overhead_mod, "measure_overhead", fake_measure)
    link = Link(latency=0.1, per_mib=0.2)
    # a property of the host: every model planned after the first reads it from the cache
    assert profile_mod.runtime_overhead(link) == (0.3, 4.0)
    assert profile_mod.runtime_overhead(link) == (0.3, 4.0)
    assert measured == [link]
    other = Link(latency=0.5, per_mib=0.2)  # the fit depends on the link: measured again
    assert profile_mod.runtime_overhead(other) == (0.3, 4.0) and measured == [link, other]
    assert any(cache.glob("overhead-*.json"))


def test_what_i_keeps_for_w_is_alive_from_i_not_from_f() -> None:
    import numpy as np

    from orgel.sim.memory import MemoryLayout, peak_memory

    # One rank, one stage: F0 F1 F2 I0 W0 I1 W1 I2 W2 (kinds 0 F, 2 I, 3 W).
    kinds = np.array([0, 0, 0, 2, 3, 2, 3, 2, 3])
    n = len(kinds)
    layout = MemoryLayout.build(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), kinds,
                                np.array([0, n]), [(0,)], [False])
    starts = np.arange(n, dtype=np.float64)
    common = dict(rebuilt=np.array([0.0]), temporary=np.array([0.0]),
                  static=np.array([0.0]), share=np.array([1.0]), compute_start=starts,
                  compute_end=starts + 1, msg_start=np.zeros(0), msg_recv=np.zeros(0, dtype=int),
                  msg_bytes=np.zeros(0))
    # Counted from F (folded into the activations): three forwards' worth at once.
    folded = peak_memory(layout, keep=np.array([110.0]), **common)
    # From I to W: the three forwards' activations, and one I's keep at a time.
    late = peak_memory(layout, keep=np.array([100.0]), weight_kept=np.array([10.0]), **common)
    assert int(folded[0]) == 330 and int(late[0]) == 310


def test_split_stages_take_their_measured_halves() -> None:
    from orgel.plan.predict import predicted
    from orgel.plan.scorer import Scorer
    from orgel.plan.templates import Template
    from orgel.schedule.families import build_schedule

    inp, weight = [0.5, 1.5, 1.6, 1.7], [2.0, 1.2, 1.3, 1.4]
    costs = chain(split_input=inp, split_weight=weight)
    scorer = Scorer(costs)
    zb = Template("zb-h1", "zb-h1", {}, build_schedule("zb-h1", 2, 4))
    p = scorer.to_plan(zb, [range(0, 2), range(2, 4)])
    assert p.costs is not None
    first, last = p.costs.stages
    assert (first.bwd, first.weight_grad) == (4.0, 4.0)  # fed by no stage: W is all of B
    assert last.input_grad == pytest.approx(1.6 + 1.7)
    assert last.weight_grad == pytest.approx(1.3 + 1.4)
    # The search scores what the prediction says (the halves as measured).
    chain_stages = scorer.chain_stage_costs([2], split=True)
    assert chain_stages[1] == last
    p, sim = predicted(p, costs)
    end = p.prediction["end_of_step"]  # type: ignore[index]
    assert sim.step_time == pytest.approx(scorer.score_chain(zb, [2]).step_time + end)
    # 1F1B runs whole backwards: its stages keep the table's B.
    ofob = Template("1f1b", "1f1b", {}, build_schedule("1f1b", 2, 4))
    q = scorer.to_plan(ofob, [range(0, 2), range(2, 4)])
    assert q.costs is not None and [s.bwd for s in q.costs.stages] == [4.0, 4.0]


def test_measured_halves_and_optimizer_times_in_the_costs_file() -> None:
    from orgel.costs.fields import CostsFileError

    costs = chain(split_input=[1.0] * 4, split_weight=[2.0] * 4, optimizer_ms=[0.1] * 4,
                  step_overhead=0.5)
    data = costs.to_dict()
    assert data["blocks"][0]["split_input"] == 1.0 and data["step_overhead"] == 0.5
    again = BlockCosts.from_dict(data)
    assert (again.split_input, again.split_weight) == ([1.0] * 4, [2.0] * 4)
    half = costs.scaled(0.5)  # times scale with rows, the optimizer's do not
    assert (half.split_input[0], half.optimizer_ms[0], half.step_overhead) == (0.5, 0.1, 0.5)
    del data["blocks"][0]["split_weight"]
    with pytest.raises(CostsFileError, match="split_weight.*one per block"):
        BlockCosts.from_dict(data)
    with pytest.raises(CostsFileError, match="together"):
        chain(split_input=[1.0] * 4)
