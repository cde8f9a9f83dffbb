"""Split-backward rewrite: I now, W later; valid on chains and DAGs and fills bubbles."""

from __future__ import annotations

from orgel.plan.transforms import split_backward, stage_heights
from orgel.schedule.costs import Costs
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import StageGraph
from orgel.sim import simulate


def test_chain_rewrite_is_valid_and_faster() -> None:
    plain = build_schedule("1f1b", 4, 8)
    zb = split_backward(plain)
    for actions in zb.schedule:
        kinds = [a.kind for a in actions]
        assert kinds.count("F") == kinds.count("I") == kinds.count("W") == 8
        assert "B" not in kinds
    # On a chain the rewrite is ZB-H1.
    assert zb.schedule == build_schedule("zb-h1", 4, 8).schedule
    costs = Costs.uniform(4, fwd=1.0, bwd=2.0, bwd_weight=1.0)
    assert simulate(zb, costs).step_time < simulate(plain, costs).step_time


def test_dag_rewrite_uses_depth() -> None:
    graph = StageGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    base = build_schedule("dag-1f1b", 4, 6, stage_graph=graph,
                          placement=[(0,), (1,), (2,), (3,)])
    assert stage_heights(base) == [0, 1, 1, 2]
    zb = split_backward(base)
    last = [str(a) for a in zb.schedule[3] if a.kind != "F"]
    # The join (two stages upstream) defers each W by two of its backwards.
    assert last[:4] == ["I3.0", "I3.1", "I3.2", "W3.0"]
    first = [str(a) for a in zb.schedule[0] if a.kind != "F"]
    assert first[:2] == ["I0.0", "W0.0"]
