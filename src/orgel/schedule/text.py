"""The schedule's text form: one rank per line, ``rank0: F0.0 F0.1 B0.0 ...``.

Blank lines and ``#`` comments (whole-line or trailing) are allowed, so a
schedule can be written and annotated by hand. Errors name the line and the
token that is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from orgel.schedule.ir import Action, Plan, PlanError, StageGraph

_LABEL_RE = re.compile(r"^rank(\d+)$")


def format_schedule(schedule: list[list[Action]]) -> str:
    """One line per rank: ``rank0: F0.0 F0.1 B0.0 ...`` (no trailing newline)."""
    return "\n".join(
        f"rank{r}: " + " ".join(str(a) for a in actions) if actions else f"rank{r}:"
        for r, actions in enumerate(schedule)
    )


def parse_schedule(text: str, *, num_ranks: int | None = None) -> list[list[Action]]:
    """Parse the text form into ``schedule[rank] -> list[Action]``.

    Every rank from 0 to the highest one named must have exactly one line (a rank
    with no work is written ``rank3:``). With ``num_ranks`` the number of rank
    lines must match it. Raises :class:`PlanError` naming the line and token.
    """
    rows: dict[int, list[Action]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        label, sep, body = line.partition(":")
        match = _LABEL_RE.match(label.strip())
        if not sep or match is None:
            raise PlanError(
                f"line {lineno}: expected 'rankN: ACTION ACTION ...', got {raw.strip()!r}"
            )
        rank = int(match.group(1))
        if rank in rows:
            raise PlanError(f"line {lineno}: rank{rank} is written twice; merge its lines")
        actions: list[Action] = []
        for col, token in enumerate(body.split(), start=1):
            try:
                actions.append(Action.parse(token))
            except PlanError as exc:
                raise PlanError(f"line {lineno} (rank{rank}), token {col}: {exc}") from None
        rows[rank] = actions
    if not rows:
        raise PlanError("schedule text has no 'rankN:' lines")
    count = max(rows) + 1
    missing = [r for r in range(count) if r not in rows]
    if missing:
        raise PlanError(
            f"schedule text has no line for rank(s) {missing}: write 'rank{missing[0]}:' "
            "for a rank with no work"
        )
    if num_ranks is not None and count != num_ranks:
        raise PlanError(f"schedule text has {count} rank lines but the plan has {num_ranks} ranks")
    return [rows[r] for r in range(count)]


def plan_from_text(text: str, *, stage_graph: StageGraph | None = None,
                   placement: Sequence[Sequence[int]] | None = None,
                   microbatches: int | None = None, nbytes: int = 0,
                   meta: dict[str, Any] | None = None) -> Plan:
    """A validated Plan from a hand-written schedule.

    What is not given is read off the text: the stage graph is a chain over
    stages ``0..max`` (edges of ``nbytes``), stage ``s`` is placed on the ranks
    whose lines mention it, and ``microbatches`` is the highest micro-batch
    plus one. Raises :class:`PlanError` (parse errors name line and token;
    validation errors name rank, position and action).
    """
    from orgel.schedule.validate import validate

    schedule = parse_schedule(text)
    actions = [a for row in schedule for a in row]
    if not actions:
        raise PlanError("the schedule has no actions")
    if stage_graph is None:
        stage_graph = StageGraph.chain(max(a.stage for a in actions) + 1, nbytes)
    if placement is None:
        ranks_of: list[set[int]] = [set() for _ in range(stage_graph.num_stages)]
        for r, row in enumerate(schedule):
            for a in row:
                if 0 <= a.stage < stage_graph.num_stages:
                    ranks_of[a.stage].add(r)
        for s, ranks in enumerate(ranks_of):
            if not ranks:
                raise PlanError(f"no rank runs stage {s}: add its actions or pass placement")
        placement = [sorted(ranks) for ranks in ranks_of]
    if microbatches is None:
        microbatches = max(a.microbatch for a in actions) + 1
    plan = Plan(
        stage_graph=stage_graph,
        placement=[tuple(ranks) for ranks in placement],
        num_ranks=len(schedule),
        microbatches=microbatches,
        schedule=schedule,
        meta={"schedule": "hand-written"} if meta is None else meta,
    )
    validate(plan)
    return plan
