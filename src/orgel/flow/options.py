"""Every option of every front end, in one typed place, and the one table of what is refused.

``orgel.pipeline``, ``orgel.load`` and ``orgel.backend`` take the same keyword options;
:func:`options` groups them as a user thinks of them (:class:`Options`: parallelism, the
training loop, the batch, precision, launch, initialization) and checks each once.
An option a front end or a kind of model cannot take yet is refused by :func:`refuse`
from :data:`REFUSED`, with the reason and what to do instead, before anything starts:
that table is the only place such a refusal is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orgel.schedule.ir import Plan

if TYPE_CHECKING:
    from orgel.lossweights import Rule


@dataclass(frozen=True)
class Parallelism:
    """How the model is spread: ``ranks`` processes, of which ``dp`` data-parallel replicas
    of every stage and ``tp`` tensor-parallel members of every pipeline rank (with
    ``sequence_parallel``, the values between their split layers cut along the sequence)."""

    ranks: int = 2
    microbatches: int | str = 4
    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    shard: str = "none"
    memory: int | None = None
    plan: Plan | str | Path | None = None
    schedule: str | None = None
    recompute: bool | str = False


@dataclass(frozen=True)
class Loop:
    """The training loop each rank runs: the optimizer and what steps it."""

    optimizer: Callable[..., Any] | None = None
    scheduler: Callable[..., Any] | None = None
    lr: Callable[[int], float] | None = None
    max_grad_norm: float | None = None
    accumulate: int = 1


@dataclass(frozen=True)
class Batch:
    """How a batch is cut into micro-batches and how their losses weigh."""

    batch_dim: Any = 0
    replicated: Sequence[Any] = ()
    loss_rule: Rule = "auto"


@dataclass(frozen=True)
class Precision:
    """The precision the stages compute in (``"32"``, ``"bf16-mixed"``, ``"16-mixed"``)."""

    precision: str = "32"
    loss_scale: dict[str, float] | None = None
    check_finite: bool = False


@dataclass(frozen=True)
class Launch:
    """Where and how the ranks run."""

    device: str | None = None
    timeout_s: float = 300.0
    threads: int | None = None
    compile: bool = False


@dataclass(frozen=True)
class Initialization:
    """Where a model built on the meta device gets its values."""

    init: Callable[..., Any] | None = None
    weights: Any = None


GROUPS: dict[str, type] = {"parallel": Parallelism, "loop": Loop, "batch": Batch,
                           "precision": Precision, "launch": Launch, "init": Initialization}


@dataclass(frozen=True)
class Options:
    """All options of a pipeline, grouped (see :func:`options`)."""

    parallel: Parallelism = Parallelism()
    loop: Loop = Loop()
    batch: Batch = Batch()
    precision: Precision = Precision()
    launch: Launch = Launch()
    init: Initialization = Initialization()

    def given(self) -> dict[str, Any]:
        """The options that differ from their defaults, by their keyword names."""
        out: dict[str, Any] = {}
        for group in GROUPS:
            value, default = getattr(self, group), GROUPS[group]()
            for f in fields(value):
                if getattr(value, f.name) != getattr(default, f.name):
                    out[f.name] = getattr(value, f.name)
        return out


def names() -> dict[str, str]:
    """Each keyword option's group."""
    return {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}


def options(**keywords: Any) -> Options:
    """:class:`Options` from ``orgel.pipeline``'s keyword names; a misspelt name is refused
    with the names that exist."""
    where = names()
    grouped: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
    for name, value in keywords.items():
        if name not in where:
            import difflib

            close = difflib.get_close_matches(name, list(where), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"unknown option {name!r}{hint}; the options are "
                            f"{', '.join(sorted(where))}")
        grouped[where[name]][name] = value
    return Options(**{group: GROUPS[group](**values) for group, values in grouped.items()})


def check_options(ranks: int, microbatches: int | str, optimizer: Any, memory: Any, dp: int,
                   plan: Any, schedule: Any = None) -> None:
    """Raise ValueError for options ``orgel.pipeline`` and ``orgel.backend`` cannot take."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    if microbatches != "auto" and (not isinstance(microbatches, int)
                                   or isinstance(microbatches, bool) or microbatches < 1):
        raise ValueError(f"microbatches must be a positive int or 'auto', got {microbatches!r}")
    if optimizer is not None and not callable(optimizer):
        raise ValueError("optimizer must be a function params -> torch.optim.Optimizer, e.g. "
                         "lambda params: torch.optim.AdamW(params, lr=1e-3)")
    if memory is not None and (not isinstance(memory, int) or memory <= 0):
        raise ValueError(f"memory must be bytes per rank (a positive int) or None, got {memory!r}")
    if not isinstance(dp, int) or dp < 1 or ranks % dp:
        raise ValueError(f"dp must be a positive int that divides ranks={ranks}, got {dp!r}")
    if plan is not None and not isinstance(plan, (Plan, str, Path)):
        raise ValueError("plan must be a Plan, a path to a plan JSON file, or None to plan")
    if schedule is not None:
        check_schedule(schedule, plan, memory, microbatches)


def check_schedule(schedule: Any, plan: Any, memory: Any, microbatches: int | str) -> None:
    """Raise ValueError unless ``schedule`` (a family over a FLOP-balanced chain, no
    profiling) names a family and can go with the other options."""
    from orgel.schedule.families import FAMILIES

    if not isinstance(schedule, str) or schedule not in FAMILIES:
        raise ValueError(f"schedule must be a schedule family, one of "
                         f"{', '.join(sorted(FAMILIES))}, got {schedule!r}")
    if plan is not None:
        raise ValueError("give plan= or schedule=, not both: schedule= makes the plan (a "
                         "FLOP-balanced chain) that plan= would hand over")
    if memory is not None:
        raise ValueError("memory= is a limit for the planner, and schedule= does not plan "
                         "(it splits by FLOPs): leave out one of them")
    if microbatches == "auto":
        raise ValueError("schedule= splits the model as captured for one micro-batch count: "
                         "give microbatches as an int, not 'auto'")


#: What a front end, or a kind of model, cannot take yet: ``(where, option) -> reason``.
#: ``where`` is a front end (``"backend"``), a property of the model (``"graph breaks"``) or
#: an option whose runtime cannot take another yet (``"compile"``);
#: ``option`` an option's keyword name, or ``name=value`` for one value of it.
REFUSED: dict[tuple[str, str], str] = {
    ("backend", "device=cuda"): "orgel.backend runs on CPU ranks: use orgel.pipeline(..., "
                           "device='cuda') for GPUs",
    ("backend", "init"): "orgel.backend takes a model with values: build it on the CPU, or use "
                         "orgel.pipeline(..., init=...) for a meta model",
    ("backend", "weights"): "orgel.backend takes a model with values: load them with "
                            "model.load_state_dict, or use orgel.pipeline(..., weights=...)",
    ("backend", "check_finite"): "in orgel.backend the loss is the closure's: check the "
                                 "losses pipe.step returns",
    ("backend", "loss_rule"): "in orgel.backend the closure weighs its own loss (divide by "
                              "the micro-batch count, or by the batch's token count)",
    ("graph breaks", "device=cuda"): "a forward of several graphs (graph breaks) runs on CPU ranks "
                                "only: pass device='cpu', or remove the graph breaks",
    ("backend graph breaks", "precision"): "orgel.backend's precision= opens an autocast "
                                           "around one compiled graph; with graph breaks the "
                                           "Python between the graphs runs in your closure: "
                                           "open torch.autocast('cpu', dtype=torch.bfloat16) "
                                           "around the compiled model's call in the closure "
                                           "instead (precision= may stay: with float16 it "
                                           "turns the loss scaling on)",
}


def refuse(where: str, given: Options | dict[str, Any]) -> None:
    """Raise ValueError for the first option in ``given`` that :data:`REFUSED` lists for
    ``where`` (``given``: :class:`Options`, or keyword names and values, of which those
    that are off (False, None, 0, 1, "none", "32") count as not given)."""
    values = given.given() if isinstance(given, Options) else given
    for name, value in values.items():
        if value is None or value is False or (not isinstance(value, bool)
                                               and value in (0, 1, "none", "32", ())):
            continue
        for key in (f"{name}={value}", name):
            if (where, key) in REFUSED:
                raise ValueError(REFUSED[(where, key)])
