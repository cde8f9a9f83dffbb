"""Inputs nested in containers: ``forward(self, batch)`` given a dict (or list) of tensors.

Inside orgel a model's inputs are tensors by name (what is batched, what each stage
receives, what a later batch must match). An input that is a dict, list or tuple of
tensors (nested to any depth) is named by its path: ``batch.pixels`` for
``batch["pixels"]``, ``views.0`` for ``views[0]``; those names are what ``batch_dim``,
``replicated`` and every error speak of. :func:`flatten` makes the names (every front end
reads the inputs through :func:`orgel.workload.given_inputs`, which calls it), and
:func:`call` calls the model with the containers rebuilt: the one way orgel calls a
user's forward on named inputs (dicts stay dicts; a list or tuple comes back a list).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from orgel.batching import WorkloadError, tensors_in

SEP = "."


def flatten(named: Mapping[str, Any]) -> dict[str, Any]:
    """``named`` with every dict, list or tuple that holds tensors replaced by its
    leaves, named by their path (``batch.pixels``); other values as they are."""
    out: dict[str, Any] = {}
    for name, value in named.items():
        _flatten(name, value, out)
    return out


def _flatten(path: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, torch.Tensor) or not tensors_in(value):
        out[path] = value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str) or not key or SEP in key or key.isdigit():
                raise WorkloadError(
                    f"input {path!r} is a dict with the key {key!r}: orgel names a nested "
                    f"input by its path ({path}{SEP}key), so its keys must be strings without "
                    f"{SEP!r} that are not numbers; rename the key")
            _flatten(f"{path}{SEP}{key}", item, out)
    else:  # a list or tuple (tensors_in looks into nothing else)
        for index, item in enumerate(value):
            _flatten(f"{path}{SEP}{index}", item, out)


def nest(named: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments :func:`flatten` named: each path's containers rebuilt (a dict
    whose keys are 0..n-1 becomes a list)."""
    if not any(SEP in name for name in named):
        return dict(named)
    tree: dict[str, Any] = {}
    for name, value in named.items():
        *parents, last = name.split(SEP)
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return {name: _sequences(value) for name, value in tree.items()}


def _sequences(node: Any) -> Any:
    if type(node) is not dict:  # a leaf (a plain dict here is one nest made)
        return node
    node = {key: _sequences(value) for key, value in node.items()}
    if node and all(key.isdigit() for key in node):
        return [node[str(i)] for i in range(len(node))]
    return node


def call(model: Any, named: Mapping[str, Any]) -> Any:
    """``model(**named)`` with the nested inputs rebuilt (:func:`nest`)."""
    return model(**nest(named))


def placeholder(graph: torch.fx.Graph, name: str) -> torch.fx.Node:
    """A placeholder of ``graph`` for the input ``name``, its argument an identifier (a
    path, ``batch.pixels``, is none): the graph's own name for it, unique in the graph."""
    node = graph.placeholder(name)
    node.target = node.name
    return node
