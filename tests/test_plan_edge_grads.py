"""Values that need no gradient (masks, position tables) send nothing back between stages."""

from __future__ import annotations

import json

import pytest
import torch

from orgel.costs.blocks import BlockCosts, chain_split, stage_costs
from orgel.costs.devices import load_device
from orgel.costs.fields import CostsFileError
from orgel.graph import capture
from orgel.plan.scorer import Scorer
from orgel.plan.templates import one_f_one_b
from orgel.profile.roofline import estimate_costs
from orgel.schedule.comm import derive_comm
from orgel.schedule.costs import Link
from orgel.sim import simulate


class Masked(torch.nn.Module):
    """Layers that all read one mask made from the input's shape (no gradient)."""

    def __init__(self, width: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[0], x.shape[1], device=x.device).tril() > 0
        for layer in self.layers:
            x = torch.relu(layer(x)).masked_fill(mask, 0.0)
        return x


def broadcast(grads: bool) -> BlockCosts:
    """Block 0 feeds every block (a mask); the chain carries the activations."""
    n = 6
    edges = [*[(i, i + 1) for i in range(n - 1)], *[(0, b) for b in range(2, n)]]
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[1 << 10] * n,
                      activations=[1 << 20] * n, output=[1 << 24] * n, temporary=[0] * n,
                      edges=edges, edge_grads={} if grads else {(0, b): 0 for b in range(2, n)},
                      link=Link(latency=0.01, per_mib=0.1))


def test_the_roofline_table_says_which_edges_carry_no_gradient() -> None:
    with torch.device("meta"):
        model, x = Masked(), torch.empty(32, 32)
    costs = estimate_costs(capture(model, {"x": x}), load_device("h100-80gb"), blocks=4)
    skips = [(a, b) for a, b in costs.edges if b != a + 1]
    assert skips and all(costs.edge_grads.get(e) == 0 for e in skips)
    again = BlockCosts.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert again.edge_grads == costs.edge_grads
    doubled = costs.scaled(2.0).edge_grads
    assert doubled == {e: 2 * n for e, n in costs.edge_grads.items()}  # bytes per row


def test_gradient_free_edges_cost_no_time_and_hold_no_memory() -> None:
    blocks = chain_split((2, 4), 6)
    full, free = (stage_costs(broadcast(g), blocks) for g in (True, False))
    assert full.edge_grad_bytes is None
    assert free.edge_grad_bytes is not None and 0 < len(free.edge_grad_bytes)
    # stage 0 -> 2 carries only the mask: nothing comes back; 0 -> 1 carries activations
    assert free.edge_grad_bytes[0] == 1 << 24 and free.edge_grad_bytes[1] == 0
    scorer_full, scorer_free = Scorer(broadcast(True)), Scorer(broadcast(False))
    template = one_f_one_b(3, 6)
    a = scorer_full.score_chain(template, (2, 4))
    b = scorer_free.score_chain(template, (2, 4))
    assert b.step_time < a.step_time and b.peak_memory[0] < a.peak_memory[0]
    # the scorer and the simulator of the plan agree
    p = scorer_free.to_plan(template, blocks)
    sim = simulate(p)
    assert sim.step_time == pytest.approx(b.step_time)
    # ... on the messages too: the mask-only edge 0 -> 2 has none back
    mask_only = [i for i, e in enumerate(p.stage_graph.edges) if (e.src, e.dst) == (0, 2)]
    assert [v.grad for v in p.stage_graph.edges[mask_only[0]].values] == [False]
    sent = {(m.edge, m.grad) for m in derive_comm(p).messages}
    assert (mask_only[0], False) in sent and (mask_only[0], True) not in sent


def chain(gradless_cut: int | None) -> BlockCosts:
    """Four blocks in a row; the cut before ``gradless_cut`` sends no gradient back."""
    n = 4
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[1 << 10] * n,
                      activations=[1 << 20] * n, output=[1 << 20] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)],
                      edge_grads={} if gradless_cut is None else {(gradless_cut - 1,
                                                                   gradless_cut): 0},
                      link=Link(latency=0.5, per_mib=0.5))


def test_a_chain_cut_that_sends_no_gradient_has_no_gradient_message() -> None:
    scorer = Scorer(chain(2))
    template = one_f_one_b(2, 4)
    kept = scorer.score_chain(template, (1,))  # a cut with gradients, compiled first
    free = scorer.score_chain(template, (2,))
    assert free.step_time < Scorer(chain(None)).score_chain(template, (2,)).step_time
    for points, score, grads in (((1,), kept, 4), ((2,), free, 0)):
        p = scorer.to_plan(template, chain_split(points, 4))
        assert sum(m.grad for m in derive_comm(p).messages) == grads, points
        assert simulate(p).step_time == pytest.approx(score.step_time), points


def test_edge_grads_must_name_edges() -> None:
    with pytest.raises(CostsFileError, match="edge_grads"):
        BlockCosts(fwd=[1.0, 1.0], bwd=[1.0, 1.0], wgrad=[0.5, 0.5], params=[0, 0],
                   activations=[0, 0], output=[0, 0], temporary=[0, 0], edges=[(0, 1)],
                   edge_grads={(1, 0): 0})
