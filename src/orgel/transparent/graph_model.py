"""What the placeholders of a graph TorchDynamo hands ``orgel.backend`` are (:func:`roles_of`:
the caller's parameters and buffers under their names in the user's model, model inputs,
sizes), so capture, split and checkpoints see the original names.
"""

from __future__ import annotations

import keyword
import re
from typing import Any

import torch

_TOKEN = re.compile(r"\.([A-Za-z_]\w*)|\[\'([^\']+)\'\]|\[(\d+)\]")


def describe_autocast(state: tuple[str, torch.dtype] | None) -> str:
    return "no autocast" if state is None else f"torch.autocast({state[0]!r}, dtype={state[1]})"


def register_state(module: torch.nn.Module, kind: str, name: str, value: torch.Tensor) -> None:
    """Register ``value`` as parameter or buffer ``name`` (dotted) of ``module``."""
    *path, leaf = name.split(".")
    owner: torch.nn.Module = module
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, torch.nn.Module())
        owner = owner._modules[part]  # type: ignore[assignment]
    if kind == "param":
        assert isinstance(value, torch.nn.Parameter)
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value)


def roles_of(placeholders: list[torch.fx.Node], example_inputs: list[Any]
             ) -> list[tuple[str, str]]:
    """The role of each of a Dynamo graph's placeholders (:func:`role_of`). A size Dynamo
    left symbolic is ``("size", symbol)``: the joined graphs bind it to a dimension of the
    closure's arguments (:func:`orgel.graph.glue_sizes.size_roles`)."""
    return [role_of(n, v) for n, v in zip(placeholders, example_inputs, strict=True)]


def role_of(node: torch.fx.Node, value: Any) -> tuple[str, str]:
    """(kind, name) of a dynamo placeholder: param/buffer by original name, input, const,
    or a symbolic size (its symbol)."""
    if isinstance(value, torch.SymInt):
        return "size", str(value)
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    text = ""
    if source is not None:
        text = source.name() if callable(source.name) else str(source.name)
    tokens = [a or b or c for a, b, c in _TOKEN.findall(text)]
    if "_parameters" in tokens or isinstance(value, torch.nn.Parameter):
        return "param", ".".join(t for t in tokens[1:] if t not in ("_modules", "_parameters"))
    if "_buffers" in tokens:
        return "buffer", ".".join(t for t in tokens[1:] if t not in ("_modules", "_buffers"))
    if text.startswith("L[") and tokens and isinstance(value, torch.Tensor):
        name = tokens[-1]  # an argument taken as L["args"][0] is named by its position
        plain = name.isidentifier() and not keyword.iskeyword(name)
        return "input", name if plain else f"arg{name}"
    return "const", f"_orgel_const_{node.name}"
