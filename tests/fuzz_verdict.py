"""The verdict of a fuzzing draw: orgel's run against one process, and float64 where needed.

A :class:`Result` is what a run leaves (``tests/fuzzing.py`` makes both);
:func:`compare` judges orgel's against one process's:

* **tight**: every tensor (and each step's loss, learning rate and gradient norm, and
  the evaluation's loss) within ``atol + rtol * max|reference|`` (float32: rtol 1e-5,
  atol 1e-6; bf16-mixed and 16-mixed: rtol 1e-3, atol 1e-5), replica and tied copies included;
* otherwise **against float64**: one process in float64 (no autocast) is run, and
  each value that missed passes when orgel is no farther from it than one process
  at the draw's precision, times :data:`FACTOR` (plus ``atol``): the draw is
  ill-conditioned (BatchNorm over a tiny batch, Adam on a gradient that is zero in
  exact arithmetic), not wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gaps import largest_gap

FACTOR = 2.0  # orgel may be this much farther from float64 than one process
TOLERANCE = {"32": (1e-5, 1e-6), "bf16-mixed": (1e-3, 1e-5),  # (rtol, atol)
             "16-mixed": (1e-3, 1e-5)}
DTYPE = {"32": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass
class Result:
    """What a run leaves: per call losses, per step rates and norms, every copy of the state.

    ``copies[name]`` lists each copy of that tensor (one per rank that holds it; one in
    one process); ``optim[name]`` likewise for the optimizer state of a parameter."""

    losses: list[float]
    lrs: list[list[float]]
    norms: list[float | None]
    copies: dict[str, list[torch.Tensor]]
    optim: dict[str, list[dict[str, Any]]]
    keys: list[str] = field(default_factory=list)
    params: set[str] = field(default_factory=set)
    evaluated: float | None = None  # pipe.evaluate's loss on the first batch, after training


@dataclass
class Difference:
    """One value orgel got differently: its kind (param, buffer, opt.<key>, loss, lr,
    grad_norm), name, max abs and rel difference, and whether float64 excused it."""

    kind: str
    name: str
    abs: float
    rel: float
    excused: bool = False
    note: str = ""


@dataclass
class Verdict:
    """The comparison of a draw: every difference, the worst per kind, and the verdict."""

    differences: list[Difference] = field(default_factory=list)
    worst: dict[str, tuple[float, float]] = field(default_factory=dict)
    used_float64: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(d.excused for d in self.differences)

    def failures(self) -> list[Difference]:
        return [d for d in self.differences if not d.excused]

    def summary(self) -> str:
        worst = ", ".join(f"{k} {a:.1e}/{r:.1e}" for k, (a, r) in sorted(self.worst.items()))
        bad = self.failures()
        head = "ok" if not bad else f"DIFFERS ({len(bad)})"
        if self.used_float64:
            head += " [float64 judged]"
        head += "".join(f" [{n}]" for n in self.notes)
        lines = [f"{head}; max abs/rel by kind: {worst}"]
        lines += [f"    {d.kind} {d.name}: abs {d.abs:.3e} rel {d.rel:.3e} {d.note}"
                  for d in bad[:8]]
        return "\n".join(lines)


def _values(result: Result, params: set[str]) -> dict[tuple[str, str], list[torch.Tensor]]:
    """Every compared value of a run as ``(kind, name) -> copies`` (``params``: the
    parameters' names; the other tensors are buffers)."""
    out: dict[tuple[str, str], list[torch.Tensor]] = {}
    for n, ts in result.copies.items():
        out[("param" if n in params else "buffer", n)] = ts
    for n, states in result.optim.items():
        for s in states:
            for k, v in s.items():
                if isinstance(v, (torch.Tensor, int, float)):
                    out.setdefault((f"opt.{k}", n), []).append(torch.as_tensor(v))
    out[("loss", "per call")] = [torch.tensor(result.losses, dtype=torch.float64)]
    out[("lr", "per step")] = [torch.tensor(result.lrs, dtype=torch.float64)]
    if result.evaluated is not None:
        out[("eval", "loss")] = [torch.tensor(result.evaluated, dtype=torch.float64)]
    if any(v is not None for v in result.norms):
        out[("grad_norm", "per step")] = [torch.tensor(result.norms, dtype=torch.float64)]
    return out


def _gap(a: torch.Tensor, r: torch.Tensor) -> tuple[float, float]:
    """The largest gap (:func:`gaps.largest_gap`), and that gap relative to ``r``'s largest
    value."""
    d = largest_gap(a, r)
    scale = float(r.double().abs().max()) if r.numel() and a.shape == r.shape else 0.0
    return d, d / scale if scale else (0.0 if d == 0 else math.inf)


def compare(precision: str, got: Result, ref: Result,
            float64: Callable[[], Result] | None = None, by_kind: bool = False) -> Verdict:
    """Judge ``got`` (orgel) against ``ref`` (one process at ``precision``); see the module
    docstring. ``float64`` runs the float64 reference, called only when a value misses.
    ``by_kind``: the draw rounds unlike one process by its nature (tensor parallelism in
    bfloat16 or float16 rounds each half of a split matmul before their sum), so against
    float64 a kind's values are judged together, as the composition matrix judges its
    weights: orgel's largest gap of that kind at most :data:`FACTOR` times one process's,
    or a value within one unit in the last place of the precision of one process's."""
    rtol, atol = TOLERANCE[precision]
    verdict = Verdict()
    if got.keys != ref.keys:
        verdict.differences.append(Difference("keys", "state_dict", math.inf, math.inf,
                                              note=f"{got.keys[:4]} vs {ref.keys[:4]}"))
    ours, theirs = _values(got, ref.params), _values(ref, ref.params)
    if got.evaluated is None:  # documented: evaluate raises, saying why (the step trains)
        verdict.notes.append("pipe.evaluate not available")
        theirs.pop(("eval", "loss"), None)
    for key in sorted(set(ours) | set(theirs)):
        kind, name = key
        if key not in theirs or key not in ours:
            where = "only orgel has it" if key not in theirs else "orgel has none"
            verdict.differences.append(Difference(kind, name, math.inf, math.inf, note=where))
            continue
        r = theirs[key][0]
        worst = (0.0, 0.0)
        for a in ours[key]:
            d, rel = _gap(a, r)
            worst = max(worst, (d, rel))
        w = verdict.worst.get(kind, (0.0, 0.0))
        verdict.worst[kind] = (max(w[0], worst[0]), max(w[1], worst[1]))
        scale = float(r.double().abs().max()) if r.numel() else 0.0
        if worst[0] > atol + rtol * scale or math.isnan(worst[0]):
            verdict.differences.append(Difference(kind, name, worst[0], worst[1]))
    if verdict.differences and float64 is not None and all(
            d.kind != "keys" and math.isfinite(d.abs) for d in verdict.differences):
        verdict.used_float64 = True
        exact = _values(float64(), ref.params)

        def gaps(key: tuple[str, str]) -> tuple[float, float]:
            """(orgel's, one process's) distance from float64 of value ``key``."""
            return (max(_gap(a, exact[key][0])[0] for a in ours[key]),
                    _gap(theirs[key][0], exact[key][0])[0])

        largest: dict[str, tuple[float, float]] = {}  # by kind, each side's own (by_kind)
        for key in exact if by_kind else ():
            if key in ours and key in theirs:
                now, before = gaps(key), largest.get(key[0], (0.0, 0.0))
                largest[key[0]] = (max(now[0], before[0]), max(now[1], before[1]))
        for d in verdict.differences:
            our_gap, ref_gap = largest[d.kind] if by_kind else gaps((d.kind, d.name))
            # (a value within one unit in the last place of the precision is excused too:
            # each half rounded before the sum is that far from one rounding of the whole)
            d.excused = (our_gap <= FACTOR * ref_gap + atol
                         or by_kind and d.rel <= torch.finfo(DTYPE[precision]).eps)
            d.note = f"(float64: orgel {our_gap:.2e}, one process {ref_gap:.2e})"
    return verdict
