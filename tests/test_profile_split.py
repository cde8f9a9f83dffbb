"""Cost model details: the runtime's I/W halves, what I keeps for W, end of step, companions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from orgel.backward import weight_backward
from orgel.costs.blocks import BlockCosts, stage_cost
from orgel.plan import plan
from orgel.plan.predict import end_of_step, held_sends
from orgel.plan.scorer import Scorer
from orgel.plan.templates import Template, one_f_one_b
from orgel.profile.blocks import measure_block
from orgel.profile.contention import companions
from orgel.profile.timing import Timer
from orgel.schedule.costs import Costs
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import Edge, Plan, Stage, StageGraph, Value
from orgel.schedule.text import parse_schedule
from orgel.split.types import StageModule


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def block() -> StageModule:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 384))
    return StageModule(index=0, module=module, inputs=["x"], outputs=["y"])


class MatmulCount(TorchDispatchMode):
    """Counts the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


class CountingTimer(Timer):
    """A timer that also counts the matrix products of each job it times (by its work)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), warmup=0, repeats=1)
        self.matmuls: dict[Any, int] = {}

    def sample(self, setup: Any, work: Any) -> tuple[float, float]:
        state = setup()
        with MatmulCount() as mode:
            work(state)
        self.matmuls[work] = mode.count
        return super().sample(lambda: setup(), work)


def test_weight_half_is_timed_as_the_runtime_runs_it() -> None:
    rows = 256
    timer = CountingTimer()
    m = measure_block(block(), [torch.randn(rows, 384)], timer)
    assert 0 < m.wgrad <= m.bwd
    # W is timed as the runtime's weight_backward, and it does the parameter side only:
    # one product per weight of the two linear layers. A second autograd.grad over the
    # parameters would walk the input path again (a third and a fourth product); the
    # whole backward does both sides (four).
    assert timer.matmuls[weight_backward] == 2, timer.matmuls
    assert sorted(timer.matmuls.values()).count(4) == 1, timer.matmuls
    # I keeps, for W, at least the gradient arriving at the first layer's output.
    assert m.weight_kept >= rows * 384 * 4
    # A model input gets no gradient (as in the runtime): I computes nothing, W holds
    # just the gradient that arrived at the block's output.
    first = measure_block(block(), [torch.randn(rows, 384)], Timer(torch.device("cpu")),
                          constant=[True])
    assert first.bwd > 0 and first.weight_kept == rows * 384 * 4


def costs(kept: int = 0, opt: float = 0.0) -> BlockCosts:
    n = 4
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[1 << 20] * n,
                      activations=[1 << 20] * n, output=[1 << 16] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)], weight_kept=[kept] * n,
                      optimizer_ms_per_mib=opt)


def test_kept_gradients_count_only_for_split_schedules() -> None:
    bc = costs(kept=1 << 19)
    assert stage_cost(bc, [1, 2]).weight_kept == 0
    split = stage_cost(bc, [1, 2], split=True)
    # kept from I to W (not folded into what F keeps)
    assert (split.activations, split.weight_kept) == (2 << 20, 1 << 20)
    # The first stage gets no input gradient: W is the whole backward, and all
    # its I keeps for W is the gradient of its output (block 1's, 64 KiB).
    first = stage_cost(bc, [0, 1], split=True)
    assert first.activations == 2 << 20 and first.weight_grad == first.bwd == 4.0
    assert first.weight_kept == 1 << 16
    assert stage_cost(bc, [2, 3]).weight_grad == 2.0
    assert Scorer(bc).chain_stage_costs((2,), split=True)[0] == first
    scorer = Scorer(bc)
    plain = one_f_one_b(2, 4)
    zb = next(t for t in _zb_templates() if t.splits_backward)
    assert not plain.splits_backward
    with_kept = scorer.score_chain(zb, (2,))
    without = Scorer(costs()).score_chain(zb, (2,))
    assert with_kept.peak_memory.max() > without.peak_memory.max()
    assert scorer.score_chain(plain, (2,)).peak_memory.max() == \
        Scorer(costs()).score_chain(plain, (2,)).peak_memory.max()


def _zb_templates() -> list[Template]:
    base = build_schedule("zb-h1", 2, 4)
    return [Template("zb-h1", "zb-h1", {}, base)]


def test_end_of_step_adds_loss_reduce_and_the_slowest_optimizer() -> None:
    bc = costs(opt=0.5)
    bc.link = type(bc.link)(latency=0.25, per_mib=0.0)
    result = plan(bc, 2, 4, planner="uniform-layers")
    # 2 MiB of parameters per rank at 0.5 ms/MiB, plus one round trip of the loss.
    assert end_of_step(bc, result.plan) == pytest.approx(2 * 0.5 + 2 * 0.25)
    assert result.plan.prediction["end_of_step"] == pytest.approx(1.5)
    again = BlockCosts.from_dict(bc.to_dict())
    assert again.optimizer_ms_per_mib == 0.5 and again.weight_kept == bc.weight_kept


def test_held_sends_count_one_action_of_sends() -> None:
    bc = costs()
    result = plan(bc, 2, 4, planner="uniform-layers")
    # One cut, 64 KiB per micro-batch: the runtime waits a send once the next
    # action ran, so each rank holds one message at a time, not all four.
    assert held_sends(result.plan) == [1 << 16, 1 << 16]
    bare = plan(bc, 1, 4, planner="uniform-layers")
    assert held_sends(bare.plan) == [0]
    # A stage feeding two stages on two other ranks sends both after one F.
    graph = StageGraph([Stage(f"s{i}") for i in range(3)],
                       [Edge(0, 1, (Value("a", 100),)), Edge(0, 2, (Value("b", 30),))])
    fan = Plan(graph, [(0,), (1,), (2,)], 3, 1,
               parse_schedule("rank0: F0.0 B0.0\nrank1: F1.0 B1.0\nrank2: F2.0 B2.0"),
               costs=Costs.uniform(3, 1.0, 2.0))
    assert held_sends(fan) == [130, 100, 30]


def _touch(path: str) -> None:
    with open(path, "a") as f:
        f.write("x")


@pytest.mark.slow
def test_companions_run_meanwhile(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with companions(1, lambda: _touch(str(marker))):
        pass
    assert marker.exists() and len(marker.read_text()) >= 1
    with pytest.raises(ValueError, match="companions"):
        with companions(-1, lambda: None):
            pass
