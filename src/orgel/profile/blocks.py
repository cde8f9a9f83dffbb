"""Measure every block on the target device: times, saved bytes, parameters, outputs.

Each block of the coarsened graph is split into its own runnable module
(:func:`orgel.split.split_model` with one stage per block); the blocks run once
in order to produce every block's real inputs, then each block is measured on
its own:

* ``fwd``: the forward, with autograd recording (as in training);
* ``bwd``: the full backward (``torch.autograd.grad`` w.r.t. inputs and
  parameters), ``wgrad`` its weight half ``W`` as the runtime runs it
  (:func:`orgel.backward.weight_backward` after ``input_backward``);
  the halves are tried once in a forked child first (:mod:`orgel.profile.trial`):
  a block whose trial dies or raises is timed whole, with a ``note`` saying why;
  every block's jobs are timed in the same rounds
  (:func:`~orgel.profile.timing.interleaved`: ``warmup`` rounds, then
  ``repeats``), each job's time its median CPU time (one intra-op thread;
  else wall time; CUDA events);
* ``params``: bytes of the block's parameters; ``output``: bytes of its outputs;
  ``activations``: bytes one forward leaves alive until its backward: what
  autograd saves (saved-tensor hooks, each storage once, parameters left out)
  or, if more, everything the forward allocated that is still alive when it
  returns (its outputs too, which the runtime keeps for the backward); the
  block's inputs from other blocks are left out: their producers count them
  (as outputs) inside a stage;
* ``input_saved``: the bytes of those inputs autograd saves, which a stage
  holds for a block fed from another stage (the received value);
* ``output_unsaved``: the bytes of its outputs the block does not save itself
  (part of ``activations``): inside a stage they outlive the forward only if
  a consumer saves them;
* ``weight_kept``: what the split backward's ``I`` keeps alive for ``W``,
  the output gradients ``W`` holds included;
* ``temporary``: the peak of forward + backward above that, run as a step's
  later micro-batches run it: the parameters' gradients already exist (static
  memory) and every new gradient is a temporary added into them; for the
  block computing the loss, with the loss's forward and backward (the
  gradients of the model's outputs made during the backward). On CUDA from
  the allocator's counters, on CPU (no allocator statistics) from
  :class:`~orgel.profile.memory.LiveBytes`, which watches every op's outputs.

The fixed cost of one action is measured through the same code path on an
empty block (an identity on a one-element tensor) and becomes
``action_overhead``.

All of it runs with the thread count each rank will train with
(:func:`orgel.profile.timing.intra_op_threads`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from orgel.backward import WeightWork, input_backward, weight_backward
from orgel.profile.memory import LiveBytes
from orgel.profile.timing import Job, Timer, interleaved
from orgel.profile.trial import skip_split, trial
from orgel.split.types import StageModule


@dataclass
class BlockMeasure:
    """What :func:`measure_block` found for one block (ms and bytes, one micro-batch)."""

    fwd: float
    bwd: float
    wgrad: float
    params: int
    activations: int
    output: int
    temporary: int
    weight_kept: int = 0
    input_saved: int = 0
    output_unsaved: int = 0
    note: str = ""  # a measurement not taken, and why (:mod:`orgel.profile.trial`)


#: A block's loss: ``(fn(outputs) -> loss, positions of the outputs it reads)``.
LossProbe = tuple[Callable[[list[Any]], torch.Tensor], frozenset[int]]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


@dataclass
class BlockProbe:
    """One block ready to time: its timed jobs and the bytes already measured.

    ``jobs``: ``fwd``, and when the block has a backward ``bwd`` (the whole
    backward), ``inp`` (the runtime's ``I``) and ``wgrad`` (its ``W``).
    :meth:`result` turns their median times into a :class:`BlockMeasure`.
    """

    jobs: dict[str, Job]
    params: int
    activations: int
    output: int
    temporary: int
    weight_kept: int
    input_saved: int = 0
    output_unsaved: int = 0
    note: str = ""

    def result(self, times: dict[str, float]) -> BlockMeasure:
        """The measure, given the median ms of each job."""
        bwd = times.get("bwd", 0.0)
        inp, wgrad = times.get("inp", 0.0), times.get("wgrad", 0.0)
        if inp + wgrad > bwd:
            # Splitting costs a little more than one backward; the table stores one
            # ``bwd``, so keep it the full backward and give ``W`` its measured share.
            wgrad = bwd * wgrad / (inp + wgrad)
        return BlockMeasure(fwd=times["fwd"], bwd=bwd, wgrad=min(wgrad, bwd), params=self.params,
                            activations=self.activations, output=self.output,
                            temporary=self.temporary, weight_kept=self.weight_kept,
                            input_saved=self.input_saved, output_unsaved=self.output_unsaved,
                            note=self.note)


def measure_block(stage: StageModule, args: list[Any], timer: Timer, *,
                  constant: list[bool] | None = None) -> BlockMeasure:
    """Measure one block module on ``args`` (its inputs, in ``stage.inputs`` order).

    ``constant[i]`` marks an input that gets no gradient (a model input: the
    runtime never differentiates the batch), so the backward skips its path.
    Several blocks are best timed together: :func:`block_probe` each, then
    :func:`~orgel.profile.timing.interleaved` over all their jobs.
    """
    probe = block_probe(stage, args, timer.device, constant=constant)
    return probe.result(interleaved([probe.jobs], timer)[0])


def block_probe(stage: StageModule, args: list[Any], device: torch.device, *,
                constant: list[bool] | None = None, loss: LossProbe | None = None) -> BlockProbe:
    """Measure one block's bytes and build the jobs that time it (see :func:`measure_block`).

    ``loss``: for the block that computes the model's outputs, ``(fn, outputs)``:
    ``fn`` maps the block's outputs to the loss, ``outputs`` are the positions
    of those it reads (their gradients come from the loss, not from other
    blocks). Its temporary is then measured with the loss's forward and
    backward, as the runtime's ``B`` runs them; the loss's saved bytes and
    times stay apart (:func:`loss_jobs`).
    """
    if loss is not None and (not callable(loss[0]) or not isinstance(loss[1], frozenset)):
        raise ValueError("loss must be (fn(outputs) -> loss, frozenset of output positions)")
    fixed = constant or [False] * len(args)
    module = stage.module
    params = [p for p in module.parameters() if p.requires_grad]
    param_ptrs = {p.data_ptr() for p in module.parameters()}
    param_bytes = sum(_nbytes(p) for p in {p.data_ptr(): p for p in module.parameters()}.values())

    def fresh_inputs() -> list[Any]:
        return [a.detach().requires_grad_(True) if _float(a) and not c else a
                for a, c in zip(args, fixed, strict=True)]

    def forward(inputs: list[Any]) -> list[torch.Tensor]:
        out = module(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    # One forward under saved-tensor hooks: bytes kept for backward, each storage once.
    batch = {a.untyped_storage().data_ptr() for a, c in zip(args, fixed, strict=True)
             if c and isinstance(a, torch.Tensor)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_ptrs:
            _count_saved(saved, t, batch)
        return t

    inputs = fresh_inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = forward(inputs)
    out_bytes = sum(_nbytes(o) for o in outs if isinstance(o, torch.Tensor))
    # Outputs the block made and does not save: the forward leaves them alive for the
    # next block, which may or may not save them (an input passed through is not made).
    made_before = param_ptrs | {a.untyped_storage().data_ptr() for a in args
                                if isinstance(a, torch.Tensor)}
    unsaved = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in outs
               if isinstance(o, torch.Tensor)}
    output_unsaved = sum(n for ptr, n in unsaved.items()
                         if ptr not in saved and ptr not in made_before)
    grad_outs = [torch.randn_like(o) if _float(o) and o.requires_grad else None for o in outs]
    diff_outs = [(o, g) for o, g in zip(outs, grad_outs, strict=True) if g is not None]
    del inputs, outs

    jobs: dict[str, Job] = {"fwd": (fresh_inputs, forward)}
    weight_kept, note = 0, ""
    if diff_outs and (params or any(_float(a) and not c for a, c in zip(args, fixed,
                                                                        strict=True))):
        def setup() -> tuple[list[Any], list[torch.Tensor]]:
            ins = fresh_inputs()
            return ins, forward(ins)

        def backward(state: tuple[list[Any], list[torch.Tensor]]) -> None:
            ins, out = state
            pairs = [(o, g) for o, g in zip(out, grad_outs, strict=True) if g is not None]
            targets = [a for a in ins if isinstance(a, torch.Tensor) and a.requires_grad]
            targets += list(params)
            if targets:
                torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                    allow_unused=True)

        jobs["bwd"] = (setup, backward)
        # The halves as the runtime runs them (orgel.backward): ``I`` towards
        # the inputs keeping the gradients ``W`` starts from, then ``W`` alone. A
        # second autograd.grad over the parameters would walk the input path again.
        # Tried once in a forked child first: a kernel that crashes on the halves'
        # masks must not take the caller down (orgel.profile.trial).
        failed = trial([lambda: weight_backward(_input_half(setup(), grad_outs, params))])
        if failed:
            note = skip_split(failed[0])
        else:
            jobs["inp"] = (setup, lambda st: _input_half(st, grad_outs, params))
        if params and not note:
            jobs["wgrad"] = (lambda: _input_half(setup(), grad_outs, params), weight_backward)
            # What ``I`` leaves alive for ``W`` (the gradients it kept; its input
            # gradients are sent away and dropped): held from ``I`` until ``W``.
            # The output gradients arrive during the step too and ``W`` often
            # keeps them (a last linear layer's weight gradient needs its output's
            # gradient): made under the mode, they count when ``W`` holds them.
            state = setup()
            with LiveBytes() as mode:
                incoming = [None if g is None else g.clone() for g in grad_outs]
                work = _input_half(state, incoming, params)
                del incoming
                weight_kept = int(mode.now)
            del work, state
    # Inputs other blocks made: inside a stage their producer counts them (as its
    # outputs); a stage fed from elsewhere holds what this block saves of them.
    fed = {a.untyped_storage().data_ptr() for a, c in zip(args, fixed, strict=True)
           if not c and isinstance(a, torch.Tensor)}
    input_saved = sum(n for ptr, n in saved.items() if ptr in fed)
    own = sum(saved.values()) - input_saved
    temporary, alive = _temporary(module, fresh_inputs, forward, grad_outs, device, own, loss)
    # the rest of what the forward left alive (at least what autograd saved), and them
    kept = max(alive - output_unsaved, own) + output_unsaved
    return BlockProbe(jobs=jobs, params=param_bytes, activations=kept, output=out_bytes,
                      temporary=temporary, weight_kept=weight_kept, input_saved=input_saved,
                      output_unsaved=output_unsaved, note=note)


def loss_jobs(split: Any, values: dict[str, Any], loss_fn: Any,
              targets: Any) -> tuple[dict[str, Job], int]:
    """Jobs timing the loss on one micro-batch's outputs (``fwd``, ``bwd``), bytes it saves.

    ``split`` is the blocks' split model (its ``output_names`` and
    ``unflatten_outputs``), ``values`` every value one forward produced.
    The saved bytes (the loss's value included) leave out the outputs
    themselves (a block's already).
    """
    def outputs() -> list[Any]:
        return [values[n].detach().requires_grad_(True)
                if isinstance(values[n], torch.Tensor) and values[n].is_floating_point()
                else values[n] for n in split.output_names]

    def forward(outs: list[Any]) -> torch.Tensor:
        return loss_fn(split.unflatten_outputs(outs), targets)

    saved: dict[int, int] = {}
    batch = {t.untyped_storage().data_ptr() for t in tree_flatten(targets)[0]
             if isinstance(t, torch.Tensor)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        _count_saved(saved, t, batch)
        return t

    outs = outputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = forward(outs)
    own = {o.untyped_storage().data_ptr() for o in outs if isinstance(o, torch.Tensor)}
    # The loss value itself stays alive until its backward too (the runtime holds it).
    saved.setdefault(value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
    kept = sum(n for ptr, n in saved.items() if ptr not in own)  # outputs counted already
    jobs: dict[str, Job] = {"fwd": (outputs, forward)}
    if value.requires_grad:
        def setup() -> tuple[list[Any], torch.Tensor]:
            outs = outputs()
            return outs, forward(outs)

        def backward(state: tuple[list[Any], torch.Tensor]) -> None:
            outs, value = state
            leaves = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.grad(value, leaves, allow_unused=True)

        jobs["bwd"] = (setup, backward)
    return jobs, kept


def _input_half(state: tuple[list[Any], list[torch.Tensor]], grad_outs: list[torch.Tensor | None],
                params: list[torch.nn.Parameter]) -> WeightWork:
    """The runtime's ``I`` on one forward's outputs; returns what ``W`` needs."""
    ins, out = state
    pairs = [(o, g) for o, g in zip(out, grad_outs, strict=True) if g is not None]
    leaves = [a for a in ins if isinstance(a, torch.Tensor) and a.requires_grad]
    _, work = input_backward([o for o, _ in pairs], [g for _, g in pairs], leaves, params)
    return work


def _count_saved(saved: dict[int, int], t: torch.Tensor, batch: set[int]) -> None:
    """Record the bytes a saved tensor keeps alive, once per storage.

    A saved tensor keeps its whole storage alive, except a slice of the
    batch (``batch``: the storages of the model's inputs and targets): the
    caller holds the whole batch for the step anyway, and a micro-batch is
    one slice of it (or, on another device, a copy of just that slice).
    """
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    if ptr in batch:
        saved[ptr] = max(saved.get(ptr, 0), min(storage.nbytes(), t.numel() * t.element_size()))
    else:
        saved.setdefault(ptr, storage.nbytes())


def _temporary(module: torch.nn.Module, fresh: Callable[[], list[Any]],
               forward: Callable[[list[Any]], list[torch.Tensor]],
               grad_outs: list[torch.Tensor | None], device: torch.device,
               saved: int, loss: LossProbe | None = None) -> tuple[int, int]:
    """(peak extra bytes of forward + backward, bytes the forward left alive as measured).

    On CUDA the allocator's counters; elsewhere :class:`LiveBytes`. What the
    forward leaves alive (saved tensors and the outputs the runtime holds for
    the backward) is at least ``saved``; the temporary is the peak above it.

    Measured as a step's later micro-batches run: the parameters' gradients
    already exist (static memory, not counted) and each new one is a temporary
    added into them. Measured from no gradients, the peak (often early in the
    backward, before most gradients exist) minus all the gradients came out
    0 for transformer layers, which then held a weight's gradient and more
    above their activations on the ranks (issue 5). ``loss``: the block
    computes the loss (see :func:`block_probe`); its forward and backward
    run too, and the gradients of the outputs it reads are made in the
    backward, as on the ranks, instead of given.
    """
    # One backward first: what the measured backward then accumulates into.
    _backward(forward(fresh()), grad_outs, loss)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = forward(fresh())
        kept = torch.cuda.memory_allocated(device) - base
        value = loss[0](out) if loss is not None else None
        held = torch.cuda.memory_allocated(device) - base
        _backward(out, grad_outs, loss, value)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        ins = fresh()
        with LiveBytes() as mode:
            out = forward(ins)
            kept = mode.now
            value = loss[0](out) if loss is not None else None
            held = mode.now
            _backward(out, grad_outs, loss, value)
            peak = mode.peak
    module.zero_grad(set_to_none=True)
    # the loss's saved bytes are counted apart (:func:`loss_jobs`), on top of ``kept``
    alive = max(int(kept), saved) + int(held) - int(kept)
    return max(int(peak) - alive, 0), int(kept)


def _backward(out: list[torch.Tensor], grad_outs: list[torch.Tensor | None],
              loss: LossProbe | None, value: torch.Tensor | None = None) -> None:
    """Backward of one forward's ``out``: from the loss (and the other outputs) or ``grad_outs``."""
    pairs = [(o, g) for i, (o, g) in enumerate(zip(out, grad_outs, strict=True))
             if g is not None and (loss is None or i not in loss[1])]
    roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
    if loss is not None:
        value = loss[0](out) if value is None else value
        if value.requires_grad:
            roots.append(value)
            grads.append(torch.ones_like(value))
    if roots:
        torch.autograd.backward(roots, grads)


def action_overhead(timer: Timer) -> float:
    """ms of one empty action (forward or backward of an identity) through this code path."""
    empty = StageModule(index=0, module=_Empty(), inputs=["x"], outputs=["x"])
    x = torch.zeros(1, device=timer.device)
    m = measure_block(empty, [x], timer)
    return (m.fwd + m.bwd) / 2


class _Empty(torch.nn.Module):
    """A block with no work: returns a view of its input."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x.view_as(x),)
