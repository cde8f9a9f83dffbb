"""One architecture through ``orgel.pipeline`` against one process, as a user would run it.

:func:`orgel_check` builds the workload, snapshots everything ``orgel.pipeline``
must leave alone (parameters, buffers, ``requires_grad`` flags, train/eval
modes, gradients, the global RNG state), runs ``orgel.pipeline(...)`` and one
``step`` through the production path (local spawn, the real split, the real
launcher), and compares the pipelined parameters and buffers with a copy of the
model trained in this process by gradient accumulation over the same
micro-batches with the same SGD step.
"""

from __future__ import annotations

import copy
import math
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

import orgel
from orgel.models import ZooWorkload
from orgel.precision import autocast
from orgel.workload import Workload, microbatches, named_inputs

LR = 0.1
#: Largest accepted difference, relative to the tensor's scale: max|a-b| / (1 + max|b|).
TOLERANCE = 1e-5


@dataclass
class Outcome:
    """What happened to one architecture: ``status`` is "exact", "differs" or "fails"."""

    name: str
    status: str
    detail: str = ""
    loss: float = math.nan
    ref_loss: float = math.nan
    worst: dict[str, float] = field(default_factory=dict)
    trace: str = ""

    def line(self) -> str:
        if self.status == "exact":
            return f"{self.name:<22} exact"
        return f"{self.name:<22} {self.status}: {self.detail}"


def snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """Everything about ``model`` and torch's global RNG that orgel must not change."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone()
                  for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "rng": torch.get_rng_state(),
    }


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two snapshots, one line per difference (empty when bit-identical)."""
    out: list[str] = []
    for key, t in before["state"].items():
        u = after["state"].get(key)
        if u is None or u.dtype != t.dtype or u.shape != t.shape or not torch.equal(u, t):
            out.append(f"state {key} changed")
    for part in ("requires_grad", "training"):
        if before[part] != after[part]:
            out.append(f"{part} flags changed")
    for name, g in before["grads"].items():
        h = after["grads"].get(name)
        if (g is None) != (h is None) or (g is not None and not torch.equal(g, h)):
            out.append(f"grad of {name} changed")
    if not torch.equal(before["rng"], after["rng"]):
        out.append("global RNG state changed")
    return out


def reference_step(model: torch.nn.Module, workload: Workload, m: int) -> float:
    """One SGD step of ``model`` in this process: gradient accumulation over ``m`` micro-batches.

    Under ``workload.precision="bf16-mixed"`` the forward and the loss run in
    ``torch.autocast`` with bfloat16, as a user writes it.
    """
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for inputs, targets in microbatches(Workload(model, workload.inputs, workload.targets,
                                                 workload.loss_fn,
                                                 replicated=workload.replicated), m):
        with autocast(workload.precision):
            loss = workload.loss_fn(model(**inputs), targets) / m
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a-b| / (1 + max|b|), in float64 (0.0 for empty tensors; inf for shape mismatch)."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).abs().max() / (1.0 + b64.abs().max()))


def orgel_check(name: str, build: Any, *, ranks: int = 2, m: int = 2,
                plan_for: Any = None, tolerance: float = TOLERANCE, **options: Any) -> Outcome:
    """Train ``build()`` one step through orgel and in one process; compare every tensor.

    ``plan_for(workload)``, if given, returns the plan to pass to ``orgel.pipeline``;
    ``options`` go to ``orgel.pipeline`` as they are.
    """
    try:
        w: ZooWorkload = build()
        workload = Workload(w.model, w.inputs, w.targets, w.loss_fn)
        reference = copy.deepcopy(w.model)
        if plan_for is not None:
            options["plan"] = plan_for(w)
        before = snapshot(w.model)
        pipe = orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=ranks,
                              microbatches=m, optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                              **{"timeout_s": 120.0, **options})
        try:
            touched = changes(before, snapshot(w.model))
            loss = pipe.step(w.inputs, w.targets)
            got = pipe.state_dict()
        finally:
            pipe.close()
    except Exception as exc:  # noqa: BLE001 - reported as the outcome
        first = (str(exc).strip().splitlines() or [""])[0][:2000]
        return Outcome(name, "fails", f"{type(exc).__name__}: {first}",
                       trace=traceback.format_exc())
    workload.replicated = tuple(options.get("replicated", ()))
    workload.precision = options.get("precision", "32")
    return compare(name, got, loss, reference, workload, m, touched, tolerance)


def compare(name: str, got: dict[str, torch.Tensor], loss: float, reference: torch.nn.Module,
            workload: Workload, m: int, touched: list[str],
            tolerance: float = TOLERANCE) -> Outcome:
    """The outcome of a pipelined step (``got``, ``loss``) against one process on ``reference``."""
    ref_loss = reference_step(reference, workload, m)
    if touched:
        return Outcome(name, "differs", "orgel changed the model: "
                       + "; ".join(touched[:3]), loss, ref_loss)
    expected = reference.state_dict()
    worst: dict[str, float] = {"loss": abs(loss - ref_loss) / (1.0 + abs(ref_loss))}
    for key, t in expected.items():
        if key not in got:
            return Outcome(name, "differs", f"{key} missing from pipe.state_dict()", loss, ref_loss)
        worst[key] = relative_diff(got[key], t)
    bad = {k: v for k, v in worst.items() if not v <= tolerance}
    if bad:
        key = max(bad, key=lambda k: bad[k])
        return Outcome(name, "differs", f"{key} by {bad[key]:.2e} ({len(bad)} tensors over "
                       f"{tolerance:g})", loss, ref_loss, worst)
    return Outcome(name, "exact", "", loss, ref_loss, worst)


def backend_check(name: str, build: Any, *, ranks: int = 2, m: int = 2) -> Outcome:
    """:func:`orgel_check` through ``torch.compile(model, backend=orgel.backend(...))``, on a
    FLOP-balanced 1F1B chain (``schedule=``: no profiling).

    The closure calls the compiled model with the micro-batch's inputs by name,
    divides the loss by ``m`` and runs its backward, as a user's would. Dynamo
    captures the forward as one graph or several; either way the step must match
    one process, and the caller's model must stay as it was (its RNG use is the
    closures', as in one process, so the RNG state is not compared).
    """
    try:
        torch._dynamo.reset()
        w: ZooWorkload = build()
        workload = Workload(w.model, w.inputs, w.targets, w.loss_fn)
        reference = copy.deepcopy(w.model)
        named = named_inputs(w.model, w.inputs)
        keys = list(named)
        before = snapshot(w.model)
        pipe = orgel.backend(ranks=ranks, microbatches=m, timeout_s=120.0, schedule="1f1b",
                             optimizer=lambda p: torch.optim.SGD(p, lr=LR))
        compiled = torch.compile(w.model, backend=pipe, dynamic=False)

        def closure(*args: Any) -> float:
            *values, targets = args
            loss = w.loss_fn(compiled(**dict(zip(keys, values, strict=True))), targets) / m
            loss.backward()
            return float(loss.detach())

        try:
            loss = sum(pipe.step(closure, *named.values(), w.targets))
            got = pipe.state_dict()
        finally:
            pipe.close()
        after = snapshot(w.model)
        before["rng"] = after["rng"]
        touched = changes(before, after)
    except Exception as exc:  # noqa: BLE001 - reported as the outcome
        first = (str(exc).strip().splitlines() or [""])[0][:2000]
        return Outcome(name, "fails", f"{type(exc).__name__}: {first}",
                       trace=traceback.format_exc())
    return compare(name, got, loss, reference, workload, m, touched)


def balanced_check(name: str, build: Any, *, ranks: int = 2, m: int = 2,
                   replicated: tuple[str, ...] = (), precision: str = "32",
                   tolerance: float = TOLERANCE, schedule: str = "1f1b", dp: int = 1,
                   **family: Any) -> Outcome:
    """:func:`orgel_check` with a FLOP-balanced chain as the plan (no profiling, quick).

    ``orgel.pipeline(..., schedule=)`` makes it from its own capture. Family options
    ``orgel.pipeline`` does not take (``stages_per_rank`` other than 2, any other) go to
    :func:`orgel.plan.balanced.balanced_plan` on a capture of a copy of the model, and the
    plan is handed over.
    """
    from orgel.graph import capture
    from orgel.plan.balanced import balanced_plan

    options: dict[str, Any] = {"replicated": replicated} if replicated else {}
    if precision != "32":
        options["precision"] = precision
    if dp != 1:
        options["dp"] = dp
    if family.keys() <= {"stages_per_rank"} and family.get("stages_per_rank", 2) == 2:
        return orgel_check(name, build, ranks=ranks, m=m, tolerance=tolerance,
                           schedule=schedule, **options)

    def plan_for(w: ZooWorkload) -> Any:
        model = copy.deepcopy(w.model)
        first, _ = microbatches(Workload(model, w.inputs, w.targets, w.loss_fn,
                                         replicated=replicated), m)[0]
        return balanced_plan(capture(model, first, precision=precision), ranks=ranks,
                             microbatches=m, schedule=schedule, dp=dp, **family)

    return orgel_check(name, build, ranks=ranks, m=m, plan_for=plan_for, tolerance=tolerance,
                       **options)
