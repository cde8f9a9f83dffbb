"""DualPipeV (DeepSeek-V3's DualPipe folded into a V): two stages per rank, zero-bubble ends.

The chain is cut into ``2P`` stages and placed as a V: rank ``r`` holds stage ``r``
on the way down and stage ``2P-1-r`` on the way back, so the last stage, the loss,
sits on rank 0 with the first. Each rank runs eight phases (DeepSeek-V3, section
3.2.1, and its open DualPipeV order, which torch 2.13's ``ScheduleDualPipeV``
also follows):

1. ``2 (P-r-1)`` forwards of its first stage;
2. ``r+1`` pairs: a forward of each stage;
3. ``P-r-1`` times: the input gradient (``I``) of its second stage, a deferred
   weight gradient (``W``), a forward of its second stage;
4. the steady state, ``m - 2P + r + 1`` times: forward of the first stage and
   backward of the second, then forward of the second and backward of the first
   (DualPipe overlaps each such pair's communication with its computation; in
   orgel's model every send is asynchronous already);
5. ``P-r-1`` times: backward of the second stage, forward of the second, backward
   of the first;
6. ``r+1`` pairs of backwards, the second half split into ``I`` and ``W``;
7. ``P-r-1`` times: a deferred ``W``, then a backward (``I`` once split) of the
   first stage;
8. the remaining ``W``.

Its bubble is ``(P/2 - 1)(F&B + B - 3W)`` against 1F1B's ``(P-1)(F+B)`` (DeepSeek's
table, ``P`` there counting the V's stages), for ``m >= 2P`` micro-batches::

    orgel run examples/gpt.py:workload --ranks 2 --schedule dualpipev --microbatches 4
"""

from __future__ import annotations

from orgel.schedule.families_common import check_counts, finish, resolve_graph
from orgel.schedule.ir import Action, Plan, PlanError, StageGraph


def v_placement(num_ranks: int) -> list[tuple[int, ...]]:
    """Stage ``s`` of ``2P`` on rank ``s`` down the V and ``2P-1-s`` back up."""
    return [(s if s < num_ranks else 2 * num_ranks - 1 - s,) for s in range(2 * num_ranks)]


class _Rank:
    """One rank's actions as they are appended, with its micro-batch counters."""

    def __init__(self, first: int, second: int) -> None:
        self.first, self.second = first, second
        self.actions: list[Action] = []
        self.forwards = {first: 0, second: 0}
        self.backwards = {first: 0, second: 0}
        self.deferred: list[tuple[int, int]] = []  # (stage, micro-batch) awaiting W

    def forward(self, stage: int) -> None:
        self.actions.append(Action("F", stage, self.forwards[stage]))
        self.forwards[stage] += 1

    def backward(self, stage: int, split: bool) -> None:
        m = self.backwards[stage]
        self.backwards[stage] += 1
        if split:
            self.actions.append(Action("I", stage, m))
            self.deferred.append((stage, m))
        else:
            self.actions.append(Action("B", stage, m))

    def weight(self) -> None:
        if self.deferred:
            stage, m = self.deferred.pop(0)
            self.actions.append(Action("W", stage, m))


def _rank_actions(p: int, m: int, r: int) -> list[Action]:
    rank = _Rank(r, 2 * p - 1 - r)
    first, second = rank.first, rank.second
    for _ in range(2 * (p - r - 1)):
        rank.forward(first)
    for _ in range(r + 1):
        rank.forward(first)
        rank.forward(second)
    for _ in range(p - r - 1):
        rank.backward(second, split=True)
        rank.weight()
        rank.forward(second)
    for _ in range(m - 2 * p + r + 1):
        rank.forward(first)
        rank.backward(second, split=False)
        rank.forward(second)
        rank.backward(first, split=False)
    for _ in range(p - r - 1):
        rank.backward(second, split=False)
        rank.forward(second)
        rank.backward(first, split=False)
    split = False
    half = (r + 1) // 2
    for i in range(r + 1):
        split = split or (i == half and r % 2 == 1)
        rank.backward(second, split=split)
        split = split or (i == half and r % 2 == 0)
        rank.backward(first, split=split)
    for _ in range(p - r - 1):
        rank.weight()
        rank.backward(first, split=split)
    while rank.deferred:
        rank.weight()
    return rank.actions


def dualpipev(num_ranks: int, microbatches: int, *, stage_graph: StageGraph | None = None,
              nbytes: int = 0) -> Plan:
    """DualPipeV on ``num_ranks`` ranks: ``2 * num_ranks`` stages in a V (see the module)."""
    check_counts(num_ranks, microbatches)
    p, m = num_ranks, microbatches
    if m < 2 * p:
        raise PlanError(f"dualpipev needs at least 2 * ranks = {2 * p} micro-batches, got {m}: "
                        "use more micro-batches or another schedule")
    graph = resolve_graph(stage_graph, 2 * p, nbytes, "dualpipev")
    schedule = [_rank_actions(p, m, r) for r in range(p)]
    return finish(graph, v_placement(p), p, m, schedule, {"schedule": "dualpipev"})
