"""Tensor parallelism and FSDP sharding priced on a block table: the mesh's cost model.

A pipeline rank of a plan with ``tp > 1`` is ``tp`` processes (one node's
GPUs, consecutive ranks) that run its actions together; a stage whose
replicas shard (``plan.shard[s] == "fsdp"``) holds a ``1/replicas`` slice of
its optimizer state. Both change a block's numbers, and these functions
rewrite the table so that every planner and the simulator price them
unchanged; the collectives that are not inside a block's actions (FSDP's
all-gather and reduce-scatter) are priced by :mod:`orgel.sim.allreduce`.

**Tensor parallelism** (:func:`tp_costs`): a block's :class:`TPSplit`
says which part of it the TP degree splits (Megatron-style regions: a
column-parallel linear, the ops between, a row-parallel linear; attention
split by heads): its forward, backward and weight-gradient milliseconds,
parameter bytes and saved-activation bytes, and its ``regions`` with the
``allreduce`` bytes their outputs make per micro-batch. With degree ``tp``::

    fwd'   = fwd - split.fwd + split.fwd / tp + comm
    bwd'   = bwd - split.bwd + split.bwd / tp + comm
    wgrad' = wgrad - split.wgrad + split.wgrad / tp
    params'      = params - split.params + split.params / tp   (and so grads, optimizer state)
    activations' = activations - split.activations + split.activations / tp
    comm = regions x ring_allreduce(allreduce / regions bytes, tp ranks, intra-node link)

one all-reduce per region forward (its row-parallel output) and one backward
(its input's gradient, the same bytes), on the intra-node link (``tp`` must
divide the GPUs per node); they block the compute, so they are part of the
actions. Ranks per node become ``node_ranks / tp`` pipeline ranks.

**AsyncTP** (``tp_costs(async_tp=True)``, with sequence parallelism: torchtitan's
``enable_async_tensor_parallel``): each region's all-gather runs micro-pipelined with
its column-parallel linears (the gathered input's chunks fed to the matmul as they
arrive) and its reduce-scatter with its row-parallel linear, forward and backward (the
row's output-gradient all-gather with the row's input-gradient GEMM, the column's
input-gradient reduce-scatter with the columns'); a collective costs only what its
linears do not hide, or, given a fraction ``h`` (``async_tp=h``), the blocking time less
``h`` of what they could hide. Per block and direction::

    one   = ring_time(allreduce / regions bytes, tp, steps=1)   (an all-gather or a
                                                                reduce-scatter)
    comm  = max(0, column_ends x one - column / tp) + max(0, row_ends x one - row / tp)

with ``column``/``row`` the block's column and row linears' forward ms (the backward's
input-gradient GEMMs take as long) and ``row_ends = 2 regions - column_ends``: the
step is max(compute, communication) per end, never slower than blocking. What ``h = 1``
(``async_tp=True``) does not price: the chunked GEMMs' lower efficiency, the SMs and the
memory bandwidth the copies take, and the collectives torch.compile did not fuse with a
matmul. torchtitan's published AsyncTP runs gained 1.04-1.16x where ``h = 1`` prices 1.25x;
``benchmarks/torchtitan.py`` fits ``h`` to one of them (0.4 or so).

**FSDP** (:func:`shard_costs`): a sharded stage gathers its parameters once
per step and accumulates full gradients over the micro-batches, so during
the step each rank holds full parameters and gradients, and a ``1/replicas``
slice of the optimizer state (and fp32 master): ``optimizer_factor' = 2 +
(optimizer_factor - 2) / replicas``; the optimizer step and its temporaries
work on the slice (``optimizer_ms / replicas``, ``optimizer_temporary /
replicas``).

The collectives, ring model over ``n`` ranks and the slowest link ``lk``:
all-reduce ``2 (n-1) lk.time(bytes / n)``, all-gather and reduce-scatter
``(n-1) lk.time(bytes / n)`` each (:func:`ring_time`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orgel.costs.fields import read_numbers
from orgel.schedule.costs import Link

if TYPE_CHECKING:
    from orgel.costs.table import BlockCosts

#: Tensor-parallel degrees the planner tries by default.
TP_DEGREES = (1, 2, 4, 8)
_SPLIT_KEYS = ("fwd", "bwd", "wgrad", "params", "activations", "allreduce", "regions",
               "column", "row", "column_ends")


@dataclass(frozen=True)
class TPSplit:
    """The part of one block tensor parallelism splits, for one micro-batch.

    ``fwd``/``bwd``/``wgrad``: ms of the block's times inside its TP regions;
    ``params``/``activations``: bytes of its split parameters and of the
    activations saved inside the regions; ``allreduce``: bytes the regions'
    outputs make per micro-batch (all-reduced once forward, once backward);
    ``regions``: how many regions (all-reduces each way; a half counts a
    region a block boundary cuts, whose other end is in the next block).
    ``column``/``row``: forward ms of the regions' column- and row-parallel
    linears in this block, and ``column_ends`` how many of its ``2 x regions``
    region ends are column ends (the rest are row ends): what AsyncTP overlaps
    the collectives with (:func:`tp_costs`; 0, as in a file written before
    them, overlaps nothing).
    """

    fwd: float = 0.0
    bwd: float = 0.0
    wgrad: float = 0.0
    params: int = 0
    activations: int = 0
    allreduce: int = 0
    regions: float = 0.0
    column: float = 0.0
    row: float = 0.0
    column_ends: float = 0.0

    def scaled(self, factor: float) -> TPSplit:
        """For micro-batches ``factor`` times as large (parameters and regions stay)."""
        return TPSplit(self.fwd * factor, self.bwd * factor, self.wgrad * factor, self.params,
                       int(self.activations * factor), int(self.allreduce * factor),
                       self.regions, self.column * factor, self.row * factor,
                       self.column_ends)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _SPLIT_KEYS}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> TPSplit:
        """Parse ``{"fwd": ms, ..., "regions": n}``; ValueError naming ``where``."""
        values = read_numbers(data, where, _SPLIT_KEYS, ("params", "activations", "allreduce"))
        return cls(**values)


def ring_time(link: Link, nbytes: float, n: int, *, steps: int = 1) -> float:
    """ms of ``steps x (n - 1)`` ring steps of ``nbytes / n`` each over ``link``.

    ``steps=1``: an all-gather or a reduce-scatter; ``steps=2``: an all-reduce.
    One rank (``n == 1``) takes no time.
    """
    if n <= 1:
        return 0.0
    return steps * (n - 1) * link.time(int(nbytes // n))


def tp_link(costs: BlockCosts) -> Link:
    """The link a TP group's all-reduces take: the intra-node link (``costs.link``)."""
    return costs.link


def check_tp(costs: BlockCosts, tp: int) -> None:
    """Raise ValueError when ``costs`` cannot be priced at TP degree ``tp`` (says why)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if tp == 1:
        return
    if not costs.tp_split:
        raise ValueError("the costs carry no tensor-parallel facts (the blocks' 'tp' entries): "
                         "profile or estimate the workload again (orgel profile, orgel plan "
                         "WORKLOAD and orgel plan --device fill them) or use tp=1")
    if costs.node_ranks is not None and costs.node_ranks % tp:
        raise ValueError(f"tp={tp} does not divide the {costs.node_ranks} GPUs per node: a TP "
                         "group stays inside a node; pick a divisor")
    if costs.links:
        raise ValueError("per-pair 'links' name processes, not pipeline ranks: leave them out "
                         "to plan with tp > 1")


def tp_costs(costs: BlockCosts, tp: int, *, sequence_parallel: bool = False,
             async_tp: bool | float = False) -> BlockCosts:
    """``costs`` for one member of a TP group of ``tp`` processes (module docstring).

    ``sequence_parallel``: the ops outside the regions (norms, residual adds, dropout)
    run on ``1/tp`` of the sequence each (Megatron's sequence parallelism, as torchtitan
    runs TP): every activation and every millisecond of a block splits, and the
    all-reduce becomes a reduce-scatter and an all-gather of the same bytes (the runtime
    runs it: :mod:`orgel.runtime.sequence_parallel`, which leaves a stage's tail after its
    last region whole, so this is a little optimistic for a stage's last layer and the
    head). ``async_tp`` (with
    ``sequence_parallel``): the collectives overlap their linears (module docstring);
    a number in [0, 1] is the fraction of what the linears could hide that they do.
    """
    hidden = float(async_tp)
    if not 0.0 <= hidden <= 1.0:
        raise ValueError(f"async_tp={async_tp!r}: give True, False or the fraction of the "
                         "collectives' time the linears hide, in [0, 1]")
    if async_tp and not sequence_parallel:
        raise ValueError("async_tp overlaps sequence parallelism's all-gathers and "
                         "reduce-scatters with the linears: pass sequence_parallel=True too")
    check_tp(costs, tp)
    if tp == 1:
        return costs
    link = tp_link(costs)
    rest = (1 / tp) if sequence_parallel else 1.0  # of what the regions do not split
    fwd, bwd, wgrad, params, acts, opt, comms = [], [], [], [], [], [], []
    for b, s in enumerate(costs.tp_split):
        comm = (s.regions * ring_time(link, s.allreduce / s.regions, tp, steps=2)
                if s.regions else 0.0)
        if hidden and s.regions:
            comm -= hidden * (comm - exposed_comm(s, link, tp))
        comms.append(comm)
        fwd.append((costs.fwd[b] - s.fwd) * rest + s.fwd / tp + comm)
        bwd.append((costs.bwd[b] - s.bwd) * rest + s.bwd / tp + comm)
        wgrad.append(min(bwd[-1], (costs.wgrad[b] - s.wgrad) * rest + s.wgrad / tp))
        kept = costs.params[b] - s.params + s.params // tp
        params.append(kept)
        acts.append(max(0, int((costs.activations[b] - s.activations) * rest)
                        + s.activations // tp))
        if costs.optimizer_ms:
            opt.append(costs.optimizer_ms[b] * (kept / costs.params[b] if costs.params[b]
                                                else 1.0))
    split_in, split_w = list(costs.split_input), list(costs.split_weight)
    if split_in:
        for b, s in enumerate(costs.tp_split):  # the regions' share split, the rest's too
            region_i = s.bwd - s.wgrad  # with sequence parallelism
            split_in[b] = max(0.0, split_in[b] - region_i) * rest + region_i / tp + comms[b]
            split_w[b] = max(0.0, split_w[b] - s.wgrad) * rest + s.wgrad / tp
    tied = [dataclasses.replace(g, nbytes=g.nbytes // tp)
            if all(costs.tp_split[b].params >= g.nbytes for b in g.blocks) else g
            for g in costs.tied]
    return dataclasses.replace(
        costs, fwd=fwd, bwd=bwd, wgrad=wgrad, params=params, activations=acts,
        output_unsaved=[min(u, a) for u, a in zip(costs.output_unsaved, acts, strict=True)],
        optimizer_ms=opt, split_input=split_in, split_weight=split_w, tied=tied,
        node_ranks=None if costs.node_ranks is None else costs.node_ranks // tp,
        # a member rebuilds and keeps its share: its blocks' bytes and times as they shrank
        recompute=[r.tp_member(a / a0 if a0 else rest, f / f0 if f0 else 1.0,
                               sequence_parallel=sequence_parallel)
                   for r, a, a0, f, f0 in zip(costs.recompute, acts, costs.activations, fwd,
                                              costs.fwd, strict=True)]
        if costs.recompute else [],
        tp_split=[dataclasses.replace(s, fwd=s.fwd / tp, bwd=s.bwd / tp, wgrad=s.wgrad / tp,
                                      column=s.column / tp, row=s.row / tp,
                                      params=s.params // tp,
                                      activations=s.activations // tp)
                  for s in costs.tp_split],
        meta=dict(costs.meta, tp=tp, **({"async_tp": hidden} if hidden else {})))


def exposed_comm(s: TPSplit, link: Link, tp: int) -> float:
    """ms of a block's TP collectives (one direction) that AsyncTP's linears do not hide."""
    one = ring_time(link, s.allreduce / s.regions, tp, steps=1)
    row_ends = 2 * s.regions - s.column_ends
    return (max(0.0, s.column_ends * one - s.column / tp)
            + max(0.0, row_ends * one - s.row / tp))


def sharded_factor(factor: float, replicas: int) -> float:
    """``optimizer_factor`` of a stage whose ``replicas`` shard its optimizer state (FSDP)."""
    if factor <= 2:
        return factor
    return 2 + (factor - 2) / replicas


def shard_costs(costs: BlockCosts, replicas: int) -> BlockCosts:
    """``costs`` for one of ``replicas`` FSDP ranks of every stage (module docstring)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if replicas == 1:
        return costs
    return dataclasses.replace(
        costs, optimizer_factor=sharded_factor(costs.optimizer_factor, replicas),
        optimizer_temporary=costs.optimizer_temporary / replicas,
        optimizer_ms=[t / replicas for t in costs.optimizer_ms],
        optimizer_ms_per_mib=costs.optimizer_ms_per_mib / replicas,
        meta=dict(costs.meta, shard=replicas))


def mesh_costs(costs: BlockCosts, *, tp: int = 1, shard: str = "none", replicas: int = 1,
               sequence_parallel: bool = False,
               async_tp: bool | float = False) -> BlockCosts:
    """``costs`` at TP degree ``tp`` (with sequence parallelism or not, AsyncTP or not:
    :func:`tp_costs`) with every stage's ``replicas`` sharding or not."""
    out = tp_costs(costs, tp, sequence_parallel=sequence_parallel, async_tp=async_tp)
    return shard_costs(out, replicas) if shard == "fsdp" else out
