"""From blocks to stages: a split's block costs summed into stage costs and the stage DAG.

:func:`stage_cost` sums one stage's blocks (times add up, a tied parameter
counts once, activations freed inside the stage are left out),
:func:`stage_costs` every stage of a split (the :class:`~orgel.schedule.costs.Costs`
that the simulator and the planners score), :func:`stage_graph` builds the stage
DAG with its edge bytes, and :func:`optimizer_peak` is the end-of-step floor.
The table they read, :class:`~orgel.costs.table.BlockCosts` (the costs file),
is re-exported here, where most code imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from orgel.costs.recompute import stage_policies
from orgel.costs.table import BlockCosts
from orgel.costs.tied import tied_shared, tied_within
from orgel.schedule.costs import Costs, StageCost
from orgel.schedule.ir import Edge, Stage, StageGraph, Value

__all__ = ["STEP_SCALARS", "BlockCosts", "RangeMax", "chain_split", "edge_grad_bytes",
           "grad_overlap", "optimizer_peak", "replica_overlap", "replica_stages",
           "reported_peak", "stage_cost", "stage_costs", "stage_graph", "static_parts",
           "unsaved_outputs"]


def stage_cost(bc: BlockCosts, blocks: list[int] | range, *, split: bool = False,
               shared: int = 0, replicas: int = 1) -> StageCost:
    """One stage made of ``blocks``: times add up, temporary is the largest block's.

    ``split``: the schedule splits the backward into ``I`` and ``W``. Then a
    stage takes its blocks' halves as measured apart (``split_input`` and
    ``split_weight``, when the table has them), and ``weight_kept`` is what
    its ``I`` keeps for ``W`` (alive from ``I`` to ``W``). A stage that no
    other stage feeds has no input gradient to compute: its ``W`` is the whole
    backward and its ``I`` only hands over the gradients ``W`` starts from: the
    gradients of its outputs, all it keeps for ``W``.
    A tied parameter counts once however many of ``blocks`` read it;
    ``shared``: parameter bytes another stage on the same rank already holds
    (see :func:`orgel.costs.tied.tied_shared`), left out here. ``replicas``: the
    stage's data-parallel replicas, each of which makes all the gradients from its
    share of the activations (``grad_overlap`` is one replica's: :func:`grad_overlap`).
    """
    inside = set(blocks)
    entered = {b for a, b in bc.edges if b in inside and a not in inside}
    fed = bool(entered)
    freed = _freed(bc, blocks)
    params = sum(bc.params[b] for b in blocks) - tied_within(bc, blocks) - shared
    params, grads, optimizer = static_parts(params, bc.optimizer_factor)
    bwd = sum(bc.bwd[b] for b in blocks)
    weight = sum(bc.wgrad[b] for b in blocks) if fed else bwd
    if split and fed and bc.split_input:
        weight = sum(bc.split_weight[b] for b in blocks)
        bwd = sum(bc.split_input[b] for b in blocks) + weight
    return StageCost(
        fwd=sum(bc.fwd[b] for b in blocks), bwd=bwd, bwd_weight=weight,
        params=params, grads=grads, optimizer=optimizer,
        activations=sum(bc.activations[b] + (bc.input_saved[b] if b in entered else 0)
                        for b in blocks) - freed,
        weight_kept=(0 if not split else sum(bc.weight_kept[b] for b in blocks) if fed
                     else _outgoing(bc, inside)),
        temporary=max((bc.temporary[b] for b in blocks), default=0),
        grad_overlap=replica_overlap(bc, blocks, grads, replicas, freed),
        recompute=stage_policies(bc.recompute, list(blocks)),
    )


def _freed(bc: BlockCosts, blocks: list[int] | range) -> int:
    """Outputs of ``blocks`` that neither their block nor, inside the stage, a consumer
    saves (:func:`unsaved_outputs`)."""
    if not any(bc.output_unsaved):
        return 0
    inside = set(blocks)
    spare, consumers = unsaved_outputs(bc)
    return sum(spare[b] for b in blocks if consumers[b] and consumers[b] <= inside)


def replica_overlap(bc: BlockCosts, blocks: list[int] | range, grads: int, replicas: int,
                    freed: int | None = None) -> int:
    """``StageCost.grad_overlap`` of a stage of ``blocks`` on ``replicas`` ranks: one
    replica's (:func:`grad_overlap` at its share), less its share of the outputs the stage
    frees (``freed``: :func:`_freed`, computed when not given)."""
    freed = _freed(bc, blocks) if freed is None else freed
    return max(0, grad_overlap(bc, blocks, grads, 1.0 / replicas) - freed // replicas)


def replica_stages(bc: BlockCosts, stages: list[StageCost],
                   stage_blocks: list[range] | list[list[int]],
                   placement: list[tuple[int, ...]]) -> list[StageCost]:
    """``stages`` (priced whole) with each replicated stage's overlap its replica's
    (:func:`replica_overlap`), as :func:`stage_costs` prices them given the placement."""
    return [dataclasses.replace(st, grad_overlap=replica_overlap(
                bc, list(stage_blocks[s]), st.grad_bytes, len(ranks)))
            if len(ranks) > 1 else st
            for s, (st, ranks) in enumerate(zip(stages, placement, strict=True))]


def unsaved_outputs(bc: BlockCosts) -> tuple[list[int], list[set[int]]]:
    """Per block: its outputs' bytes that no one saves, and the blocks consuming them.

    A block's ``output_unsaved`` bytes stay alive after the forward only as far
    as a consumer saves its inputs; at most the consumers' ``input_saved`` of
    them is (their saved inputs may come from other blocks too). So a stage
    whose blocks consume all of a block's outputs keeps
    ``output_unsaved - min(output_unsaved, sum of the consumers' input_saved)``
    bytes less than its blocks' ``activations`` add up to: the first list.
    A block no other block reads (a model output) keeps its outputs.
    """
    consumers: list[set[int]] = [set() for _ in range(bc.num_blocks)]
    for a, b in bc.edges:
        consumers[a].add(b)
    spare = [max(0, bc.output_unsaved[b] - sum(bc.input_saved[c] for c in consumers[b]))
             if consumers[b] else 0 for b in range(bc.num_blocks)]
    return spare, consumers


def grad_overlap(bc: BlockCosts, blocks: list[int] | range, grads: int,
                 share: float = 1.0) -> int:
    """Bytes of a stage's activations and ``grads`` never alive together in its backward.

    ``share``: of the activations, for a replica that runs ``share`` of each micro-batch
    and makes all the gradients (the overlap is not proportional to the activations: a
    replica's is at least its share of the whole micro-batch's).

    Autograd runs a backward in the reverse order of the forward (blocks in
    index order) and frees each op's saved tensors once it has run, as it
    makes the gradients of the weights it used. While block ``k`` runs, the
    stage holds at most the gradients of blocks ``>= k`` and the activations
    of blocks ``<= k`` (block ``k`` counted both ways); the peak over ``k``
    is at most activations + gradients, and the difference is the overlap.
    A block's gradients are taken as its whole parameter bytes (a tied
    weight counted in every block that reads it), which only lowers the overlap.
    """
    order = sorted(blocks)
    acts = [int(bc.activations[b] * share) for b in order]
    made = [bc.params[b] for b in order]
    later, peak = sum(made), 0
    earlier = 0
    for a, g in zip(acts, made, strict=True):
        earlier += a
        peak = max(peak, later + earlier)
        later -= g
    return max(0, sum(acts) + grads - peak)


def _outgoing(bc: BlockCosts, inside: set[int]) -> int:
    """Bytes of the outputs of ``inside`` that blocks outside it read (each counted once)."""
    return sum(bc.output[a] for a in {a for a, b in bc.edges if a in inside and b not in inside})


def static_parts(params: int, factor: float) -> tuple[int, int, int]:
    """``(params, grads, optimizer)`` bytes whose sum is ``params x factor``."""
    static = int(params * factor)
    grads = min(params, static - params)
    return params, grads, static - params - grads


def stage_costs(bc: BlockCosts, stage_blocks: list[list[int]] | list[range], *,
                split: bool = False, placement: list[tuple[int, ...]] | None = None) -> Costs:
    """Sum blocks into stages: ``stage_blocks[s]`` lists the blocks of stage ``s``.

    ``placement`` (the plan's, optional) lets a tied parameter count once per
    rank (:func:`orgel.costs.tied.tied_shared`); without it, once per stage; and gives
    each stage's replicas (``StageCost.grad_overlap`` is one replica's).
    """
    shared = (tied_shared(bc, stage_blocks, placement) if placement is not None
              else [0] * len(stage_blocks))
    return Costs(
        stages=[stage_cost(bc, stage_blocks[s], split=split, shared=shared[s],
                           replicas=1 if placement is None else len(placement[s]))
                for s in range(len(stage_blocks))],
        link=bc.link, links=dict(bc.links), action_overhead=bc.action_overhead,
        memory_per_rank=bc.memory_per_rank, node_ranks=bc.node_ranks, node_link=bc.node_link,
        edge_grad_bytes=edge_grad_bytes(bc, stage_blocks), cores=bc.cores,
    )


def edge_grad_bytes(bc: BlockCosts, stage_blocks: list[list[int]] | list[range]
                    ) -> list[int] | None:
    """Bytes each edge of :func:`stage_graph` carries back as gradients (None: all of them).

    A producing block's share is the most that any of its edges into the
    consuming stage carries back (``bc.edge_grads``; the whole output without
    an entry): its values that need a gradient, once per stage as in
    :func:`stage_graph`.
    """
    if not bc.edge_grads:
        return None
    owner = [0] * bc.num_blocks
    for s, blocks in enumerate(stage_blocks):
        for b in blocks:
            owner[b] = s
    grads: dict[tuple[int, int], dict[int, int]] = {}
    for a, b in bc.edges:
        sa, sb = owner[a], owner[b]
        if sa != sb:
            per = grads.setdefault((sa, sb), {})
            per[a] = max(per.get(a, 0), min(edge_out(bc, a, b),
                                            bc.edge_grads.get((a, b), bc.output[a])))
    return [sum(per.values()) for _, per in sorted(grads.items())]


def edge_out(bc: BlockCosts, a: int, b: int) -> int:
    """Bytes block ``a`` sends block ``b`` (``bc.edge_bytes``; all its output without)."""
    return min(bc.output[a], bc.edge_bytes.get((a, b), bc.output[a]))


def stage_graph(bc: BlockCosts, stage_blocks: list[list[int]] | list[range]) -> StageGraph:
    """The stage DAG of a split: one edge per stage pair, one value per producing block.

    A block's output goes to another stage once, however many of that stage's
    blocks read it, with the bytes of the values they read (:func:`edge_out`); it
    carries a gradient (``Value.grad``) unless none of its edges into that stage sends
    one back (``bc.edge_grads``, as in :func:`edge_grad_bytes`). Raises ValueError when
    the split leaves a block out, puts one in two stages or makes a cycle between stages.
    """
    owner = [-1] * bc.num_blocks
    for s, blocks in enumerate(stage_blocks):
        for b in blocks:
            if owner[b] != -1:
                raise ValueError(f"block {b} is in stages {owner[b]} and {s}")
            owner[b] = s
    missing = [b for b, s in enumerate(owner) if s == -1]
    if missing:
        raise ValueError(f"blocks {missing[:10]} are in no stage")
    values: dict[tuple[int, int], dict[int, int]] = {}
    grads: dict[tuple[int, int], set[int]] = {}  # blocks whose value sends a gradient back
    for a, b in bc.edges:
        sa, sb = owner[a], owner[b]
        if sa != sb:
            # the values of a that the stage reads: the most any of its blocks reads (a
            # block's outputs to several readers are nested: the hidden state and the mask
            # to the next layer, the mask alone to the later ones)
            per = values.setdefault((sa, sb), {})
            per[a] = max(per.get(a, 0), edge_out(bc, a, b))
            if (a, b) not in bc.edge_grads or bc.edge_grads[(a, b)] > 0:
                grads.setdefault((sa, sb), set()).add(a)
    stages = tuple(Stage(name=f"stage{s}", blocks=tuple(blocks),
                         nodes=tuple(n for b in sorted(blocks) for n in bc.nodes[b])
                         if bc.nodes else ())
                   for s, blocks in enumerate(stage_blocks))
    edges = tuple(
        Edge(sa, sb, tuple(Value(f"block{a}", nbytes, a in grads.get((sa, sb), ()))
                           for a, nbytes in sorted(vals.items())))
        for (sa, sb), vals in sorted(values.items())
    )
    graph = StageGraph(stages, edges)
    graph.check()
    return graph


#: Bytes of the scalars a rank's step holds to its end (see :func:`optimizer_peak`).
STEP_SCALARS = 512


def optimizer_peak(bc: BlockCosts, costs: Costs, placement: list[tuple[int, ...]],
                   num_ranks: int) -> list[int]:
    """Bytes per rank at the step's end: static bytes plus the larger of two temporaries.

    The data-parallel all-reduce sums a flat copy of a replicated stage's
    gradients (freed once copied back), then the optimizer step makes its own
    temporaries (``optimizer_temporary`` x params; 0 when unknown). Activations
    are gone by then, so this is a floor under the simulated peak, not an
    addition to it.
    """
    # plus the step's running loss and its all-reduced summary (0-dim tensors:
    # 512 bytes covers them, the CUDA allocator's smallest block)
    static, step, flat = [STEP_SCALARS] * num_ranks, [0] * num_ranks, [0] * num_ranks
    for s, ranks in enumerate(placement):
        st = costs.stages[s]
        for r in ranks:
            static[r] += st.static_bytes
            step[r] += int(bc.optimizer_temporary * st.params)
            if len(ranks) > 1:
                flat[r] += st.grad_bytes
    return [a + max(b, c) for a, b, c in zip(static, step, flat, strict=True)]


def reported_peak(bc: BlockCosts, costs: Costs, placement: list[tuple[int, ...]],
                  peak: Any, held: Any) -> np.ndarray:
    """Bytes per rank a plan is checked and reported at: the simulated ``peak`` plus the
    sends the runtime ``held`` at once, at least the step's end (:func:`optimizer_peak`).
    The search's scorer, its pricing of replicas (:mod:`orgel.plan.replicated`) and the
    prediction (:func:`orgel.plan.predict.predict`) all count it here."""
    got = np.asarray(peak, dtype=np.float64) + np.asarray(held, dtype=np.float64)
    floor = optimizer_peak(bc, costs, placement, len(got))
    return np.maximum(got, np.asarray(floor, dtype=np.float64))


def chain_split(bounds: list[int] | tuple[int, ...], num_blocks: int) -> list[range]:
    """Stages of a linear split: ``bounds`` are the first block of stages 1..n-1."""
    points = [0, *bounds, num_blocks]
    return [range(points[i], points[i + 1]) for i in range(len(points) - 1)]


class RangeMax:
    """Maximum of ``values[a:b]`` in O(1) per query (a sparse table)."""

    def __init__(self, values: np.ndarray) -> None:
        self.levels = [np.asarray(values, dtype=np.int64)]
        width = 1
        while 2 * width <= len(values):
            prev = self.levels[-1]
            self.levels.append(np.maximum(prev[:-width], prev[width:]))
            width *= 2

    def __call__(self, a: int, b: int) -> int:
        k = (b - a).bit_length() - 1
        level = self.levels[k]
        return int(max(level[a], level[b - (1 << k)]))
