"""The graph TorchDynamo hands ``orgel.backend``, as a module with the caller's state names.

:class:`GraphModel` registers the parameters and buffers a Dynamo graph reads under their
names in the user's model, so capture, split and checkpoints see the original names.
"""

from __future__ import annotations

import keyword
import re
from typing import Any

import torch

_TOKEN = re.compile(r"\.([A-Za-z_]\w*)|\[\'([^\']+)\'\]|\[(\d+)\]")


class GraphModel(torch.nn.Module):
    """The graph TorchDynamo captured, as a module holding the original parameters.

    Parameters and buffers are registered under their names in the user's
    model (taken from dynamo's sources), so orgel's capture, split and
    checkpoints see the original names; ``forward(**inputs)`` calls the graph.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                 roles: list[tuple[str, str]] | None = None,
                 autocast: tuple[str, torch.dtype] | None = None) -> None:
        super().__init__()
        # the autocast the caller ran the graph under: forward re-opens it, so a capture of
        # this module holds the region and every stage re-enters it
        self.autocast = autocast
        # dynamo hands over a lazily compiled GraphModule whose first forward generates
        # its code; dynamo refuses to trace that step, and orgel's capture traces this
        # module again, so generate the code now
        real_recompile = getattr(gm, "real_recompile", None)
        if callable(real_recompile):
            real_recompile()
        self.graph_module = gm
        self.roles: list[tuple[str, str]] = []  # (kind, name) per placeholder, in order
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # dynamo drops the placeholders' sources once the backend returns: pass the roles
        # read while it was compiling (``roles``) to build one later
        if roles is None:
            roles = roles_of(placeholders, example_inputs)
        loose = unbound(roles)
        if loose:  # one graph reads its sizes off its inputs
            raise ValueError(UNBOUND.format(loose[0]))
        for (kind, name), value in zip(roles, example_inputs, strict=True):
            if kind in ("param", "buffer"):
                register_state(self, kind, name, value)
            elif kind == "const":
                self.register_buffer(name, value, persistent=False)
            self.roles.append((kind, name))
        self.input_names = [n for k, n in self.roles if k == "input"]

    def forward(self, **inputs: torch.Tensor) -> Any:
        args: list[Any] = []
        for kind, name in self.roles:
            if kind == "input":
                args.append(inputs[name])
            elif kind == "size":  # a size Dynamo left symbolic: read off the input it sizes
                of, dim = name.rsplit(":", 1)
                if dim.startswith("stride"):  # or a stride (a view's, such as a slice)
                    args.append(inputs[of].stride(int(dim.removeprefix("stride"))))
                else:
                    args.append(inputs[of].shape[int(dim)])
            elif kind == "const":
                args.append(getattr(self, name))
            elif kind == "param":
                args.append(self.get_parameter(name))
            else:
                args.append(self.get_buffer(name))
        if self.autocast is None:
            return self.graph_module(*args)
        with torch.autocast(self.autocast[0], dtype=self.autocast[1]):
            return self.graph_module(*args)


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


#: a symbolic size of one graph that none of its inputs has
UNBOUND = ("torch.compile traced the model with a symbolic size {} that no model input has; "
           "use torch.compile(model, backend=pipe, dynamic=False)")


def roles_of(placeholders: list[torch.fx.Node], example_inputs: list[Any],
             strict: bool = True) -> list[tuple[str, str]]:
    """The role of each of a Dynamo graph's placeholders (:func:`role_of`).

    A size Dynamo left symbolic (``torch.compile(dynamic=True)``, or dimensions marked
    dynamic) is ``("size", "input:dim")``: the model input whose dimension ``dim`` it is,
    so :class:`GraphModel` reads it off the inputs it is given; a symbolic stride (an input
    that is a view, such as a micro-batch cut along ``batch_dim=1``) is
    ``("size", "input:stride<dim>")``. Raises ValueError for a symbol no model input has,
    unless not ``strict``: then it stays ``("size", symbol)`` (a graph after a graph break,
    whose sizes :func:`orgel.graph.glue_sizes.size_roles` binds to the forward's inputs).
    """
    roles = [role_of(n, v) for n, v in zip(placeholders, example_inputs, strict=True)]
    where: dict[str, str] = {}  # symbol -> "input:dim"
    for node, (kind, name) in zip(placeholders, roles, strict=True):
        shape = getattr(node.meta.get("example_value"), "shape", ())
        if kind == "input":
            for dim, size in enumerate(shape):
                if isinstance(size, torch.SymInt):
                    where.setdefault(str(size), f"{name}:{dim}")
            value = node.meta.get("example_value")
            strides = value.stride() if isinstance(value, torch.Tensor) else ()
            for dim, stride in enumerate(strides):
                if isinstance(stride, torch.SymInt):
                    where.setdefault(str(stride), f"{name}:stride{dim}")
    sized = []
    for node, (kind, name) in zip(placeholders, roles, strict=True):
        if kind == "size":
            symbol = str(node.meta.get("example_value", name))
            if symbol not in where and strict:
                raise ValueError(UNBOUND.format(symbol))
            name = where.get(symbol, symbol)
        sized.append((kind, name))
    return sized


def unbound(roles: list[tuple[str, str]]) -> list[str]:
    """The symbolic sizes among a graph's placeholder ``roles`` (:func:`roles_of`, not
    ``strict``) that none of its inputs has."""
    return [name for kind, name in roles if kind == "size" and ":" not in name]


def role_of(node: torch.fx.Node, value: Any) -> tuple[str, str]:
    """(kind, name) of a dynamo placeholder: param/buffer by original name, input, const,
    or a symbolic size (its symbol; :func:`roles_of` finds the input it sizes)."""
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
