"""How many micro-batches for a global batch: plan each candidate count, keep the fastest.

A global batch of ``batch`` rows can run as ``m`` micro-batches of ``batch / m``
rows. More micro-batches shrink the pipeline bubble (``p - 1`` idle slots out
of ``m + p - 1``) and the activations each in-flight micro-batch keeps, but
every action pays a fixed overhead and every message a fixed latency, so past
some ``m`` the step gets slower again. :func:`search_microbatches` plans the
counts worth trying with the normal :func:`~orgel.plan.planner.plan` and keeps
the one with the shortest predicted step (the highest throughput, ``batch /
step_time``), recording every candidate in ``plan.meta["microbatch_search"]``.

Costs for a micro-batch size come from the caller (``costs_at(rows)``): a
profile at that size for a workload, or a costs file scaled linearly from the
size it was measured at (:func:`costs_per_rows`). Profiling is the expensive
part, so the search is coarse to fine: first counts about a factor of two
apart (from the smallest to the largest), then, while untried counts lie
between the best one and its tried neighbours, the count in the (geometric)
middle of each side (the best so far, 16, has tried neighbours 8 and 32)::

    candidates  2  3  4  6  8  12  16  24  32  48
    coarse      2     4     8      16      32  48
    fine                        12      24
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orgel.costs.blocks import BlockCosts
from orgel.plan.planner import InfeasibleError, PlanResult, plan

#: By default counts go up to this many micro-batches per rank.
PER_RANK = 8


def microbatch_choices(batch: int, ranks: int, *, dp: int | None = 1,
                       per_rank: int = PER_RANK) -> list[int]:
    """The micro-batch counts worth planning for ``batch`` rows on ``ranks`` ranks, ascending.

    A count ``m`` must divide ``batch`` (every micro-batch has ``batch / m``
    rows) and, with ``dp`` data-parallel replicas, give each replica whole rows
    (``batch / m`` divisible by ``dp``). Counts run from the pipeline depth
    (``ranks / dp``; ``1`` with ``dp=None``, where the planner chooses the
    degree) up to ``per_rank x ranks``: fewer micro-batches than stages leave
    ranks idle, and far more only add per-action overhead. When no count lies
    in that range (a small batch), every smaller count that qualifies does.
    """
    for name, value in (("batch", batch), ("ranks", ranks), ("per_rank", per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1
                           or ranks % dp):
        raise ValueError(f"dp must be a positive integer that divides ranks={ranks}, got {dp!r}")
    whole = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % (dp or 1) == 0]
    low = 1 if dp is None else ranks // dp
    inside = [m for m in whole if low <= m <= per_rank * ranks]
    if inside:
        return inside
    below = [m for m in whole if m <= per_rank * ranks]
    if not below:
        raise ValueError(f"a batch of {batch} rows cannot be cut into micro-batches that each "
                         f"of dp={dp} replicas gets whole rows of: use a batch divisible by {dp}")
    return below


def costs_per_rows(costs: BlockCosts) -> Callable[[int], BlockCosts]:
    """``costs_at(rows)`` for a cost table measured at ``costs.rows`` rows per micro-batch.

    Times, activations, outputs and temporaries scale linearly with the rows;
    parameters, links and the per-action overhead stay fixed (which is the
    trade-off the search weighs). Raises ValueError when ``costs.rows`` is unknown.
    """
    base = costs.rows
    if base is None:
        raise ValueError("the costs give no 'rows' (rows per micro-batch they were measured "
                         "at): add \"rows\": N to the costs file to plan a --batch")

    def costs_at(rows: int) -> BlockCosts:
        out = costs.scaled(rows / base)
        out.rows = rows
        return out

    return costs_at


@dataclass
class Tried:
    """One candidate count: its plan (None when nothing fits) or the planner's error."""

    microbatches: int
    rows: int
    result: PlanResult | None
    error: InfeasibleError | None = None
    seconds: float = 0.0  # the planner's search, without the costs

    @property
    def step_time(self) -> float:
        return math.inf if self.result is None else self.result.step_time

    def entry(self, batch: int) -> dict[str, Any]:
        """The JSON record in ``meta["microbatch_search"]``."""
        r = self.result
        return {"microbatches": self.microbatches, "rows": self.rows,
                "step_time": None if r is None else r.step_time, "feasible": r is not None,
                "rows_per_s": None if r is None or r.step_time <= 0
                else 1000.0 * batch / r.step_time,
                "planner": None if r is None else r.planner}


def search_microbatches(costs_at: Callable[[int], BlockCosts], batch: int, ranks: int, *,
                        dp: int | None = 1, choices: list[int] | None = None,
                        per_rank: int = PER_RANK,
                        progress: Callable[[str], None] | None = None,
                        **options: Any) -> PlanResult:
    """The fastest plan of a ``batch``-row step over the candidate micro-batch counts.

    ``costs_at(rows)`` returns the block costs of one micro-batch of ``rows``
    rows (called once per count tried). ``choices`` overrides the candidate
    counts (default :func:`microbatch_choices` of ``batch``, ``ranks``, ``dp``
    and ``per_rank``). ``progress(text)`` hears what is tried next (e.g. "8
    micro-batches of 4 rows"). ``options`` go to :func:`~orgel.plan.planner.plan`
    (``memory``, ``planner``, ``max_replicas``, ...), which gets ``rows`` from
    the count. The returned plan's ``meta["microbatch_search"]`` lists every
    count tried (``microbatches``, ``rows``, ``step_time`` ms or None,
    ``feasible``, ``rows_per_s``, ``planner``), ascending; ``meta["batch"]``
    is ``batch``. Raises :class:`InfeasibleError` when no count fits (with the
    planner's message for the smallest micro-batches tried), ValueError on bad options.
    """
    for name in ("rows", "microbatches"):
        if name in options:
            raise ValueError(f"{name} follows from each candidate count: leave it out")
    if choices is None:
        choices = microbatch_choices(batch, ranks, dp=dp, per_rank=per_rank)
    else:
        bad = [m for m in choices if isinstance(m, bool) or not isinstance(m, int) or m < 1
               or batch % m]
        if bad or not choices:
            raise ValueError(f"micro-batch counts {bad or choices} do not divide the batch of "
                             f"{batch} rows: give counts that do")
        choices = sorted(set(choices))
    tried: dict[int, Tried] = {}

    def attempt(m: int) -> None:
        rows = batch // m
        if progress is not None:
            progress(f"{m} micro-batches of {rows} row{'' if rows == 1 else 's'}")
        costs = costs_at(rows)
        started = time.perf_counter()
        try:
            result = plan(costs, ranks, m, dp=dp, rows=rows, **options)
        except InfeasibleError as exc:
            tried[m] = Tried(m, rows, None, exc, time.perf_counter() - started)
        else:
            tried[m] = Tried(m, rows, result, None, time.perf_counter() - started)

    for m in coarse_choices(choices):
        attempt(m)
    while True:
        nxt = refine(choices, tried)
        if not nxt:
            break
        for m in nxt:
            attempt(m)
    feasible = [t for t in tried.values() if t.result is not None]
    if not feasible:
        smallest = tried[max(tried)]
        raise InfeasibleError(
            f"no micro-batch count fits a batch of {batch} rows (tried "
            f"{', '.join(str(m) for m in sorted(tried))}); with {smallest.microbatches} "
            f"micro-batches of {smallest.rows} rows: {smallest.error}")
    best = min(feasible, key=lambda t: (t.step_time, t.microbatches))
    result = best.result
    assert result is not None
    result.search_seconds = sum(t.seconds for t in tried.values())
    result.evaluations = sum(t.result.evaluations for t in feasible if t.result is not None)
    result.plan = dataclasses.replace(result.plan, meta={
        **result.plan.meta, "search_seconds": result.search_seconds, "batch": batch,
        "microbatch_search": [tried[m].entry(batch) for m in sorted(tried)]})
    return result


def coarse_choices(choices: list[int]) -> list[int]:
    """Counts about a factor of two apart: the smallest, each >= twice the last, the largest."""
    out = [choices[0]]
    for m in choices[1:]:
        if m >= 2 * out[-1]:
            out.append(m)
    if out[-1] != choices[-1]:
        out.append(choices[-1])
    return out


def refine(choices: list[int], tried: dict[int, Tried]) -> list[int]:
    """The next counts to try: the middle untried count on each side of the best so far.

    Empty when the best count's tried neighbours leave nothing untried between
    them, or when nothing fits yet (smaller micro-batches were tried and do
    not fit either: memory only grows with the rows).
    """
    feasible = [t for t in tried.values() if t.result is not None]
    if not feasible:
        return []
    best = min(feasible, key=lambda t: (t.step_time, t.microbatches)).microbatches
    below = max((m for m in tried if m < best), default=None)
    above = min((m for m in tried if m > best), default=None)
    out = []
    for lo, hi in ((below, best), (best, above)):
        if lo is None or hi is None:
            continue
        between = [m for m in choices if lo < m < hi and m not in tried]
        if between:
            middle = math.sqrt(lo * hi)
            out.append(min(between, key=lambda m: (abs(math.log(m / middle)), m)))
    return out

