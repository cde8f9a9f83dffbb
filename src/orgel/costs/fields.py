"""The costs file's fields: which keys it allows, and checked reads of their values.

Each reader turns one JSON value of a costs file into a checked number, link
or list, or raises :class:`CostsFileError` naming the field and how to fix it.
:meth:`orgel.costs.table.BlockCosts.from_dict` reads a whole file with them.
"""

from __future__ import annotations

import math
from typing import Any

from orgel.schedule.costs import Link

BLOCK_KEYS = ("fwd", "bwd", "wgrad", "params", "activations", "output", "temporary", "name",
              "nodes", "weight_kept", "input_saved", "output_unsaved", "split_input",
              "split_weight", "optimizer_ms", "tp", "recompute")
#: Optional per-block times: given for every block or for none.
OPTIONAL_TIMES = ("split_input", "split_weight", "optimizer_ms")
TOP_KEYS = ("blocks", "edges", "link", "links", "memory_per_rank", "optimizer_factor",
            "optimizer_temporary", "action_overhead", "meta", "optimizer_ms_per_mib", "rows",
            "tied", "step_overhead", "node", "edge_grads", "edge_bytes", "cores")


class CostsFileError(ValueError):
    """A costs file (or dict) is malformed; the message says which field and how to fix it."""


def read_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CostsFileError(f"{where} must be a finite number, got {value!r}")
    if value < 0:
        raise CostsFileError(f"{where} must not be negative, got {value!r}")
    return float(value)


def read_numbers(data: Any, where: str, keys: tuple[str, ...],
                 ints: tuple[str, ...]) -> dict[str, Any]:
    """A JSON object of numbers >= 0 with keys among ``keys`` (absent: 0; ``ints``: bytes,
    as int), as a dict of all ``keys``; ValueError naming ``where``."""
    if not isinstance(data, dict) or set(data) - set(keys):
        raise ValueError(f"{where} must be an object with keys among {list(keys)}, "
                         f"got {data!r}")
    values: dict[str, Any] = {}
    for key in keys:
        v = data.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError(f"{where}.{key} must be a number >= 0, got {v!r}")
        values[key] = int(v) if key in ints else float(v)
    return values


def read_tied(data: Any) -> list[Any]:
    if not isinstance(data, list):
        raise CostsFileError("'tied' must be a list of {\"blocks\": [0, 11], \"nbytes\": N, "
                             "\"name\": \"...\"} objects (blocks that read one parameter)")
    return data


def read_edge_grads(data: Any, key: str = "edge_grads") -> dict[tuple[int, int], int]:
    """``edge_grads`` (or ``edge_bytes``, the other ``key``): ``[producer, consumer, bytes]``."""
    if not isinstance(data, list) or not all(
            isinstance(x, list) and len(x) == 3 and all(isinstance(v, int) for v in x)
            for x in data):
        raise CostsFileError(f"'{key}' must be a list of [producer, consumer, bytes]")
    return {(a, b): n for a, b, n in data}


def read_node(data: Any) -> dict[str, Any]:
    """The ``node`` entry as BlockCosts' ``node_ranks`` and ``node_link`` (empty: none)."""
    if data is None:
        return {}
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or set(data) - {"ranks", "link"} or isinstance(ranks, bool)
            or not isinstance(ranks, int) or ranks < 1):
        raise CostsFileError("'node' must be {\"ranks\": ranks per node (>= 1), \"link\": "
                             f"{{\"latency\": ms, \"per_mib\": ms}}}}, got {data!r}")
    return {"node_ranks": ranks, "node_link": read_link(data.get("link", {}), "node.link")}


def read_link(data: Any, where: str) -> Link:
    if not isinstance(data, dict) or set(data) - {"latency", "per_mib"}:
        raise CostsFileError(f"{where} must be an object {{\"latency\": ms, \"per_mib\": ms}}, "
                             f"got {data!r}")
    return Link(latency=read_number(data.get("latency", 0.0), f"{where}.latency"),
                per_mib=read_number(data.get("per_mib", 0.0), f"{where}.per_mib"))
