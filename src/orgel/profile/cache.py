"""The profiler's on-disk cache: ``$ORGEL_CACHE`` (or ``~/.cache/orgel``), one JSON file a key."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """Where profiles are cached: ``$ORGEL_CACHE`` or ``~/.cache/orgel``."""
    return Path(os.environ.get("ORGEL_CACHE") or Path.home() / ".cache" / "orgel")


def cache_key(**parts: Any) -> str:
    """A stable short hash of JSON-able ``parts``."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _cached(kind: str, key: str) -> dict[str, Any] | None:
    path = cache_dir() / f"{kind}-{key}.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _store(kind: str, key: str, data: dict[str, Any]) -> None:
    path = cache_dir() / f"{kind}-{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs time


def graph_hash(opgraph: Any) -> str:
    """Hash of an op graph's structure: nodes (op, inputs, shape, dtype) and parameter shapes."""
    nodes = [(n.name, n.op, list(n.inputs), list(n.params), n.shape, n.dtype)
             for n in opgraph.nodes.values()]
    params = sorted((k, list(p.shape), str(p.dtype)) for k, p in opgraph.params.items())
    return cache_key(nodes=nodes, params=params)
