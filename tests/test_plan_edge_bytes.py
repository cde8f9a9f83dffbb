"""A stage is sent the values it reads, not every output of the block that makes them."""

from __future__ import annotations

import json

import pytest
import torch

from orgel.costs.blocks import BlockCosts, chain_split, stage_graph
from orgel.costs.devices import load_device
from orgel.costs.fields import CostsFileError
from orgel.graph import capture
from orgel.plan.predict import held_sends
from orgel.plan.scorer import Scorer
from orgel.plan.templates import one_f_one_b
from orgel.profile.roofline import estimate_costs
from orgel.schedule.costs import Link
from orgel.sim.compiled import CompiledPlan
from test_plan_edge_grads import Masked  # layers that all read one mask


def broadcast(mask_only: bool) -> BlockCosts:
    """Block 0 sends its activations (2^24 bytes with the mask) to block 1 and the mask
    (2^20 bytes) to every later block."""
    n = 6
    edges = [*[(i, i + 1) for i in range(n - 1)], *[(0, b) for b in range(2, n)]]
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[1 << 10] * n,
                      activations=[1 << 20] * n, output=[1 << 24] * n, temporary=[0] * n,
                      edges=edges, edge_grads={(0, b): 0 for b in range(2, n)},
                      edge_bytes={(0, b): 1 << 20 for b in range(2, n)} if mask_only else {},
                      link=Link(latency=0.01, per_mib=0.1))


def test_the_roofline_table_says_what_each_edge_carries() -> None:
    with torch.device("meta"):
        model, x = Masked(), torch.empty(32, 32)
    costs = estimate_costs(capture(model, {"x": x}), load_device("h100-80gb"), blocks=4)
    skips = [(a, b) for a, b in costs.edges if b != a + 1]
    # a later block reads the mask (32 x 32 bools), not the activations block 0 makes too
    assert skips and all(costs.edge_bytes.get(e) == 32 * 32 for e in skips)
    assert all(costs.edge_bytes[e] < costs.output[e[0]] for e in skips)
    again = BlockCosts.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert again.edge_bytes == costs.edge_bytes
    assert costs.scaled(2.0).edge_bytes == {e: 2 * n for e, n in costs.edge_bytes.items()}


def test_a_profiled_table_says_what_each_edge_carries_as_the_estimate_does() -> None:
    """The table ``orgel.pipeline`` plans from (measured on this machine) counts what an
    edge carries by the same rule as the roofline estimate (``BlockGraph.edge_bytes``)."""
    from orgel.profile.workload import profile_graph
    from orgel.workload import Workload

    torch.manual_seed(0)
    model, x = Masked(), torch.randn(32, 32)
    work = Workload(model, {"x": x}, torch.zeros(32, 32), torch.nn.functional.mse_loss)
    graph = capture(model, {"x": x[:16]})
    measured = profile_graph(work, graph, microbatches=2, blocks=4, progress=False,
                             link=False, threads=1)
    skips = [(a, b) for a, b in measured.edges if b != a + 1]
    assert skips and all(measured.edge_bytes.get(e) == 16 * 32 for e in skips)  # the mask
    assert all(measured.edge_grads.get(e) == 0 for e in skips)  # a mask sends none back


def test_a_stage_that_reads_the_mask_alone_is_sent_the_mask_alone() -> None:
    blocks = chain_split((2, 4), 6)
    whole, mask = (stage_graph(broadcast(m), blocks) for m in (False, True))
    sizes = {(e.src, e.dst): e.nbytes for e in mask.edges}
    # stage 1 (blocks 2, 3) reads the mask of block 0 and block 1's activations
    assert sizes[(0, 1)] == (1 << 24) + (1 << 20)
    assert sizes[(0, 2)] == 1 << 20  # the mask; before: all of block 0's 2^24 bytes
    assert {(e.src, e.dst): e.nbytes for e in whole.edges}[(0, 2)] == 1 << 24
    # a stage holding block 1 takes the most any of its blocks reads of block 0
    first = stage_graph(broadcast(True), chain_split((1, 4), 6))
    assert {(e.src, e.dst): e.nbytes for e in first.edges}[(0, 1)] == 1 << 24


def test_edge_bytes_must_name_edges() -> None:
    with pytest.raises(CostsFileError, match="edge_bytes"):
        BlockCosts(fwd=[1.0, 1.0], bwd=[1.0, 1.0], wgrad=[0.5, 0.5], params=[0, 0],
                   activations=[0, 0], output=[0, 0], temporary=[0, 0], edges=[(0, 1)],
                   edge_bytes={(1, 0): 0})


def test_a_value_sent_to_several_stages_is_held_once() -> None:
    # stage 0 (blocks 0, 1) sends stage 1 block 1's activations and block 0's mask, and
    # stage 2 the same mask: one tensor, which the sends after F0 hold once
    bc = broadcast(True)
    p = Scorer(bc).to_plan(one_f_one_b(3, 6), chain_split((2, 4), 6))
    held = CompiledPlan(p).held_send_bytes()
    assert held[0] == (1 << 24) + (1 << 20)  # before: the mask counted twice
    assert held_sends(p)[0] == held[0]
