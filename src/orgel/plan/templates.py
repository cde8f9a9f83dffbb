"""The schedules a sequential plan may use: families × parameters, as stage templates.

Each template fixes a schedule family and its parameters for ``P`` ranks and
``m`` micro-batches, hence the number of stages and where they live:
1F1B and GPipe (``P`` stages); interleaved 1F1B and looped BFS with ``v``
stages per rank; Pfeife's looped schedule over loops ``N_l``, group sizes
``B_l`` (divisors of ``m``, at least ``P``) and prefetch vectors ``B_f``;
zero-bubble ZB-H1, and the same ``I``/``W`` split applied to the interleaved and
looped schedules (:func:`orgel.plan.transforms.split_backward`); and, beyond
round-robin placement, a "V" placement (the
second loop runs back from the last rank to the first, so the turn-around
stage pair shares a rank) scheduled by the DAG 1F1B family, and DualPipeV
(:mod:`orgel.schedule.families_dualpipe`) on the same placement. Families that are
not registered, or reject the parameters, are skipped. Duplicates (different
parameters, same action lists) are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from orgel.plan.ranks import renamed
from orgel.plan.transforms import split_backward
from orgel.schedule.families import FAMILIES, build_schedule
from orgel.schedule.ir import Plan, PlanError, StageGraph


@dataclass
class Template:
    """A schedule with a fixed number of stages and placement; splits fill its stages."""

    label: str  # e.g. "interleaved v=2"
    family: str
    options: dict[str, Any]
    base: Plan  # built on a chain stage graph; its schedule and placement are reused

    @property
    def num_stages(self) -> int:
        return self.base.num_stages

    @property
    def placement(self) -> list[tuple[int, ...]]:
        return self.base.placement

    def rank_stages(self) -> list[list[int]]:
        """Stages hosted by each rank."""
        return [self.base.stages_on(r) for r in range(self.base.num_ranks)]

    @cached_property
    def splits_backward(self) -> bool:
        """Whether the schedule runs ``I``/``W`` halves (``I`` keeps gradients for ``W``)."""
        return any(a.kind == "I" for actions in self.base.schedule for a in actions)



def rename(template: Template, perm: tuple[int, ...]) -> Template:
    """``template`` with rank ``r`` renamed ``perm[r]`` (placement and action lists move)."""
    return Template(template.label, template.family, dict(template.options),
                    renamed(template.base, perm))


def sequential_families() -> list[str]:
    """The schedule families the sequential search draws its templates from."""
    return [f for f in ("gpipe", "1f1b", "zb-h1", "interleaved", "looped", "looped-bfs",
                        "dag-1f1b", "dualpipev") if f in FAMILIES]


def prefetch_options(ranks: int) -> list[list[int]]:
    """Prefetch vectors ``B_f`` to try: front-loaded ramp, none, one extra on all but the last."""
    p = ranks
    options = [[p - 1 - i for i in range(p)], [0] * p, [1] * (p - 1) + [0]]
    out: list[list[int]] = []
    for o in options:
        if o not in out:
            out.append(o)
    return out


@dataclass(frozen=True)
class Spec:
    """A template not yet built: label, family, options and its group (stages per rank)."""

    label: str
    family: str
    options: dict[str, Any]
    group: int
    split_backward: bool = False  # rewrite B into I now, W later (orgel.plan.transforms)


def template_specs(ranks: int, microbatches: int, num_blocks: int, *, max_loops: int = 4,
                   families: list[str] | None = None) -> list[Spec]:
    """Every template to consider for a linear split, grouped by stages per rank.

    Within a group the first spec is its representative: interleaved 1F1B with
    its backward split into ``I`` and deferred ``W`` (ZB-H1 for one stage per
    rank), then Pfeife's looped schedules, looped BFS and their variants.
    """
    fams = FAMILIES
    wanted = set(families) if families else None
    p, m = ranks, microbatches
    specs: list[Spec] = []
    for v in range(1, max_loops + 1):
        if p * v > num_blocks:
            break
        group: list[Spec] = []
        for b_l in sorted({d for d in range(p, m + 1) if m % d == 0} | {m}, reverse=True):
            for b_f in prefetch_options(p):
                group.append(Spec(f"looped N_l={v} B_l={b_l} B_f={tuple(b_f)}", "looped",
                                  {"loops": v, "loop_microbatches": b_l, "prefetch": b_f}, v))
        if v == 1:
            group[0:0] = [Spec("zb-h1", "zb-h1", {}, 1), Spec("1f1b", "1f1b", {}, 1),
                          Spec("gpipe", "gpipe", {}, 1)]
        else:
            inter = {"stages_per_rank": v}
            group[0:0] = [Spec(f"interleaved v={v} + zero bubble", "interleaved", inter, v, True),
                          Spec(f"interleaved v={v}", "interleaved", inter, v),
                          Spec(f"looped-bfs v={v}", "looped-bfs", inter, v)]
            group += [Spec(s.label + " + zero bubble", s.family, s.options, v, True)
                      for s in group if s.family == "looped"][:2]
            if v == 2:
                group.append(Spec("v-shape (dag-1f1b)", "dag-1f1b", {"placement": "v"}, 2))
                group.append(Spec("dualpipev", "dualpipev", {}, 2))
        specs.extend(s for s in group if s.family in fams
                     and (wanted is None or s.family in wanted))
    return specs


def build_template(spec: Spec, ranks: int, microbatches: int) -> Template | None:
    """Build a spec's schedule (None when the family rejects the parameters)."""
    if spec.family == "dag-1f1b" and spec.options.get("placement") == "v":
        return v_shape(ranks, microbatches)
    try:
        base = build_schedule(spec.family, ranks, microbatches, **spec.options)
        if spec.split_backward:
            base = split_backward(base)
    except PlanError:
        return None
    options = dict(spec.options, split_backward=True) if spec.split_backward else spec.options
    return Template(spec.label, spec.family, options, base)


def cached_template(cache: dict[tuple[Any, ...], Template | None], spec: Spec, ranks: int,
                    microbatches: int) -> Template | None:
    """:func:`build_template` once per spec and counts in ``cache`` (a scorer's).

    One Template object per schedule lets the scorer compile it once for every
    search that uses it (baselines, both recompute passes).
    """
    key = (spec.label, spec.family, spec.split_backward, ranks, microbatches)
    if key not in cache:
        cache[key] = build_template(spec, ranks, microbatches)
    return cache[key]


def schedule_key(t: Template) -> tuple[Any, ...]:
    """What makes two templates the same schedule: placement and action lists."""
    return (tuple(t.base.placement), tuple(tuple(a) for a in t.base.schedule))


def v_shape(ranks: int, microbatches: int) -> Template | None:
    """Two stages per rank placed 0,1,…,P-1,P-1,…,1,0 and scheduled by DAG 1F1B."""
    p = ranks
    n = 2 * p
    placement = [(s,) if s < p else (n - 1 - s,) for s in range(n)]
    try:
        base = build_schedule("dag-1f1b", p, microbatches, stage_graph=StageGraph.chain(n),
                              placement=placement)
    except (PlanError, TypeError):
        return None
    return Template("v-shape (dag-1f1b)", "dag-1f1b", {"placement": "v"}, base)


def one_f_one_b(ranks: int, microbatches: int,
                cache: dict[tuple[Any, ...], Template | None] | None = None) -> Template:
    """The plain 1F1B template (what the baselines use); ``cache``: see :func:`cached_template`."""
    spec = Spec("1f1b", "1f1b", {}, 1)
    t = build_template(spec, ranks, microbatches) if cache is None \
        else cached_template(cache, spec, ranks, microbatches)
    assert t is not None  # 1F1B takes any counts
    return t
