"""What one rank knows about each stage it hosts: wiring, replica rows, saved state.

A stage on ``n`` ranks is data-parallel inside the stage: replica ``k`` takes
rows ``[k/n, (k+1)/n)`` of every micro-batch (along the batch dimension; the
rule: :func:`orgel.batching.replica_rows`).
Between a producer on ``n`` ranks and a consumer on ``n'`` ranks, each pair of
replicas whose rows overlap exchanges the overlap, a ``part`` ``(lo, hi, P)``
with ``P = lcm(n, n')`` meaning rows ``[lo/P, hi/P)`` of the micro-batch, the
same rule as :mod:`orgel.schedule.comm`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from orgel.batching import replica_rows
from orgel.schedule.ir import Plan
from orgel.split.types import SplitModel, StageModule

Part = tuple[int, int, int]


def part_rows(part: Part, replica: int, replicas: int, local_rows: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``part`` inside a replica's local tensor."""
    lo, hi, parts = part
    total = local_rows * replicas
    if total % parts:
        raise ValueError(
            f"a micro-batch of {total} rows cannot be split into {parts} equal parts: "
            f"choose a batch size divisible by microbatches x {parts}"
        )
    offset = replica_rows(total, replica, replicas)[0]
    return lo * total // parts - offset, hi * total // parts - offset


@dataclass
class StageInfo:
    """Static facts about one stage hosted on this rank."""

    index: int
    stage: StageModule
    replica: int
    replicas: int
    in_edges: list[int]
    out_edges: list[int]
    value_edge: dict[str, int]  # input name -> edge that brings it
    out_index: dict[str, int]  # output name -> position in the module's outputs
    params: list[torch.nn.Parameter]
    recompute: bool  # the whole stage again before its backward
    is_loss: bool
    #: what runs the forward: the stage's module, or one that checkpoints inside it
    #: (``recompute`` ``"layer"``/``"selective"``, :mod:`orgel.runtime.checkpointing`)
    run: torch.nn.Module

    @classmethod
    def build(cls, plan: Plan, split: SplitModel, s: int, rank: int) -> StageInfo:
        graph = plan.stage_graph
        stage = split.stages[s]
        in_edges = graph.producers(s)
        value_edge = {v.name: e for e in in_edges for v in graph.edges[e].values}
        for name in stage.inputs:
            if (name not in value_edge and name not in stage.model_inputs
                    and name not in stage.sizes):
                raise ValueError(
                    f"stage {s} input {name!r} is neither a model input nor a value on an "
                    "incoming edge of the stage graph: the split and the plan disagree"
                )
        out_index = {name: i for i, name in enumerate(stage.outputs)}
        for e in graph.consumers(s):
            for v in graph.edges[e].values:
                if v.name not in out_index:
                    raise ValueError(
                        f"edge {s}->{graph.edges[e].dst} carries {v.name!r}, which stage {s} "
                        "does not output: the split and the plan disagree"
                    )
        return cls(
            index=s, stage=stage, replica=plan.placement[s].index(rank),
            replicas=len(plan.placement[s]), in_edges=in_edges,
            # consumer-stage order: gradients summed in the reference's order
            out_edges=sorted(graph.consumers(s), key=lambda e: graph.edges[e].dst),
            value_edge=value_edge, out_index=out_index,
            params=list(stage.module.parameters()), recompute=plan.recompute[s] is True,
            is_loss=s == split.loss_stage,
            # with tp or FSDP the runner is made after the regions are split and the stage
            # sharded (run_stages_as_planned)
            run=stage.module if plan.tp > 1 or plan.shard[s] == "fsdp"
            else _runner(stage, plan.recompute[s], plan),
        )


def run_stages_as_planned(plan: Plan, stages: dict[int, StageInfo]) -> None:
    """Give each stage its runner for its recompute policy once its regions are split
    (tensor parallelism) and it is sharded (FSDP): a checkpointed layer must call the
    module's DTensor parameters, which :func:`orgel.runtime.tensor_parallel.shard_stages`
    put in place of the whole ones, or the whole weights FSDP2 gathers."""
    for s, info in stages.items():
        if plan.shard[s] == "fsdp" and plan.recompute[s] == "layer":
            info.run = _Gathered(info.stage, plan)
        elif plan.tp > 1 or plan.shard[s] == "fsdp":
            # "selective" checkpoints the module's own call, FSDP2's hooks inside
            info.run = _runner(info.stage, plan.recompute[s], plan)


class _Gathered(torch.nn.Module):
    """An FSDP2-sharded stage's forward under ``"layer"``: the stage module is called as
    always (FSDP2's hooks gather its weights and prepare its backward) with the
    checkpointed layers as its forward, made at the first call from the gathered weights.
    FSDP2 keeps each whole weight as one object between steps (it frees and refills its
    storage), so the layers made once read each step's gathered values, and their
    gradients are what the step's reduce-scatter takes."""

    def __init__(self, stage: StageModule, plan: Plan) -> None:
        super().__init__()
        self.stage, self.plan = stage, plan
        self.runner: torch.nn.Module | None = None

    def forward(self, *args: Any) -> Any:
        module = self.stage.module
        if self.runner is None:
            module.unshard()  # type: ignore[operator]
            self.runner = _runner(self.stage, "layer", self.plan)
        # this call only, the layers as the instance's forward (in its __dict__: assigned as
        # an attribute, a module would become a child and leave the class's forward in use)
        module.__dict__["forward"] = self.runner
        try:
            return module(*args)
        finally:
            del module.__dict__["forward"]


def _runner(stage: StageModule, policy: bool | str, plan: Plan) -> torch.nn.Module:
    """What runs ``stage``'s forward under recompute ``policy``."""
    from orgel.runtime.checkpointing import checkpointed

    if policy == "selective" and any(a.kind == "I" and a.stage == stage.index
                                     for actions in plan.schedule for a in actions):
        raise ValueError(f"stage {stage.index} has recompute='selective' in a schedule that "
                         "splits its backward (I and W): torch's selective checkpoint runs "
                         "one backward per region; give it recompute='layer', or a schedule "
                         "with whole backwards (1f1b, interleaved)")
    return checkpointed(stage.module, policy, stage.layers, stage.written)


@dataclass
class Run:
    """One stage's forward for one micro-batch, kept until its backward is done."""

    args: list[Any]  # module arguments (edge values as leaves)
    leaves: dict[str, torch.Tensor]  # edge-value name -> leaf tensor
    outputs: tuple[torch.Tensor, ...]
    loss: torch.Tensor | None = None
    work: Any = None  # what I kept for W (orgel.backward.WeightWork)
    #: a recomputed stage's written buffers as its forward found them
    buffers: dict[str, torch.Tensor] | None = None


def stream_seed(base: int, step: int, stage: int, microbatch: int) -> int:
    """The seed of one forward's random draws: a hash of (base seed, step, stage, micro-batch)."""
    digest = hashlib.blake2b(f"{base}:{step}:{stage}:{microbatch}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


@contextmanager
def random_stream(seed: int, device: torch.device) -> Iterator[None]:
    """Draw from a generator seeded with ``seed`` inside; the rank's own state resumes after.

    Every forward of a stage on a micro-batch draws from its own stream, so
    dropout masks depend on (seed, step, stage, micro-batch) only: not on the
    schedule, the placement or the other stages, and a recompute replays them.
    """
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        yield


@contextmanager
def replayed(info: StageInfo, run: Run) -> Iterator[None]:
    """Recompute on the written buffers as the forward found them, and keep the current ones.

    The recompute updates the forward-time copies (swapped in for it) instead of the
    live buffers, so BatchNorm statistics are updated once per micro-batch, as in one
    process; the live tensors are not written at all (autograd may have saved them).
    """
    if not run.buffers:
        yield
        return
    module = info.stage.module
    live: dict[str, torch.Tensor] = {}
    for name, copy in run.buffers.items():
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner)
        live[name] = holder._buffers[leaf]  # type: ignore[assignment]
        holder._buffers[leaf] = copy
    try:
        yield
    finally:
        for name, tensor in live.items():
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = tensor
