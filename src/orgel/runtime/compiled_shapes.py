"""The sizes a compiled stage's graphs take (:mod:`orgel.runtime.compiled`): which of a
call's sizes are symbolic, and when graphs compiled for other sizes serve a call.

A stage compiles first for the sizes of its first call, statically (Inductor's own
kernels for those sizes). When a call comes whose arguments differ from a compiled one's
in sizes only (a new sequence length, a smaller last batch), the stage compiles once more
with the sizes that differed symbolic: each tensor dimension and int argument whose value
changed between the two calls. Parameters, buffers and the sizes that did not change
stay static. This is ``torch.compile``'s "automatic dynamic shapes", for orgel's stages.

AOTAutograd traces the symbolic graphs under a shape environment of the stage's own,
which records every assumption the trace made about the symbols (guards: an equality
between two sizes, a size at least 2, a size the code fixes). A later call whose sizes
satisfy those guards, and whose static parts are the compiled call's, runs the symbolic
graphs without compiling; any other call compiles statically for its own sizes. Each
graph (the forward, the backward, its input and weight halves) is compiled at its first
call (:class:`Graph`), so a schedule that never splits the backward compiles no halves;
one that Inductor cannot compile symbolically is compiled for each call's sizes instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

#: Inductor options for every stage graph: draws from torch's generator (exact dropout)
INDUCTOR_OPTIONS: dict[str, Any] = {"fallback_random": True}


def static_context() -> Any:
    """A tracing context whose fake tensors keep the arguments' sizes: under it Inductor's
    FX graph cache serves a graph compiled before, here or in an earlier process (the cache
    keys on a shape environment, which only a tracing context lends; without one every
    stage graph was compiled afresh, 3-6 s for a tiny GPT stage's forward and backward)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return tracing(TracingContext(FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(),
                                                 static_shapes=True)))


def static_graph(gm: torch.fx.GraphModule, args: Sequence[Any]) -> torch.fx.GraphModule:
    """``gm``, a graph of a symbolic trace, traced again for the sizes of ``args``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(gm, tracing_mode="fake")(*args)  # type: ignore[no-any-return]


def exact_key(value: Any) -> Any:
    """What a compiled graph fixes about ``value``: a tensor's shape, strides, dtype,
    device and whether it takes a gradient; any other argument's value."""
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), tuple(value.stride()), value.dtype, value.device,
                value.requires_grad)
    return ("v", value)


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sizeless_key(value: Any) -> Any:
    """:func:`exact_key` without the sizes: what two calls must share for one to be served
    by graphs symbolic in the sizes where they differ."""
    if isinstance(value, torch.Tensor):
        return ("t", value.dim(), value.dtype, value.device, value.requires_grad,
                value.is_contiguous())
    if _is_size(value):
        return ("i",)
    return ("v", value)


def sizes_of(args: Sequence[Any]) -> tuple[Any, ...]:
    """The sizes of a call's arguments (a tensor's shape, an int), kept to tell which
    differ at a later call (not the tensors: they would stay alive)."""
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a if _is_size(a) else None
                 for a in args)


@dataclass(frozen=True)
class Symbolic:
    """Which sizes of a call are symbolic: for each argument, the dimensions of a tensor
    (a tuple, maybe empty), True for an int argument, False for a static one."""

    parts: tuple[tuple[int, ...] | bool, ...]

    @classmethod
    def between(cls, before: tuple[Any, ...], args: Sequence[Any]) -> Symbolic | None:
        """The sizes that differ between an earlier call's :func:`sizes_of` and ``args``
        (of the same :func:`sizeless_key`); None where none does or a tensor whose sizes
        differ is not contiguous (its strides would be symbols of their own)."""
        parts: list[tuple[int, ...] | bool] = []
        for old, arg in zip(before, args, strict=True):
            if isinstance(arg, torch.Tensor):
                dims = tuple(d for d, (a, b) in enumerate(zip(old, arg.shape, strict=True))
                             if a != b)
                if dims and not arg.is_contiguous():
                    return None
                parts.append(dims)
            else:
                parts.append(_is_size(arg) and arg != old)
        if not any(parts):
            return None
        return cls(tuple(parts))

    def flat(self, args: Sequence[Any]) -> list[int]:
        """The positions of the arguments the compiled function takes (the tensors and the
        symbolic ints); the others are constants of its graphs."""
        return [k for k, (a, p) in enumerate(zip(args, self.parts, strict=True))
                if isinstance(a, torch.Tensor) or p is True]

    def sizes(self, args: Sequence[Any]) -> list[Any]:
        """The symbolic sizes' values in ``args`` (ints at a call; the symbols themselves
        where ``args`` are the traced function's), in one order."""
        out: list[Any] = []
        for a, p in zip(args, self.parts, strict=True):
            if isinstance(a, torch.Tensor) and isinstance(p, tuple):
                out.extend(a.shape[d] for d in p)
            elif p is True:
                out.append(a)
        return out

    def static(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """``args``' :func:`exact_key` with the symbolic sizes left out: what a call must
        share with the compiled one (the static dimensions, the other values)."""
        out: list[Any] = []
        for a, p in zip(args, self.parts, strict=True):
            if isinstance(a, torch.Tensor):
                dims = p if isinstance(p, tuple) else ()
                shape = tuple(None if d in dims else n for d, n in enumerate(a.shape))
                strides = None if dims else a.stride()  # (symbolic ones: contiguous)
                out.append(("t", shape, strides, a.dtype, a.device, a.requires_grad))
            else:
                out.append(None if p is True else exact_key(a))
        return tuple(out)


class Guards:
    """The shape environment a symbolic compile traced under, and the check of its guards
    on a later call's sizes."""

    def __init__(self, symbolic: Symbolic, args: Sequence[Any]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.symbolic = symbolic
        self.pattern = symbolic.static(args)
        # no duck sizing: two sizes equal at this call (4 rows of 4 tokens) stay two symbols
        # unless the code relates them (then a guard says so)
        self.shape_env = ShapeEnv(duck_shape=False)
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env)
        #: the symbols, in :meth:`Symbolic.sizes`' order, recorded when the function is traced
        self.placeholders: list[Any] | None = None
        self._code: tuple[int, str | None] | None = None

    @contextmanager
    def tracing(self, args: Sequence[Any]) -> Iterator[None]:
        """Inside: AOTAutograd traces with this shape environment, each tensor argument's
        symbolic dimensions made symbols (the rest static)."""
        from torch._dynamo.source import LocalSource
        from torch._guards import TracingContext, tracing
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatefulSymbolicContext

        context = TracingContext(self.fake_mode)
        for k, (a, p) in enumerate(zip(args, self.symbolic.parts, strict=True)):
            if isinstance(a, torch.Tensor):
                dims = p if isinstance(p, tuple) else ()
                context.tensor_to_context[a] = StatefulSymbolicContext(
                    dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC
                                   for d in range(a.dim())],
                    constraint_sizes=[None] * a.dim(), tensor_source=LocalSource(f"arg{k}"))
        with tracing(context):
            yield

    def record(self, traced_args: Sequence[Any]) -> None:
        """Keep the symbols of the traced function's arguments (its first trace)."""
        if self.placeholders is None:
            self.placeholders = self.symbolic.sizes(traced_args)

    def serve(self, args: Sequence[Any]) -> bool:
        """Whether the symbolic graphs hold for ``args``: the same static parts, and every
        guard the trace recorded true of their sizes."""
        if self.placeholders is None or self.symbolic.static(args) != self.pattern:
            return False
        guards = len(self.shape_env.guards)
        if self._code is None or self._code[0] != guards:  # a backward compile may add some
            self._code = (guards,
                          self.shape_env.produce_guards_expression(self.placeholders))
        code = self._code[1]
        return code is None or bool(self.shape_env.evaluate_guards_expression(
            code, self.symbolic.sizes(args)))


class Graph:
    """``gm`` compiled by Inductor at its first call, each compile inside ``counting()``:
    for ``example`` (the fake inputs of a symbolic trace, under the tracing context in
    force when it is made), else for the call's sizes. Where Inductor cannot compile the
    symbolic graph (a symbol that only a product of sizes carries: "expected [s2] to have
    been codegen-ed"), the graph is traced again and compiled statically for each call's
    sizes.

    Boxed, as AOTAutograd calls compiled graphs: it takes its arguments as one list and
    empties it, so each input (a saved activation, in a backward) is freed once the
    compiled code has used it for the last time, not when the whole graph returns."""

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule, example: list[Any] | None,
                 counting: Callable[[], Any]) -> None:
        from torch._guards import TracingContext

        self.gm, self.example, self.counting = gm, example, counting
        self.context = None if example is None else TracingContext.try_get()
        self.compiled: Callable[..., Any] | None = None  # the one for every call
        self.by_sizes: dict[Any, Callable[..., Any]] | None = None  # else, per sizes

    def __call__(self, args: list[Any]) -> Any:
        if self.compiled is not None:
            return self.compiled(args)
        if self.by_sizes is None:
            self.compile(args)
            if self.compiled is not None:
                return self.compiled(args)
        by_sizes = self.by_sizes
        assert by_sizes is not None  # the symbolic compile failed: one for these sizes
        key = tuple(exact_key(a) for a in args)
        if key not in by_sizes:
            by_sizes[key] = self._static(static_graph(self.gm, args), args)
        return by_sizes[key](args)

    def compile(self, args: list[Any] | None = None) -> None:
        """Compile now: for ``args``' sizes, or symbolically for the example. A symbolic
        forward is compiled as soon as traced: Inductor records the layouts of what it
        saves (a convolution's output may come channels-last), which AOTAutograd gives the
        backward's example, or the backward would be compiled for other strides."""
        from torch._guards import tracing
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner

        if self.example is None:
            assert args is not None
            self.compiled = self._static(self.gm, args)
            return
        try:
            with self.counting(), config.patch(INDUCTOR_OPTIONS), tracing(self.context):
                self.compiled = compile_fx_inner(self.gm, self.example)
        except Exception:  # noqa: BLE001 - compiled for each call's sizes instead
            self.by_sizes = {}

    def _static(self, gm: torch.fx.GraphModule, args: list[Any]) -> Callable[..., Any]:
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner

        with self.counting(), config.patch(INDUCTOR_OPTIONS), static_context():
            return compile_fx_inner(gm, list(args))  # type: ignore[no-any-return]
