"""``plan(costs, ranks, microbatches)``: run the planners, keep the fastest plan that fits.

Planners (``planner=``):

* ``beam``: linear splits × schedule templates (1F1B, GPipe, ZB-H1, interleaved,
  looped BFS, Pfeife's looped schedule with prefetch, V placement), beam search
  on split points (:mod:`orgel.plan.sequential`);
* ``graph``: GraphPipe-style stage DAG with per-stage rank counts and DAG 1F1B
  (:mod:`orgel.plan.graph`); only for block graphs with branches;
* ``uniform-layers``, ``uniform-params``, ``uniform-time``: the baselines, 1F1B;
* ``auto`` (default): all of the above, the fastest feasible plan wins.

Every plan is scored by the one simulator. With ``dp`` replicas of a pipeline
the pipeline is searched once and the replicated plan priced from its
simulation plus the gradient all-reduces (:mod:`orgel.plan.replicated`; the
full simulation of every rank only when the replicas' links differ). When
nothing fits, the error says how much memory per rank (or how many ranks) would.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from orgel.costs.blocks import (
    BlockCosts,
    chain_split,
)
from orgel.costs.mesh import TP_DEGREES, check_tp
from orgel.plan.graph import graph_plan
from orgel.plan.predict import end_of_step, labelled, predicted, replicated
from orgel.plan.replicated import replicated_step
from orgel.plan.scorer import Scorer
from orgel.plan.screen import (
    MESH_TOP,
    QUICK_TEMPLATES,
    compute_bound,
    mesh_table,
    quick_plan,
    screen,
    with_mesh,
)
from orgel.plan.sequential import sequential_plan
from orgel.plan.splits import BASELINES, balanced_points, baseline_points, memory_weights
from orgel.plan.templates import Template, one_f_one_b
from orgel.schedule.ir import SHARDS, Plan
from orgel.sim import SimResult

PLANNERS = ("auto", "beam", "graph", *BASELINES)


class InfeasibleError(ValueError):
    """No plan fits the memory per rank; the message says what would."""


@dataclass
class PlanResult:
    """The chosen plan, its prediction and how the search went."""

    plan: Plan
    planner: str
    sim: SimResult
    search_seconds: float
    baselines: dict[str, float | None] = field(default_factory=dict)
    evaluations: int = 0

    @property
    def step_time(self) -> float:
        return self.sim.step_time

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary: step time, planner, schedule, stages, memory, baselines."""
        plan = self.plan
        costs = plan.costs
        stages = []
        for s, st in enumerate(plan.stage_graph.stages):
            c = costs.stages[s] if costs is not None else None
            stages.append({
                "blocks": _ranges(st.blocks), "ranks": list(plan.placement[s]),
                "fwd": None if c is None else c.fwd, "bwd": None if c is None else c.bwd,
                "params": None if c is None else c.params,
                "activations": None if c is None else c.activations,
                "recompute": plan.recompute[s],
            })
        return {
            "step_time": self.sim.step_time,
            "bubble_fraction": self.sim.bubble_fraction,
            "search_seconds": self.search_seconds,
            "planner": self.planner,
            "schedule": plan.meta.get("schedule_label", plan.meta.get("schedule")),
            "schedule_family": plan.meta.get("schedule"),
            "schedule_options": plan.meta.get("schedule_options", {}),
            "num_ranks": plan.num_ranks,
            "microbatches": plan.microbatches,
            "stages": stages,
            "peak_memory": list(self.sim.peak_memory),
            "memory_per_rank": self.sim.memory_per_rank,
            "baselines": self.baselines,
            "evaluations": self.evaluations,
            "mesh": plan.meta.get("mesh", {"pp": plan.num_ranks, "tp": plan.tp, "dp": 1,
                                           "shard": "none"}),
        }


def _ranges(blocks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` → ``"0-2,5"``."""
    out: list[str] = []
    start = prev = None
    for b in blocks:
        if start is None:
            start = prev = b
        elif b == prev + 1:  # type: ignore[operator]
            prev = b
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = b
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def plan(costs: BlockCosts, ranks: int, microbatches: int, *, memory: int | None = None,
         planner: str = "auto", width: int = 4, max_move: int = 10, max_loops: int = 8,
         time_limit: float | str | None = "auto", per_member: int | None = None,
         dp: int | None = 1, groups: int = 3, top: int = 3, max_replicas: int | None = None,
         rows: int | None = None, families: list[str] | None = None,
         tp: int | str | tuple[int, ...] | list[int] = 1,
         shard: str | tuple[str, ...] | list[str] = "none",
         mesh_top: int | None = MESH_TOP) -> PlanResult:
    """The fastest feasible plan of ``costs`` on ``ranks`` ranks (see the module docstring).

    ``memory`` overrides the table's ``memory_per_rank`` (bytes; None keeps it).
    ``width``/``max_move``/``per_member`` tune the beam search, ``max_loops``
    bounds stages per rank, ``groups``/``top`` how many loop counts and
    templates the sequential search explores in full (see
    :func:`~orgel.plan.sequential.sequential_plan`), ``time_limit`` (s) bounds
    its beam phase: ``"auto"`` (default) gives it :func:`search_budget` for the
    problem's size, ``None`` lets it run until it converges (the thorough search).
    ``dp``
    replicates the whole pipeline ``dp`` times (each replica takes its share of
    every micro-batch; gradients are all-reduced); ``dp=None`` tries every
    divisor of the pipeline ranks and keeps the fastest. With ``dp=1`` the whole
    pipeline is never replicated: the graph planner may still give some stages
    several ranks (intra-stage replicas) but keeps at least one stage on a
    single rank, so a plan is never data parallelism in disguise.
    ``max_replicas`` caps the ranks one stage of a pipeline runs on (``1``: a
    pure pipeline, every stage on one rank; ``dp`` replicates on top of it).
    ``rows`` is a micro-batch's row count along the batch dimension: every
    stage's replicas (times ``dp``) must divide it, since each takes an equal
    share of every micro-batch. ``families`` restricts the sequential search
    to these schedule families (e.g. ``["gpipe"]``; None: all).

    The mesh: ``tp`` is the tensor-parallel degree, or a tuple of degrees to
    try (e.g. :data:`~orgel.costs.mesh.TP_DEGREES`; ``"auto"``: those that
    fit, see :func:`_mesh_choices`); ``ranks`` counts
    processes, so each plan rank (a pipeline rank) is ``tp`` of them and the
    pipeline and its replicas share ``ranks / tp`` pipeline ranks.
    ``shard``: ``"none"`` (replicas hold everything, all-reduce gradients),
    ``"fsdp"`` (replicas shard their state, :mod:`orgel.costs.mesh`), or a
    tuple of both to try (``"auto"``); ``"fsdp"`` applies only where ``dp > 1``. Every
    combination of TP degree, ``dp`` and sharding is searched like a plain
    pipeline and the fastest plan that fits wins, with ``plan.tp`` and
    ``plan.shard`` set (and ``plan.meta["mesh"]``). With several meshes a
    first pass prices each by one quick plan and only the best ``mesh_top``
    (and those close to the best, :func:`~orgel.plan.screen.screen`) are
    searched in full; ``mesh_top=None`` searches every mesh. Raises
    :class:`InfeasibleError` when nothing fits, ValueError on bad options.
    """
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}: choose one of {', '.join(PLANNERS)}")
    for name, value in (("ranks", ranks), ("microbatches", microbatches), ("width", width),
                        ("max_move", max_move), ("max_loops", max_loops), ("groups", groups),
                        ("top", top)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    tps, shards = _mesh_choices(costs, ranks, tp, shard)
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1
                           or any((ranks // t) % dp for t in tps)):
        raise ValueError(f"dp must be a positive integer that divides ranks={ranks} (over tp: "
                         f"the pipeline ranks), got {dp!r}")
    for name, opt in (("max_replicas", max_replicas), ("rows", rows), ("mesh_top", mesh_top)):
        if opt is not None and (isinstance(opt, bool) or not isinstance(opt, int) or opt < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {opt!r}")
    if dp is not None and rows is not None and rows % dp:
        raise ValueError(f"dp={dp} replicas cannot split {rows}-row micro-batches evenly: "
                         f"pick a dp that divides {rows} or change the batch size")
    if families is not None:
        from orgel.plan.templates import sequential_families

        known = sequential_families()
        unknown = sorted(set(families) - set(known))
        if not families or unknown:
            raise ValueError(f"families must name some of {', '.join(known)}; "
                             f"got {list(families)!r}")
    meshes: list[tuple[int, int]] = []  # (tp, dp)
    for t in tps:
        width_ranks = ranks // t
        ds = ([d for d in range(1, width_ranks + 1) if width_ranks % d == 0] if dp is None
              else [dp])
        meshes += [(t, d) for d in ds if rows is None or rows % d == 0]
    if min(ranks // (t * d) for t, d in meshes) > costs.num_blocks:
        raise ValueError(f"{ranks} ranks but the model is cut into only {costs.num_blocks} "
                         f"blocks (the pieces a stage is made of): use at most "
                         f"{costs.num_blocks} ranks per pipeline, more with dp= or tp=, or "
                         "ask for more blocks (blocks=, --blocks) where the model has them")
    if time_limit == "auto":
        time_limit = search_budget(costs.num_blocks, ranks)
    elif time_limit is not None and (not isinstance(time_limit, int | float) or time_limit <= 0):
        raise ValueError(f"time_limit must be positive seconds, 'auto' or None, got "
                         f"{time_limit!r}")
    started = time.perf_counter()
    scorer = Scorer(costs, memory=memory)
    options = dict(width=width, max_move=max_move, max_loops=max_loops, time_limit=time_limit,
                   per_member=per_member, groups=groups, top=top, families=families)
    graph_options: dict[str, Any] = {"max_replicas": max_replicas, "pure_dp": False}
    candidates: list[tuple[float, str, Plan, BlockCosts]] = []
    base_times: dict[str, float | None] = {}
    evaluations = 0
    jobs = [(t, d, how) for t, d in meshes if ranks // (t * d) <= costs.num_blocks
            for how in (shards if d > 1 else ("none",))]
    quick: dict[tuple[int, int, str], tuple[float, Plan, BlockCosts]] = {}
    if mesh_top is not None and len(jobs) > 1:
        def price(job: tuple[int, int, str], specs: Any) -> float:
            got = quick_plan(costs, ranks // (job[0] * job[1]), microbatches, tp=job[0],
                             dp=job[1], shard=job[2], memory=scorer.memory, templates=specs)
            if got[1] is not None and got[0] < quick.get(job, (math.inf,))[0]:
                quick[job] = (got[0], got[1], got[2])
            return got[0]

        allowed = [s for s in QUICK_TEMPLATES if s.group <= max_loops
                   and (families is None or s.family in families)]
        def low(job: tuple[int, int, str]) -> float:
            return compute_bound(costs, ranks // (job[0] * job[1]), microbatches, tp=job[0],
                                 dp=job[1], shard=job[2])

        jobs = screen(jobs, price, top=mesh_top, templates=allowed or QUICK_TEMPLATES[:1],
                      bound=low)
        if planner in ("auto", "beam") and allowed:  # the shortlist's quick plans: candidates
            candidates += [(quick[j][0], f"quick {quick[j][1].meta['schedule_label']}",
                            quick[j][1], quick[j][2]) for j in jobs if j in quick]
    for t, d, how in jobs:
        pipeline = ranks // (t * d)
        if candidates and compute_bound(costs, pipeline, microbatches, tp=t, dp=d, shard=how
                                        ) >= min(c[0] for c in candidates):
            continue  # a proven bound: it cannot beat what is found
        table = mesh_table(costs, t, how, d)
        sub = (scorer if table is costs and d == 1 else
               Scorer(table if d == 1 else table.scaled(1.0 / d), memory=scorer.memory))
        found, baselines = _search(sub, pipeline, microbatches, planner, options,
                                   dict(graph_options,
                                        rows=None if rows is None else rows // d))
        evaluations += sub.evaluations
        if not base_times or (t, d, how) == (1, 1, "none"):
            base_times = baselines
        for step, name, p in found:
            if d > 1:
                single, p = p, replicated(p, d, table, scorer.memory, how)
                step_peak = replicated_step(single, p, table)  # reduces priced
                if scorer.memory is not None and step_peak[1].max() > scorer.memory:
                    continue
                step, name = step_peak[0], f"{name} x dp{d}" + (" fsdp" if how == "fsdp"
                                                                else "")
            if t > 1:
                name = f"{name} x tp{t}"
            p = with_mesh(p, pipeline, t, d, how)
            candidates.append((step + end_of_step(table, p), name, p, table))
    if not candidates:
        raise InfeasibleError(_infeasible_message(costs, scorer.memory, ranks, microbatches))
    # the fastest; between candidates equal to rounding, the first found (the plainer mesh:
    # no sharding before FSDP, whose gathers can hide in the warm-up and tie with it)
    step, name, best, table = candidates[0]
    for c in candidates[1:]:
        if c[0] < step * (1 - 1e-9):
            step, name, best, table = c
    seconds = time.perf_counter() - started
    best, sim = predicted(best, table)
    best = dataclasses.replace(best, meta={**best.meta, "planner": name,
                                           "search_seconds": seconds, "baselines": base_times,
                                           "block_graph": dict(costs.meta)})
    return PlanResult(best, name, sim, seconds, base_times, evaluations)


def _mesh_choices(costs: BlockCosts, ranks: int, tp: Any, shard: Any
                  ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The TP degrees and sharding choices of :func:`plan`, checked (ValueError says why).

    ``tp="auto"``: the degrees of :data:`~orgel.costs.mesh.TP_DEGREES` that
    divide ``ranks`` and the GPUs per node (only 1 when the costs carry no
    TP facts); ``shard="auto"``: both choices.
    """
    if tp == "auto":
        tp = tuple(t for t in TP_DEGREES if t == 1 or (
            costs.tp_split and ranks % t == 0 and not costs.links
            and (costs.node_ranks is None or costs.node_ranks % t == 0)))
    if shard == "auto":
        shard = SHARDS
    tps = (tp,) if isinstance(tp, int) and not isinstance(tp, bool) else tuple(tp)
    shards = (shard,) if isinstance(shard, str) else tuple(shard)
    if not tps or not shards:
        raise ValueError("give at least one tp degree and one shard choice")
    bad = [x for x in shards if x not in SHARDS]
    if bad:
        raise ValueError(f"shard {bad[0]!r} is not one of {', '.join(SHARDS)}")
    for t in tps:
        check_tp(costs, t)
        if ranks % t:
            raise ValueError(f"tp={t} does not divide ranks={ranks}: ranks counts processes, "
                             "tp of them per pipeline rank")
    return tps, shards


def search_budget(blocks: int, ranks: int) -> float:
    """Seconds the beam phase gets by default: 0.3 s plus 0.1 ms per block and rank, at
    most :data:`MAX_SEARCH_S`.

    The search is anytime: it keeps the best plan found when the time is up.
    Small problems converge well inside the budget and never meet it; on the
    400-block instance Pfeife's planner was timed on (4 ranks) it gives 0.46 s
    where converging takes 3-4 s, for a plan predicted under 1% slower
    (``benchmarks/planner_vs_pfeife.py`` prints both). The cap matters from about 400
    ranks on: blocks follow the ranks, and 1024 ranks would get 210 s.
    """
    return min(MAX_SEARCH_S, 0.3 + 1e-4 * blocks * ranks)


#: the most seconds :func:`search_budget` gives (``time_limit=`` sets any other)
MAX_SEARCH_S = 20.0


def _search(scorer: Scorer, ranks: int, microbatches: int, planner: str,
            options: dict[str, Any], graph_options: dict[str, Any]
            ) -> tuple[list[tuple[float, str, Plan]], dict[str, float | None]]:
    """Candidates of every asked planner for one pipeline size, and the baselines' times."""
    costs = scorer.bc
    baselines = _baselines(scorer, ranks, microbatches)
    found: list[tuple[float, str, Plan]] = []
    for name, (step, p) in baselines.items():
        if p is not None and planner in (name, "auto"):
            found.append((step, name, p))
    if planner in ("auto", "beam"):
        seq = sequential_plan(scorer, ranks, microbatches, **options)
        if seq is not None:
            p = scorer.to_plan(seq.template, chain_split(seq.points, costs.num_blocks),
                               seq.recompute)
            p = labelled(p, seq.template)
            found.append((seq.score.step_time, "beam", p))
    if planner == "graph" or (planner == "auto" and not costs.is_chain()):
        g = graph_plan(scorer, ranks, microbatches, **graph_options)
        if g is not None:
            found.append((g.score.step_time, "graph", labelled(g.plan, g.template)))
    # reported beside the chosen plan's prediction, so on the same footing (end of step)
    times = {k: (step + end_of_step(costs, p) if p is not None else None)
             for k, (step, p) in baselines.items()}
    return found, times


def _baselines(scorer: Scorer, ranks: int, microbatches: int
               ) -> dict[str, tuple[float, Plan | None]]:
    """Each baseline split with 1F1B: (step time, plan or None when it does not fit)."""
    template = one_f_one_b(ranks, microbatches, scorer.templates)
    out: dict[str, tuple[float, Plan | None]] = {}
    for name in BASELINES:
        points = baseline_points(scorer.bc, name, ranks)
        score = scorer.score_chain(template, points)
        p = None
        if score.feasible:
            p = labelled(scorer.to_plan(template, chain_split(points, scorer.bc.num_blocks)),
                         template)
        out[name] = (score.step_time, p)
    return out


def _size(nbytes: float) -> str:
    """Bytes as ``1KiB``, ``1.38MiB`` or ``2.5GiB`` in the largest unit that fits, rounded up
    to two decimals so that a hint always fits and two different sizes read differently."""
    unit, scale = "B", 1
    for name, size in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)):
        if nbytes >= size:
            unit, scale = name, size
    value = math.ceil(nbytes / scale * 100) / 100
    return f"{value:.2f}".rstrip("0").rstrip(".") + unit


def _least_memory(costs: BlockCosts, ranks: int, microbatches: int) -> int | None:
    """The smallest peak per rank among simple plans that recompute everything."""
    scorer = Scorer(costs, memory=None)
    scorer.memory = None
    best: float | None = None
    if ranks > costs.num_blocks:
        return None
    for name in ("1f1b", "interleaved"):
        try:
            from orgel.schedule.families import build_schedule

            options: dict[str, Any] = {} if name == "1f1b" else {"stages_per_rank": 2}
            base = build_schedule(name, ranks, microbatches, **options)
        except Exception:  # noqa: BLE001 - a family that is missing or rejects the counts
            continue
        t = Template(name, name, options, base)
        if t.num_stages > costs.num_blocks:
            continue
        points = balanced_points(memory_weights(costs), t.num_stages)
        score = scorer.score_chain(t, points, (True,) * t.num_stages)
        peak = float(score.peak_memory.max())
        best = peak if best is None else min(best, peak)
    return None if best is None else int(best)


def _infeasible_message(costs: BlockCosts, memory: int | None, ranks: int,
                        microbatches: int) -> str:
    need = _least_memory(costs, ranks, microbatches)
    text = f"no plan fits in {_size(memory or 0)} per rank on {ranks} ranks"
    hints = []
    if need is not None:
        hints.append(f"the smallest plan found needs {_size(need)} per rank: give --memory "
                     f"{_size(need)} or more")
    for more in (2 * ranks, 4 * ranks, 8 * ranks):
        if more > costs.num_blocks:
            break
        got = _least_memory(costs, more, microbatches)
        if got is not None and memory is not None and got <= memory:
            hints.append(f"or use {more} ranks")
            break
    return text + (": " + "; ".join(hints) if hints else "")
