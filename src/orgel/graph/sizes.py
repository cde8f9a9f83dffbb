"""Symbolic sizes: a captured graph that runs on batches of other sizes, and the check.

Capture marks every dimension of every model input as possibly dynamic
(``torch._dynamo.maybe_mark_dynamic``). Dynamo then gives the graph one integer
placeholder per free size symbol (``s27``) and the ops use it (``torch.arange(s27)``,
``view(s52, s27, 4, 16)``). :func:`bind_sizes` binds each such placeholder to the
model input and dimension it is the size of (``("size", ("input_ids", 1))``);
size arithmetic (``operator.mul`` on sizes) stays in the graph as *size nodes*,
which a split recomputes in every stage that needs them. A dimension the model's
code fixes (a guard specializes it, or Dynamo takes a size of 0 or 1 as fixed)
stays a plain number.

:class:`Shapes` is what a graph accepts: per input and dimension, the captured
size (static) or the symbol (any size), and the guards Dynamo recorded on the
symbols (``s27 <= 512``, a branch taken on a size). :meth:`Shapes.check` raises
:class:`ShapeError` for a micro-batch the graph would compute wrongly, naming the
input, the dimension, the captured and the given size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.graph.opgraph import CaptureError
from orgel.workload import WorkloadError

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class ShapeError(WorkloadError):
    """A batch's sizes are not ones the captured graph computes exactly; the message says why.

    A :class:`~orgel.workload.WorkloadError`: raised in the caller before any rank starts
    the step, and the pipeline trains on.
    """


@dataclass
class Shapes:
    """The sizes a captured graph takes.

    ``inputs[name][d]`` is the captured size of model input ``name`` along ``d``
    when that size is fixed, or the name of its size symbol (any size, subject to
    ``guards``). ``guards`` are sympy conditions on the symbols the model's code
    relies on; ``ranges`` the symbols' allowed values (inclusive, None: no bound).
    """

    inputs: dict[str, tuple[int | str, ...]]
    guards: list[Any] = field(default_factory=list)
    ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    symbols: dict[str, Any] = field(default_factory=dict)  # name -> sympy symbol
    #: each symbol's size in the captured (example) batch, where Dynamo recorded it
    captured: dict[str, int] = field(default_factory=dict)

    @property
    def dynamic(self) -> bool:
        """Whether any dimension takes any size."""
        return any(isinstance(s, str) for dims in self.inputs.values() for s in dims)

    def check(self, named: dict[str, Any], what: str = "micro-batch") -> None:
        """Raise :class:`ShapeError` unless the graph computes ``named`` (one ``what``) exactly."""
        values: dict[str, tuple[int, str]] = {}
        for name, dims in self.inputs.items():
            t = named.get(name)
            if not isinstance(t, torch.Tensor):
                continue
            if t.dim() != len(dims):
                raise ShapeError(
                    f"input {name!r} has {t.dim()} dimensions {tuple(t.shape)} but the model "
                    f"was captured with {len(dims)} (a {what} of shape "
                    f"{_captured(dims)}); give it {len(dims)} dimensions")
            for d, want in enumerate(dims):
                got = int(t.shape[d])
                if isinstance(want, int):
                    if got != want:
                        raise ShapeError(
                            f"input {name!r} has size {got} along dim {d} (a {what} of shape "
                            f"{tuple(t.shape)}), but the captured graph is fixed to size "
                            f"{want} there (captured {what}: {_captured(dims)}): the model's "
                            "code fixes that size, or the capture was static. Give batches "
                            f"whose {what}es have size {want} along dim {d} (pad or cut them), "
                            "or build a new pipeline for these sizes; this step did not run")
                    continue
                seen = values.setdefault(want, (got, f"{name!r} dim {d}"))
                if seen[0] != got:
                    raise ShapeError(
                        f"input {name!r} has size {got} along dim {d} but {seen[1]} has "
                        f"{seen[0]}; the model's code needs them equal (both are one size "
                        "in the captured graph): give equal sizes; this step did not run")
        for sym, (got, where) in values.items():
            lo, hi = self.ranges.get(sym, (0, None))
            if got < lo or (hi is not None and got > hi):
                bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise ShapeError(
                    f"{where} has size {got}, but the captured graph holds for sizes {bound} "
                    "there only (the model's code branched on it, or Dynamo took a size of "
                    f"0 or 1 as fixed): give a size {bound}, or build a pipeline for this "
                    "size; this step did not run")
        subs = {self.symbols[s]: v for s, (v, _) in values.items() if s in self.symbols}
        for guard in self.guards:
            try:
                held = guard.xreplace(subs)
            except Exception:  # noqa: BLE001 - a guard we cannot evaluate is not checked
                continue
            if held.free_symbols:
                continue
            if not bool(held):
                raise ShapeError(self._broken(guard, values, what))

    def _broken(self, guard: Any, values: dict[str, tuple[int, str]], what: str) -> str:
        """Why a guard fails, in the inputs' names: two sizes that were equal in the
        example batch and now differ (labels shorter than the inputs), else the relation."""
        names = {s: where for s, (_, where) in values.items()}
        subs = {self.symbols[s]: v for s, (v, _) in values.items() if s in self.symbols}
        free = sorted((str(s) for s in guard.free_symbols if str(s) in names),
                      key=lambda s: list(names).index(s))
        for i, a in enumerate(free):
            for b in free[i + 1:]:
                was = self.captured.get(a)
                if was is None or was != self.captured.get(b) or subs[self.symbols[a]] == \
                        subs[self.symbols[b]]:
                    continue
                fixed = {**subs, self.symbols[b]: subs[self.symbols[a]]}
                with contextlib.suppress(Exception):
                    if bool(guard.xreplace(fixed)):
                        (got_a, at_a), (got_b, at_b) = values[a], values[b]
                        hint = (" (labels as long as the inputs, -100 where no loss counts)"
                                if "label" in at_b else "")
                        return (
                            f"input {_input(at_b)} has size {got_b} along {_dim(at_b)} but "
                            f"{_input(at_a)} has {got_a} along {_dim(at_a)} (a {what}); the "
                            f"model's code needs them equal (both were {was} in the example "
                            f"batch): give {_input(at_b)} size {got_a} along {_dim(at_b)}, as "
                            f"{_input(at_a)}{hint}; this step did not run")
        readable = guard.xreplace({self.symbols[s]: _named_size(w) for s, w in names.items()
                                   if s in self.symbols})
        relation = (f"{readable.lhs} == {readable.rhs}" if getattr(readable, "func", None)
                    and readable.func.__name__ == "Equality" else str(readable))
        sizes = ", ".join(f"{_named_size(w)} = {v}" for v, w in values.values())
        one = _pinned_to_one(guard)
        hint = "" if one not in names else (
            f" ({_named_size(names[one])} was 1 in the example batch, and the model's code "
            "took a path for exactly 1 there: build the pipeline on an example batch whose "
            "micro-batches have 2 or more there)")
        return (f"the model's code needs {relation} about the input sizes (it held in the "
                f"example batch), which does not hold for this {what}: {sizes}. Give sizes "
                f"for which it holds, or build a pipeline for these sizes{hint}; this step did "
                "not run")


def _pinned_to_one(guard: Any) -> str | None:
    """The symbol ``guard`` pins to 1 (``Eq(s0, 1)``: the code compared a size of 1 with
    another tensor's, as transformers compares the batch with the position ids' rows)."""
    if getattr(guard, "func", None) is None or guard.func.__name__ != "Equality":
        return None
    sides = (guard.lhs, guard.rhs)
    if 1 not in sides:
        return None
    other = sides[1] if sides[0] == 1 else sides[0]
    return str(other) if getattr(other, "is_Symbol", False) else None


def _input(where: str) -> str:
    """``'labels'`` of ``"'labels' dim 1"``."""
    return where.rsplit(" dim ", 1)[0]


def _dim(where: str) -> str:
    """``dim 1`` of ``"'labels' dim 1"``."""
    return "dim " + where.rsplit(" dim ", 1)[1]


def _named_size(where: str) -> Any:
    """A sympy symbol printed as the size it stands for: ``labels.shape[1]``."""
    import sympy

    return sympy.Symbol(f"{_input(where).strip(chr(39))}.shape[{where.rsplit(' dim ', 1)[1]}]",
                        integer=True, positive=True)


def _captured(dims: tuple[int | str, ...]) -> str:
    return "(" + ", ".join(str(s) if isinstance(s, int) else "any" for s in dims) + ")"


def static_shapes(named: dict[str, Any]) -> Shapes:
    """The sizes of a static capture: every dimension as captured."""
    return Shapes({k: tuple(int(s) for s in v.shape) for k, v in named.items()
                   if isinstance(v, torch.Tensor)})


def mark_sizes(named: dict[str, Any]) -> dict[str, Any]:
    """Views of ``named``'s tensors with every dimension marked possibly dynamic."""
    out: dict[str, Any] = {}
    for k, v in named.items():
        if isinstance(v, torch.Tensor):
            v = v.view(v.shape)
            for d in range(v.dim()):
                torch._dynamo.maybe_mark_dynamic(v, d)
        out[k] = v
    return out


def size_settings(dynamic: bool) -> Any:
    """Dynamo's settings for a symbolic capture: one symbol per dimension (no duck sizing)."""
    if not dynamic:
        return contextlib.nullcontext()
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False, backed_size_oblivious=True)  # type: ignore[attr-defined]


def is_symbolic(value: Any) -> bool:
    """Whether ``value`` (a node's example value) is or holds a symbolic size."""
    return any(isinstance(x, SYMBOLIC) for x in pytree.tree_leaves(value))


def bind_sizes(gm: torch.fx.GraphModule, roles: dict[str, tuple[str, Any]]) -> None:
    """Give every size placeholder of ``gm`` the role ``("size", (input, dim))``.

    Records the graph's :class:`Shapes` in ``gm.meta["orgel_shapes"]``. Raises
    :class:`CaptureError` where a size is not one input dimension, or a size node
    reads a tensor (a split could not recompute it), so the capture falls back to
    static sizes.
    """
    import sympy

    bound: dict[Any, tuple[str, int]] = {}
    inputs: dict[str, tuple[int | str, ...]] = {}
    shape_env = None
    for node in gm.graph.nodes:
        role = roles.get(node.name)
        if node.op == "placeholder" and role is not None:
            shape_env = _dims_of(node, role, inputs, bound) or shape_env
    _sizes_from_symbols(gm)
    size_nodes = set()
    fixed: list[tuple[torch.fx.Node, int]] = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.SymInt):
            expr = _expr(value)
            if isinstance(expr, sympy.Integer):  # a size a guard fixed later: a number
                fixed.append((node, int(expr)))
                continue
            if expr not in bound and not node.users:  # a size no op reads (fixed later)
                fixed.append((node, 0))
                continue
            if expr not in bound:
                raise CaptureError(f"size {node.name} ({expr}) is no input's dimension")
            roles[node.name] = ("size", bound[expr])
            size_nodes.add(node)
        elif node.op == "placeholder" and node.name not in roles:
            raise CaptureError(f"graph input {node.name} is {type(value).__name__}")
        elif node.op in ("call_function", "call_method") and is_symbolic(value):
            if any(n not in size_nodes for n in node.all_input_nodes):
                raise CaptureError(f"size node {node.name} reads a tensor")
            size_nodes.add(node)
    for node, number in fixed:
        _replace(gm, node, number)
        roles.pop(node.name, None)
    gm.meta["orgel_shapes"] = _shapes(inputs, bound, shape_env)


def input_shapes(nodes: dict[str, torch.fx.Node]) -> Shapes:
    """The :class:`Shapes` of the model inputs ``nodes`` (name -> placeholder) of a graph
    Dynamo captured with symbolic sizes."""
    bound: dict[Any, tuple[str, int]] = {}
    inputs: dict[str, tuple[int | str, ...]] = {}
    shape_env = None
    for name, node in nodes.items():
        shape_env = _dims_of(node, ("input", name), inputs, bound) or shape_env
    return _shapes(inputs, bound, shape_env)


def _dims_of(node: torch.fx.Node, role: tuple[str, Any],
             inputs: dict[str, tuple[int | str, ...]], bound: dict[Any, tuple[str, int]]) -> Any:
    """Record placeholder ``node``'s dimensions (a model input's in ``inputs``, its symbols in
    ``bound``); returns its shape environment (None: not a tensor). A parameter or buffer of
    a symbolic size raises :class:`CaptureError`."""
    import sympy

    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    dims: list[int | str] = []
    for d, size in enumerate(value.shape):
        expr = size if isinstance(size, int) else _expr(size)
        if not isinstance(expr, sympy.Symbol):  # fixed by a guard (or never symbolic)
            if not isinstance(expr, (int, sympy.Integer)):
                raise CaptureError(f"{node.name} dim {d} has size {size}")
            dims.append(int(expr))
            continue
        if role[0] != "input":
            raise CaptureError(f"{role[0]} {role[1]} has a symbolic size {size}")
        bound.setdefault(expr, (role[1], d))
        dims.append(str(expr))
    if role[0] == "input":
        inputs[role[1]] = tuple(dims)
    return getattr(getattr(value, "fake_mode", None), "shape_env", None)


def _shapes(inputs: dict[str, tuple[int | str, ...]], bound: dict[Any, tuple[str, int]],
            shape_env: Any) -> Shapes:
    """:class:`Shapes` of the input dimensions ``inputs``, their symbols ``bound``, and the
    guards, ranges and example sizes ``shape_env`` holds for them."""
    symbols = {str(s): s for s in bound}
    guards: list[Any] = []
    ranges: dict[str, tuple[int, int | None]] = {}
    captured: dict[str, int] = {}
    if shape_env is not None:
        for s in bound:
            hints = getattr(shape_env, "backed_var_to_val", None)  # torch >= 2.13's name
            with contextlib.suppress(KeyError, TypeError, ValueError):
                captured[str(s)] = int((shape_env.var_to_val if hints is None else hints)[s])
        guards = [g.expr for g in shape_env.guards
                  if g.expr.free_symbols and g.expr.free_symbols <= set(bound)
                  and not _layout_only(g)]
        for s in bound:
            vr = shape_env.var_to_range.get(s)
            if vr is not None:
                ranges[str(s)] = (_bound(vr.lower) or 0, _bound(vr.upper))
    return Shapes(inputs, guards, ranges, symbols, captured)


def _layout_only(guard: Any) -> bool:
    """Whether ``guard`` is a size's ``!= 1`` that an op's own shape logic recorded while
    Dynamo ran it (its ``run_node``), not a branch of the model's code: whether a slice is
    contiguous (Hugging Face's causal-LM loss, ``labels[..., 1:].contiguous()``, needs a
    copy for more than one row). The captured ops compute the same values at 1, where the
    stages run them again on the real sizes, so a micro-batch of one row (a DataLoader's
    smaller last batch cut over the micro-batches) is not refused for it. A ``!= 1`` the
    model's Python compares (``if batch_size == 1``) is Dynamo's ``evaluate_expr``: kept."""
    expr = guard.expr
    if getattr(expr, "func", None) is None or expr.func.__name__ != "Unequality" or \
            not any(a == 1 for a in expr.args):
        return False
    where = getattr(getattr(guard, "sloc", None), "framework_loc", None)
    name = getattr(where, "name", None) or str(where or "")
    return name == "run_node" or str(name).endswith(" in run_node")


def symbolic_shapes(graph: torch.fx.Graph, names: Any) -> dict[str, tuple[Any, ...]]:
    """Each tensor node named in ``names``: ``(shape, dtype)``, the shape in the size symbols
    (from Dynamo's fake value; ints where fixed)."""
    out: dict[str, tuple[Any, ...]] = {}
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if node.name in names and isinstance(value, torch.Tensor):
            shape = tuple(d if isinstance(d, int) else _expr(d) for d in value.shape)
            out[node.name] = (shape, value.dtype)
    return out


def evaluate_shape(shape: tuple[Any, ...], values: dict[Any, int]) -> tuple[int, ...] | None:
    """``shape`` (from :func:`symbolic_shapes`) at the symbol ``values``; None if it cannot."""
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
            continue
        try:
            v = d.xreplace(values)
            out.append(int(v))
        except (TypeError, ValueError, AttributeError):
            return None
    return tuple(out)


def _sizes_from_symbols(gm: torch.fx.GraphModule) -> None:
    """Replace ``x.size()`` / ``x.size(d)`` on a tensor by the size placeholders it equals.

    Such a node reads a tensor only for its shape; written with the placeholders it is
    a size node like any other, which every stage recomputes. A dimension that is no
    single symbol (``2 * s27``) is left alone (the capture then falls back to static).
    """
    import sympy

    by_symbol = {_expr(n.meta["example_value"]): n for n in gm.graph.nodes
                 if n.op == "placeholder" and isinstance(n.meta.get("example_value"),
                                                         torch.SymInt)}

    def term(size: Any) -> Any:
        expr = size if isinstance(size, int) else _expr(size)
        if isinstance(expr, (int, sympy.Integer)):
            return int(expr)
        if expr in by_symbol:
            return by_symbol[expr]
        raise KeyError(expr)

    for node in list(gm.graph.nodes):
        if not (node.op == "call_method" and node.target == "size" and node.args
                and isinstance(node.args[0], torch.fx.Node)):
            continue
        value = node.meta.get("example_value")
        try:
            if isinstance(value, torch.Size):
                dims = [term(d) for d in value]
                with gm.graph.inserting_before(node):
                    new = gm.graph.call_function(torch.Size, (dims,))
                new.meta["example_value"] = value
            elif isinstance(value, (int, torch.SymInt)):
                new = term(value)
            else:
                continue
        except KeyError:
            continue
        _replace(gm, node, new)


def _replace(gm: torch.fx.GraphModule, node: torch.fx.Node, new: Any) -> None:
    """Make every user of ``node`` read ``new`` (a node, or a number put in as a constant),
    and erase ``node``."""
    if isinstance(new, torch.fx.Node):
        node.replace_all_uses_with(new)
    else:
        for user in list(node.users):
            user.args = pytree.tree_map(lambda a: new if a is node else a, user.args)
            user.kwargs = pytree.tree_map(lambda a: new if a is node else a, user.kwargs)
    gm.graph.erase_node(node)


def _expr(size: torch.SymInt) -> Any:
    """A symbolic size's expression after the guards' replacements (a number once fixed)."""
    node = size.node
    try:
        return node.shape_env.replace(node.expr)
    except Exception:  # noqa: BLE001 - no shape environment: the expression as it is
        return node.expr


def _bound(value: Any) -> int | None:
    """A range's bound as an int; None for an infinite one."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def size_values(sizes: dict[str, tuple[str, int]], named: dict[str, Any]) -> dict[str, int]:
    """Each size placeholder's value on the inputs ``named`` (by input name)."""
    return {k: int(named[inp].shape[d]) for k, (inp, d) in sizes.items()}


def batch_check(shapes: Shapes | None, microbatches: int, replicas: int, batch_dim: Any,
                replicated: tuple[str, ...] = (), unit: int = 1) -> Any:
    """``check(named, targets)``: raise in the caller, before any rank starts a step, for a
    batch whose micro-batches (each replica's share of one; cut in ``unit`` rows) the graph
    does not take."""
    from orgel.batching import batch_rows, dim_of, micro_sizes, share, split_microbatches

    def check(named: dict[str, Any], targets: Any) -> None:
        parts = split_microbatches(named, targets, microbatches, batch_dim, replicated, unit)
        # a smaller last batch's two sizes: the first micro-batch's first share, the last's last
        for (mb, mb_targets), replica in ((parts[0], 0), (parts[-1], replicas - 1)):
            if replicas > 1:
                rows = batch_rows(mb, mb_targets, batch_dim, replicated)
                mb = {k: v if k in replicated else share(v, replica, replicas,
                                                         dim_of(batch_dim, k), rows)
                      for k, v in mb.items()}
            if shapes is None:
                continue
            try:
                shapes.check(mb, "micro-batch" if replicas == 1 else "replica's micro-batch")
            except ShapeError as exc:
                sizes = micro_sizes(batch_rows(named, targets, batch_dim, replicated),
                                    microbatches * replicas)
                if len(set(sizes)) == 1:
                    raise
                what = "micro-batches" if replicas == 1 else "replicas' micro-batches"
                raise ShapeError(
                    f"{exc} (this batch does not divide into the {len(sizes)} {what}: "
                    f"they take {', '.join(map(str, sizes))} rows; a DataLoader's smaller last "
                    "batch: DataLoader(..., drop_last=True), or a batch size whose last batch "
                    "gives every micro-batch the rows the model needs)") from None

    return check
