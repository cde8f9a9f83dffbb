"""Coarsening: blocks are convex, follow module boundaries, keep branches apart, sum facts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orgel.graph import BlockGraph, OpGraph, capture, coarsen, from_groups
from orgel.workload import Workload, microbatches
from zoo import workload

_CACHE: dict[str, OpGraph] = {}




def _graph(name: str) -> OpGraph:
    if name not in _CACHE:
        w = Workload(*workload(name))
        _CACHE[name] = capture(w.model, microbatches(w, 2)[0][0])
    return _CACHE[name]


def _reachable(g: OpGraph) -> dict[str, set[str]]:
    """Every node's descendants."""
    users = g.users()
    reach: dict[str, set[str]] = {}
    for name in reversed(list(g.nodes)):
        reach[name] = set()
        for u in users[name]:
            reach[name] |= {u} | reach[u]
    return reach


def _assert_valid(bg: BlockGraph) -> None:
    g = bg.opgraph
    assert [n for b in bg.blocks for n in b.nodes] == list(g.nodes)  # each node once, in order
    assert all(e.src < e.dst for e in bg.edges)  # block order is topological
    reach = _reachable(g)
    node_block = bg.node_block
    for block in bg.blocks:  # convex: no path leaves the block and comes back
        inside = set(block.nodes)
        for n in block.nodes:
            outside = {m for m in reach[n] if node_block[m] != block.index}
            assert not any(reach[m] & inside for m in outside), block.name
    assert sum(b.flops for b in bg.blocks) == sum(n.flops for n in g.nodes.values())
    assert sum(b.saved_bytes for b in bg.blocks) == sum(n.saved_bytes for n in g.nodes.values())


@pytest.mark.parametrize("name", ["gpt", "unet", "mmt", "dlrm", "resnet"])
@pytest.mark.parametrize("target", [4, 12, 40])
def test_blocks_are_convex_and_sum_facts(name: str, target: int) -> None:
    bg = coarsen(_graph(name), target)
    # Leaf modules are not cut below the average cost, so a fine target may give fewer.
    assert len(bg.blocks) == target if target <= 12 else len(bg.blocks) <= target
    _assert_valid(bg)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["encoder", "blocks"] and len(parts) > 2 else None


def test_transformer_layers_are_block_boundaries() -> None:
    g = _graph("gpt")
    layers = {_layer(n.module) for n in g.nodes.values()} - {None}
    # One block per layer (+ embeddings, head) needs slack: the best-balanced
    # 4 blocks would cut the layers in the middle.
    for target, slack in ((len(layers) + 2, 1.0), (12, 0.5), (20, 0.5)):
        for block in coarsen(g, target, slack=slack).blocks:
            assert len({_layer(g.nodes[n].module) for n in block.nodes} - {None}) <= 1


def test_branches_stay_apart_and_meet_at_the_head() -> None:
    g = _graph("mmt")
    bg = coarsen(g, 12)
    for block in bg.blocks:
        branches = {g.nodes[n].module.split(".")[1] for n in block.nodes
                    if g.nodes[n].module.startswith("branches.")}
        assert len(branches) <= 1, block.name
    (join, preds) = bg.joins()[-1]
    assert len(preds) == 4  # the four branch encoders meet in one block
    assert all(not set(bg.predecessors(p)) & set(preds) for p in preds)  # independent


def test_long_skips_are_block_edges_with_bytes() -> None:
    bg = coarsen(_graph("unet"), 12)
    skips = bg.skips()
    assert skips and all(e.nbytes > 0 for e in skips)
    for e in bg.edges:
        assert e.nbytes == sum(bg.opgraph.nodes[v].nbytes for v in e.values)


def test_a_leaf_module_stays_in_one_block() -> None:
    g = _graph("resnet")
    bg = coarsen(g, 40)
    node_block = bg.node_block
    for module in {n.module for n in g.nodes.values() if ".bn" in n.module}:
        assert len({node_block[n.name] for n in g.nodes.values() if n.module == module}) == 1


class Flat(nn.Module):
    """No submodules: every op sits at the root, so only cost can split it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(16, 16)) for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.w:
            x = torch.tanh(x @ w)
        return x


def test_cost_splits_a_flat_model_evenly() -> None:
    g = capture(Flat(), (torch.randn(4, 16),))
    bg = coarsen(g, 4)
    _assert_valid(bg)
    flops = [b.flops for b in bg.blocks]
    assert max(flops) <= 1.5 * min(flops)
    assert all(b.params for b in bg.blocks) and bg.blocks[0].param_bytes == 2 * 16 * 16 * 4


def test_block_facts_and_errors() -> None:
    g = _graph("gpt")
    bg = coarsen(g, 6)
    assert {m for b in bg.blocks for m in b.model_inputs} == set(g.model_inputs)
    assert bg.blocks[-1].produces_output and bg.order() == list(range(6))
    assert sum(b.output_bytes for b in bg.blocks) >= sum(e.nbytes for e in bg.edges)
    with pytest.raises(ValueError, match="positive integer"):
        coarsen(g, 0)
    names = list(g.nodes)
    groups = from_groups(g, [names[:5], names[5:]])
    assert [len(b.nodes) for b in groups.blocks] == [5, len(names) - 5]
    with pytest.raises(ValueError, match="in the graph's node order"):
        from_groups(g, [names[5:], names[:5]])


def _reference_cuts(c, k, depth, glue_sum, slack):  # type: ignore[no-untyped-def]
    """The two dynamic programs over every (blocks, segments, start), as first written."""
    import numpy as np

    n = len(c) - 1
    inf = float("inf")
    best = np.full((k + 1, n + 1), inf)
    best[0, 0] = 0.0
    for g in range(1, k + 1):
        for j in range(g, n - (k - g) + 1):
            i = np.arange(g - 1, j)
            best[g, j] = np.min(np.maximum(best[g - 1, i], c[j] - c[i]))
    bound = best[k, n] * (1 + slack) + 1e-9
    average = c[n] / k
    score = np.full((k + 1, n + 1), inf)
    score[0, 0] = 0.0
    back = np.zeros((k + 1, n + 1), dtype=int)
    for g in range(1, k + 1):
        for j in range(g, n - (k - g) + 1):
            i = np.arange(g - 1, j)
            inner = glue_sum[j - 1] - glue_sum[i]
            size = ((c[j] - c[i]) / average) ** 2
            total = score[g - 1, i] + np.where(i > 0, depth[i], 0.0) + inner + size
            total = np.where(c[j] - c[i] <= bound, total, inf)
            m = int(np.argmin(total))
            score[g, j] = total[m]
            back[g, j] = i[m]
    return back


def _path(back, k, n):  # type: ignore[no-untyped-def]
    out, end = [], n
    for g in range(k, 0, -1):
        out.append(int(back[g, end]))
        end = int(back[g, end])
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_fast_grouping_cuts_where_the_full_dynamic_program_does(seed: int) -> None:
    import numpy as np

    from orgel.graph.blocks import _cuts

    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 120))
    k = int(rng.integers(1, min(n, 40) + 1))
    costs = rng.integers(0, 50, n) if seed % 3 else np.full(n, 7)  # ties too
    c = np.concatenate([[0.0], np.cumsum(costs, dtype=float)])
    depth = rng.integers(0, 4, n + 1).astype(float)
    glue_sum = np.cumsum(np.where(rng.random(n + 1) < 0.1, 1000.0, 0.0))
    slack = float(rng.choice([0.0, 0.05, 0.2]))
    assert _path(_cuts(c, k, depth, glue_sum, slack), k, n) == \
        _path(_reference_cuts(c, k, depth, glue_sum, slack), k, n)


def test_the_grouping_scores_its_band_in_chunks_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_cuts`` scores every (block end, block start) cell of a band at once; cut into
    chunks of a few rows (a bound on memory for long graphs), it chooses the same."""
    import numpy as np

    from orgel.graph import blocks

    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(2, 120))
        k = int(rng.integers(1, min(n, 12) + 1))
        c = np.concatenate([[0.0], np.cumsum(rng.integers(1, 100, n).astype(float))])
        depth = rng.integers(0, 4, n + 1).astype(float)
        glue = np.cumsum((rng.random(n + 1) < 0.1) * 1000.0)
        whole = blocks._cuts(c, k, depth, glue, 0.2)
        monkeypatch.setattr(blocks, "_BAND", 5)
        assert (blocks._cuts(c, k, depth, glue, 0.2) == whole).all()
        monkeypatch.undo()
