"""The schedule's text form: one rank per line, ``rank0: F0.0 F0.1 B0.0 ...``.

Blank lines and ``#`` comments (whole-line or trailing) are allowed, so a
schedule can be written and annotated by hand. Errors name the line and the
token that is wrong.
"""

from __future__ import annotations

import re

from orgel.schedule.ir import Action, PlanError

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
