"""Choosing the micro-batch count for a global batch: candidates, trade-offs, costs files, runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orgel.costs.blocks import BlockCosts
from orgel.costs.fields import CostsFileError
from orgel.explicit.api import pipeline
from orgel.models import build
from orgel.plan import (
    InfeasibleError,
    auto_plan,
    costs_per_rows,
    microbatch_choices,
    search_microbatches,
)
from orgel.plan.batch import coarse_choices
from orgel.schedule.costs import Link
from orgel.schedule.validate import validate
from orgel.workload import Workload

MiB = 1 << 20


def chain(n: int = 8, *, overhead: float = 0.0, latency: float = 0.0, rows: int = 4
          ) -> BlockCosts:
    """A chain measured at ``rows`` rows per micro-batch: 1 ms forward, 2 ms backward a block."""
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[MiB] * n,
                      activations=[4 * MiB] * n, output=[MiB] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)], link=Link(latency, 0.05),
                      action_overhead=overhead, rows=rows)


def tried(result: object) -> dict[int, float | None]:
    """Micro-batch count -> predicted step ms (None: does not fit), from the plan's meta."""
    meta = result.plan.meta  # type: ignore[attr-defined]
    return {c["microbatches"]: c["step_time"] for c in meta["microbatch_search"]}


def test_candidates_divide_the_batch_and_give_replicas_whole_rows() -> None:
    assert microbatch_choices(24, 2) == [2, 3, 4, 6, 8, 12]
    assert microbatch_choices(24, 2, per_rank=2) == [2, 3, 4]
    assert microbatch_choices(24, 4, dp=2) == [2, 3, 4, 6, 12]  # 24/8 = 3 rows: odd
    assert microbatch_choices(6, 2, dp=2) == [1, 3]  # pipeline depth 1; rows 6 and 2
    assert microbatch_choices(2, 4) == [1, 2]  # fewer rows than ranks: what there is
    assert microbatch_choices(12, 4, dp=None)[0] == 1  # dp chosen later: from one
    with pytest.raises(ValueError, match="whole rows"):
        microbatch_choices(3, 2, dp=2)
    with pytest.raises(ValueError, match="dp must be a positive integer that divides"):
        microbatch_choices(8, 4, dp=3)
    assert coarse_choices([2, 3, 4, 6, 8, 12, 16, 24, 32, 48]) == [2, 4, 8, 16, 32, 48]


def test_without_per_action_overhead_more_microbatches_never_lose() -> None:
    result = search_microbatches(costs_per_rows(chain()), 12, 2, planner="uniform-time")
    steps = tried(result)
    assert list(steps) == sorted(steps) and 12 in steps
    times = [steps[m] for m in sorted(steps)]
    assert all(a is not None and b is not None and b <= a + 1e-9
               for a, b in zip(times, times[1:], strict=False))
    assert result.plan.microbatches == 12  # one row each: the rows ran out
    assert result.plan.meta["batch"] == 12
    validate(result.plan)


def test_search_tries_counts_coarse_to_fine() -> None:
    base = costs_per_rows(chain(overhead=2.0, latency=0.02))
    asked: list[int] = []

    def costs_at(rows: int) -> BlockCosts:
        asked.append(96 // rows)
        return base(rows)

    result = search_microbatches(costs_at, 96, 2, planner="uniform-time")
    # powers of two first; then the middle count on each side of the best (8): 6 and 12
    assert asked == [2, 4, 8, 16, 6, 12]
    every = {m: search_microbatches(base, 96, 2, planner="uniform-time", choices=[m]).step_time
             for m in microbatch_choices(96, 2)}
    assert result.plan.microbatches == min(every, key=lambda m: every[m]) == 8


def test_large_per_action_overhead_picks_fewer_microbatches() -> None:
    free = search_microbatches(costs_per_rows(chain()), 64, 2)
    costly = search_microbatches(costs_per_rows(chain(overhead=20.0, latency=5.0)), 64, 2)
    assert costly.plan.microbatches < free.plan.microbatches
    assert costly.plan.microbatches == 2
    best = min(t for t in tried(costly).values() if t is not None)
    assert costly.step_time == pytest.approx(best)


def test_memory_cap_pushes_toward_smaller_microbatches() -> None:
    costs = costs_per_rows(chain(overhead=20.0, latency=5.0))
    loose = search_microbatches(costs, 64, 2, planner="uniform-time")
    assert loose.plan.microbatches == 2
    cap = int(max(loose.sim.peak_memory) * 0.8)
    tight = search_microbatches(costs, 64, 2, planner="uniform-time", memory=cap)
    assert tight.plan.microbatches > 2 and max(tight.sim.peak_memory) <= cap
    assert tried(tight)[2] is None  # the count that won without a cap no longer fits
    entry = tight.plan.meta["microbatch_search"][0]
    assert entry["feasible"] is False and entry["rows"] == 32
    with pytest.raises(InfeasibleError, match=r"no micro-batch count fits a batch of 64 rows "
                       r"\(tried 2, 4, 8, 16\); with 16 micro-batches of 4 rows: no plan fits"):
        search_microbatches(costs, 64, 2, memory=MiB)


def test_data_parallel_replicas_get_whole_rows() -> None:
    costs = chain()
    costs.params = [0] * 8  # a free gradient all-reduce
    result = search_microbatches(costs_per_rows(costs), 24, 4, dp=2, planner="uniform-time")
    assert all(c["rows"] % 2 == 0 for c in result.plan.meta["microbatch_search"])
    assert all(len(r) == 2 for r in result.plan.placement)
    validate(result.plan)


def test_options_are_checked() -> None:
    costs_at = costs_per_rows(chain())
    with pytest.raises(ValueError, match="do not divide the batch of 12 rows"):
        search_microbatches(costs_at, 12, 2, choices=[5])
    with pytest.raises(ValueError, match="rows follows from each candidate count"):
        search_microbatches(costs_at, 12, 2, rows=3)
    with pytest.raises(ValueError, match=r"add \"rows\": N"):
        costs_per_rows(chain(rows=4).scaled(1 / 3))  # 4/3 rows: unknown
    model, inputs, targets, loss_fn = build("gpt", batch_size=4, n_layers=1, d_model=16)
    with pytest.raises(ValueError, match="microbatches must be a positive int or 'auto'"):
        pipeline(model, inputs, targets, loss_fn, microbatches="many")
    with pytest.raises(ValueError, match="leave graph and rows out"):
        auto_plan(Workload(model, inputs, targets, loss_fn), object(), ranks=2,
                  microbatches=None)


def test_costs_scale_linearly_with_rows_and_keep_the_overhead() -> None:
    base = chain(overhead=0.3, rows=4)
    eight = costs_per_rows(base)(8)
    assert eight.rows == 8 and eight.action_overhead == 0.3
    assert eight.fwd == [2.0] * 8 and eight.activations == [8 * MiB] * 8
    assert eight.params == base.params and eight.link == base.link
    assert base.scaled(0.5).rows == 2


def test_costs_file_rows_round_trip_and_checks(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    chain(rows=4).save(path)
    assert json.loads(path.read_text())["rows"] == 4
    assert BlockCosts.load(path).rows == 4
    data = chain(rows=4).to_dict()
    del data["rows"]
    assert BlockCosts.from_dict(data).rows is None
    with pytest.raises(CostsFileError, match="rows must be a positive integer"):
        BlockCosts.from_dict(dict(data, rows=0))
    with pytest.raises(CostsFileError, match="rows must be a positive integer"):
        BlockCosts.from_dict(dict(data, rows=2.5))


LR = 0.05


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


@pytest.mark.slow
def test_pipeline_chooses_a_count_and_matches_one_process() -> None:
    # The profile cache is shared with the other orgel.pipeline tests (tests/test_api.py):
    # this host's link and per-action overhead are measured once (about 15 s), not here.
    model, inputs, targets, loss_fn = build("gpt", batch_size=4, seed=0, n_layers=2,
                                            d_model=32)
    reference, _, _, _ = build("gpt", batch_size=4, seed=0, n_layers=2, d_model=32)
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches="auto",
                  optimizer=_sgd, threads=1) as pipe:
        search = pipe.plan.meta["microbatch_search"]
        assert {c["microbatches"] for c in search} == {2, 4}  # the counts that divide 4 rows
        assert pipe.plan.microbatches in {c["microbatches"] for c in search if c["feasible"]}
        loss = pipe.step(inputs, targets)
        state = pipe.state_dict()
    opt = _sgd(list(reference.parameters()))
    expected = loss_fn(reference(*inputs), targets)
    expected.backward()
    opt.step()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-5, msg=name)
