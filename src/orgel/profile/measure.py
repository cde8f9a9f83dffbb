"""Measure every block of a coarsened graph on this device into the cached table's columns.

:class:`BlockRun` splits the graph into one module per block and runs them once
in order for each block's real inputs; :func:`measure_table` measures every
block's bytes (:func:`orgel.profile.blocks.block_probe`) and times its jobs, the
loss's, the optimizer's and all blocks in sequence in the same interleaved
rounds (:func:`orgel.profile.timing.interleaved`), with companion processes
training meanwhile as the other ranks will (:mod:`orgel.profile.contention`);
:func:`drifted` tells whether a cached table still holds on this host now.
:func:`orgel.profile.workload.profile_graph` caches the result and builds the
:class:`~orgel.costs.table.BlockCosts` from it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from orgel.graph.measure import place
from orgel.profile.blocks import (
    BlockMeasure,
    BlockProbe,
    LossProbe,
    action_overhead,
    block_probe,
    loss_jobs,
)
from orgel.profile.contention import companions
from orgel.profile.memory import optimizer_jobs
from orgel.profile.timing import Job, Timer, interleaved, spin_up

#: Parameters up to this many bytes are copied to time the optimizer on every block.
OPTIMIZER_COPY_LIMIT = 256 << 20


class BlockRun:
    """Every block of a coarsened graph as its own module, with its real inputs.

    The blocks run once in order (no autograd) to produce each block's inputs.
    ``compiled``: the blocks are timed as compiled stages run them
    (:mod:`orgel.profile.compiled`); companion processes train the eager blocks.
    """

    def __init__(self, bg: Any, split_model: Any, named: dict[str, Any],
                 dev: torch.device, compiled: bool = False) -> None:
        self.split = split_model(bg, list(range(len(bg.blocks))))
        self.compiled = compiled
        self.named = named
        self.values: dict[str, Any] = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
                                       for k, v in self.split.with_sizes(named).items()}
        self.args_of: list[list[Any]] = []
        with torch.no_grad():
            for stage in self.split.stages:
                place(stage.module, dev)  # its tensors, and device constants captured elsewhere
                args = [self.values[name] for name in stage.inputs]
                self.args_of.append(args)
                result = stage.module(*args)
                outs = list(result) if isinstance(result, (tuple, list)) else [result]
                self.values.update(zip(stage.outputs, outs, strict=True))
        self.runs: list[Any] = [stage.module for stage in self.split.stages]
        if compiled:  # (each graph compiles at its first call, in measure_table or drifted)
            from orgel.profile.compiled import runners

            self.runs = runners(self.split.stages)

    def train(self, runs: list[Any] | None = None) -> None:
        """Forward and backward of every block, as a rank busy with the same model (through
        ``runs``, each block's runner; default: the eager blocks, what companions run)."""
        for stage, args, run in zip(self.split.stages, self.args_of,
                                    runs or [s.module for s in self.split.stages], strict=True):
            ins = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor)
                   and a.is_floating_point() and name not in self.named else a
                   for a, name in zip(args, stage.inputs, strict=True)]
            out = run(*ins)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    def busy(self, dev: torch.device, contention: int, threads: int) -> Any:
        """A context: ``contention`` companions train these blocks meanwhile (CPU only)."""
        stack = contextlib.ExitStack()
        if contention and dev.type == "cpu":  # GPUs are not shared between ranks
            stack.enter_context(companions(contention, self.train, threads=threads))
        return stack


#: Timed passes of the quick drift check (after one warm-up pass); a check that finds drift
#: takes a second, longer sample (:func:`drifted`).
CHECK_REPEATS = 3


def drifted(blocks: BlockRun, cached: dict[str, Any], dev: torch.device, contention: int,
            threads: int, tolerance: float) -> bool:
    """Whether the blocks in sequence now take more than ``tolerance`` off the cached table.

    A table measured under other conditions (another load on a shared host,
    another clock speed) is stale as a whole: runs of every block in sequence,
    timed as the table's ``whole_ms`` was (eagerly: a compiled table's ``check_ms``),
    tell. Every warm start pays for the check, so it is a quick sample first (one
    warm-up pass, the median of :data:`CHECK_REPEATS`; building ``blocks`` ran every
    block once already), and only a quick sample off by more than ``tolerance`` is
    confirmed by a second, longer one as the table was timed (the device spun up, the
    median of 5). The table is stale when both are off: a load spike during one short
    sample costs no profile, a changed machine is off in both.
    """
    # the eager blocks in sequence (a compiled table recorded them too, as "check_ms"):
    # a warm start checks the table without compiling any block
    before = cached.get("check_ms", cached.get("whole_ms"))
    if not isinstance(before, (int, float)) or before <= 0:
        return True
    whole: list[dict[str, Job]] = [{"whole": (lambda: None, lambda _: blocks.train())}]

    def off(repeats: int) -> bool:
        now = interleaved(whole, Timer(dev, warmup=1, repeats=repeats))[0]["whole"]
        return abs(now / before - 1.0) > tolerance

    with blocks.busy(dev, contention, threads):
        stale = off(CHECK_REPEATS)
        if stale:
            spin_up(dev, 0.2)
            stale = off(5)
    for stage in blocks.split.stages:
        stage.module.zero_grad(set_to_none=True)
    return stale


def measure_table(blocks: BlockRun, dev: torch.device, warmup: int, repeats: int, progress: bool,
             contention: int = 0, threads: int = 1, loss: tuple[Any, Any] | None = None,
             optimizer: str | None = None) -> dict[str, Any]:
    """Measure every block on its own, and all of them in sequence, in interleaved rounds.

    ``contention`` companion processes run the same blocks meanwhile
    (:mod:`orgel.profile.contention`), as the other ranks will. ``loss``
    (``(loss_fn, targets)``): the loss runs in the stage that produces the
    model's outputs, so its time, saved bytes and temporaries go to that block.
    ``optimizer``: also time its step over each block's parameters.
    """
    split, values, named = blocks.split, blocks.values, blocks.named
    timer = Timer(dev, warmup=warmup, repeats=repeats)
    with blocks.busy(dev, contention, threads):
        spin_up(dev)
        probes, jobs = _probes(split, blocks.args_of, dev, progress, set(named),
                               None if loss is None else loss_probe(split, loss[0],
                                                                     to_device(loss[1], dev)))
        compile_s = 0.0
        if blocks.compiled:  # time each block as its compiled stage runs (bytes: eager)
            from orgel.profile.compiled import compiled_jobs

            for b, (stage, args) in enumerate(zip(split.stages, blocks.args_of, strict=True)):
                jobs[b], seconds = compiled_jobs(blocks.runs[b], stage, args,
                                                 [name in named for name in stage.inputs])
                compile_s += seconds
        # Blocks timed one at a time run from warm caches; a rank runs them one
        # after another. Time that too (in the same rounds) and scale by the ratio.
        jobs.append({"whole": (lambda: None, lambda _: blocks.train(blocks.runs))})
        if blocks.compiled:  # what a warm start's drift check times (eagerly)
            jobs[-1]["check"] = (lambda: None, lambda _: blocks.train())
        b = split.loss_stage
        saved, at_loss = 0, len(jobs)
        if loss is not None:
            loss_group, saved = loss_jobs(split, values, loss[0], to_device(loss[1], dev))
            jobs.append(loss_group)
        at_optimizer = len(jobs)
        # The optimizer's step per block, on copies (when they are small enough to
        # copy), in the same rounds: the ranks step theirs at the same time too.
        groups = [[p for p in stage.module.parameters() if p.requires_grad]
                  for stage in split.stages]
        if optimizer and sum(p.numel() * p.element_size() for g in groups for p in g) \
                <= OPTIMIZER_COPY_LIMIT:
            jobs += optimizer_jobs(groups, optimizer)
        stats: dict[str, float] = {}
        times = interleaved(jobs, timer, progress="timing blocks" if progress else None,
                            stats=stats)
        empty = action_overhead(timer)
        if blocks.compiled:  # a compiled call's own host cost: once a stage, not a block
            from orgel.profile.compiled import call_overhead, less_calls

            calls = call_overhead(timer)
            less_calls(times, len(probes), calls)
            empty = max(empty, (calls["fwd"] + calls["bwd"]) / 2)
        for stage in split.stages:
            stage.module.zero_grad(set_to_none=True)
    n = len(probes)
    measures = [p.result(t) for p, t in zip(probes, times, strict=False)]
    out = table_columns(measures, times[:n], loss_stage=b, saved=saved,
                        loss_times=times[at_loss] if loss is not None else None,
                        overhead=empty, wall_per_cpu=stats.get("wall_per_cpu", 1.0))
    if len(times) > at_optimizer:
        out["optimizer_ms"] = [t.get("optimizer", 0.0) for t in times[at_optimizer:]]
    whole = times[n]["whole"]
    isolated = sum(m.fwd + m.bwd for m in measures)  # the blocks alone, the loss left out
    scale = whole / isolated if isolated > 0 and whole > 0 else 1.0
    for key in ("fwd", "bwd", "wgrad", "split_input", "split_weight"):
        out[key] = [t * scale for t in out[key]]
    out["in_sequence_scale"] = scale
    out["whole_ms"] = whole
    if blocks.compiled:
        out["compile_s"] = compile_s
        out["check_ms"] = times[n]["check"]
    return out


def loss_probe(split: Any, loss_fn: Any, targets: Any) -> LossProbe:
    """The loss as its block's probe takes it: from that block's outputs (:func:`block_probe`)."""
    stage = split.stages[split.loss_stage]
    at = [stage.outputs.index(n) for n in split.output_names]

    def fn(outs: list[Any]) -> torch.Tensor:
        value: torch.Tensor = loss_fn(split.unflatten_outputs([outs[i] for i in at]), targets)
        return value

    return fn, frozenset(at)


def to_device(value: Any, dev: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dev)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, dev) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, dev) for k, v in value.items()}
    return value


def _probes(split: Any, args_of: list[list[Any]], dev: torch.device, progress: bool,
            model_inputs: set[str], loss: LossProbe | None = None
            ) -> tuple[list[BlockProbe], list[dict[str, Job]]]:
    """Every block's probe (its bytes measured) and timing jobs, in block order.

    Model inputs get no gradient, as in the runtime (the batch is not a leaf).
    ``loss`` goes to the block that computes the model's outputs.
    """
    from tqdm import tqdm

    probes = [block_probe(stage, args, dev,
                          constant=[name in model_inputs for name in stage.inputs],
                          loss=loss if b == split.loss_stage else None)
              for b, (stage, args) in enumerate(tqdm(list(zip(split.stages, args_of,
                                                              strict=True)),
                                                     desc="profiling blocks", unit="block",
                                                     disable=not progress))]
    return probes, [dict(p.jobs) for p in probes]


def table_columns(measures: list[BlockMeasure], times: list[dict[str, float]], *,
                  loss_stage: int, loss_times: dict[str, float] | None, saved: int,
                  overhead: float, wall_per_cpu: float) -> dict[str, Any]:
    """The cached table's columns from each block's measure and its timed jobs.

    ``I`` then ``W`` as measured (``split_input``/``split_weight``): together they
    take 30-45% more than one backward on a fed block (the input half's graph walk,
    one autograd call per parameter group), which ``bwd``/``wgrad`` leave out. The
    loss (``loss_times``, ``saved`` bytes) runs in the stage that produces the
    model's outputs: its forward there, its backward (the outputs' gradient) in
    that stage's input half.
    """
    out = _columns(measures)
    # a block whose halves were not timed (BlockMeasure.note): its whole backward is its I
    out["split_input"] = [t.get("inp", t.get("bwd", 0.0)) for t in times]
    out["split_weight"] = [t.get("wgrad", 0.0) for t in times]
    out["notes"] = [f"block {b}: {m.note}" for b, m in enumerate(measures) if m.note]
    out["action_overhead"] = overhead
    out["wall_per_cpu"] = wall_per_cpu
    if loss_times is not None:
        out["fwd"][loss_stage] += loss_times.get("fwd", 0.0)
        out["bwd"][loss_stage] += loss_times.get("bwd", 0.0)
        out["split_input"][loss_stage] += loss_times.get("bwd", 0.0)
        out["activations"][loss_stage] += saved
    return out


def _columns(measures: list[BlockMeasure]) -> dict[str, Any]:
    """Per-block measures as the cached table's columns."""
    keys = ("fwd", "bwd", "wgrad", "params", "activations", "output", "temporary", "weight_kept",
            "input_saved", "output_unsaved")
    return {k: [getattr(m, k) for m in measures] for k in keys}
