"""Compiled stages: each stage's forward and backward compiled by Inductor, the backward in
two halves for the schedules that split it.

A stage runs through :class:`CompiledStage` when the pipeline is built with
``compile=True``. Its module (an fx graph) is called as one function of its
parameters, buffers and inputs; AOTAutograd traces the joint forward and backward of
that function and partitions it into a forward and a backward graph with the min-cut
partitioner (what ``torch.compile`` does for a whole model). orgel then partitions the
backward graph once more, by what each output needs:

- ``I``, the input half: every node that the stage inputs' gradients need. It also
  returns the values that the weight half reads from it (the *frontier*).
- ``W``, the weight half: the nodes only the parameters' gradients need, run later
  from the frontier.

Each of the three graphs (forward, ``I``, ``W``; and the whole backward, for ``B``)
is compiled by Inductor's compiler for traced graphs (``compile_fx_inner``, what
``torch.compile`` calls for each graph AOTAutograd partitions; the joint graph is traced
with Inductor's decompositions, as ``torch.compile`` traces it). Nothing wraps the
compiled code a second time: on a GPU a step of a small batch waits on the host's
launches, and every layer of Python per call shows (docs/gpu.md). The executor keeps its
autograd protocol: the stage is one autograd node. A full backward (``B``) runs the
whole backward graph. Inside :func:`split_backward` (the executor's ``I`` action), the
node runs ``I`` instead and returns no parameter gradients; the ``W`` closures it
leaves behind run at the ``W`` action and add to the parameters' ``.grad``, as autograd
would.

A DTensor weight (tensor parallelism) enters the compiled function as its local part and
is made a DTensor again inside it, so AOTAutograd sees plain tensors in and out (the
collectives are in the graphs): the input half leaves such a weight without a gradient
as it does any other, and the weight half adds the local gradient back as a DTensor.

A stage that holds exchanges with the calling process (a forward with graph breaks,
:mod:`orgel.graph.glue`) runs through :class:`SegmentedStage`: its graph cut at each
exchange, each piece between them a :class:`CompiledStage` over the stage's weights, the
exchanges eager between them (they send and receive).

Graphs are compiled once per stage and input signature (dtypes, grad mode, and the sizes:
static at first, symbolic in the sizes that changed once a call of other sizes comes, so a
third sequence length compiles nothing; :mod:`orgel.runtime.compiled_shapes`) and cached;
:attr:`CompiledStage.compile_s` adds up the compile time. Random draws (dropout) use
PyTorch's generator, not Inductor's (``fallback_random``), so a compiled stage draws what
the eager one draws on the same stream, and a recompute replays it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx

from orgel.graph.measure import AUTOCAST_ENTER, AUTOCAST_EXIT
from orgel.runtime import compiled_shapes as shapes
from orgel.runtime.compiled_recompute import recompute_tags, tagged_call
from orgel.runtime.compiled_shapes import Guards
from orgel.runtime.partition import partition_backward
from orgel.runtime.sharding import like_param, own_part


class _Split:
    """The closures of the weight halves that the backward in progress leaves, or None.

    Process-wide, not per thread: on CUDA the autograd engine runs a backward on a device
    thread of its own, which would not see the caller's thread-local state (a rank runs one
    backward at a time)."""

    pending: list[Callable[[], None]] | None = None


_split = _Split()


@contextmanager
def split_backward() -> Iterator[list[Callable[[], None]]]:
    """Inside: compiled stages' backwards compute input gradients only; the list filled
    holds one closure per stage backward that adds its parameters' gradients later."""
    pending: list[Callable[[], None]] = []
    previous = _split.pending
    _split.pending = pending
    try:
        yield pending
    finally:
        _split.pending = previous


def compiled_input_backward(roots: list[torch.Tensor], grads: list[torch.Tensor | None],
                            leaves: list[torch.Tensor]
                            ) -> tuple[list[torch.Tensor | None], Callable[[], None] | None]:
    """``I`` of a compiled stage: the leaves' gradients now, and the ``W`` to run later.

    Where no leaf takes a gradient (the first stage), ``I`` computes nothing and ``W`` is
    the whole backward."""
    if not roots:
        return [None] * len(leaves), None
    if not leaves:
        def whole() -> None:
            torch.autograd.backward(roots, grads)
        return [], whole
    with split_backward() as pending:
        got = torch.autograd.grad(roots, leaves, grads, allow_unused=True)

    def weights() -> None:
        for work in pending:
            work()
    return list(got), weights


class _Compiled:
    """The forward and backward of one input signature, compiled; the backward splits
    when :func:`split_backward` is on. With ``guards`` the graphs are symbolic in some
    sizes (:mod:`orgel.runtime.compiled_shapes`), else static; each is compiled at its
    first call."""

    def __init__(self, owner: CompiledStage, fn: Callable[..., Any],
                 state: int, flat: list[int], guards: Guards | None = None) -> None:
        import torch._inductor.lowering  # noqa: F401 - its decompositions call into it
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        self.owner = owner
        self.flat = flat  # the positions of the call's arguments that ``fn`` takes
        self.guards = guards
        self.weights = 0  # set per call: how many leading arguments are parameters

        def graph(gm: torch.fx.GraphModule, example: list[Any]) -> shapes.Graph:
            return shapes.Graph(gm, None if guards is None else example, owner._counting)

        def fw_compiler(gm: torch.fx.GraphModule, example: Any) -> Callable[..., Any]:
            self.owner.saved_bytes.append(_saved_bytes(gm))
            forward = graph(gm, list(example))
            if guards is not None:  # (see shapes.Graph.compile)
                forward.compile()
            return forward

        def bw_compiler(gm: torch.fx.GraphModule, example: Any) -> Callable[..., Any]:
            full = graph(gm, list(example))
            i_gm, w_gm, count = partition_backward(gm, self.weights)
            i_fn = graph(i_gm, list(example))
            w_fn = graph(w_gm, [n.meta.get("val") for n in w_gm.graph.nodes
                                if n.op == "placeholder"])
            weights = self.weights

            def backward(grads: list[Any]) -> Any:  # boxed: the list is ours to clear
                pending = _split.pending
                args = list(grads)
                grads.clear()
                if pending is None:
                    return _apart(full(args), weights)
                result = i_fn(args)
                inputs, frontier = list(result[:count]), list(result[count:])
                params = self.owner._params_now

                def weight_half() -> None:
                    with torch.no_grad():  # the frontier may hold parameters themselves
                        _accumulate(params, _apart(w_fn(frontier), weights))

                pending.append(weight_half)
                return [None] * weights + inputs

            backward._boxed_call = True  # type: ignore[attr-defined]
            return backward

        self.fn = aot_function(fn, fw_compiler=fw_compiler,  # type: ignore[arg-type]
                               bw_compiler=bw_compiler,  # type: ignore[arg-type]
                               partition_fn=min_cut_rematerialization_partition,
                               decompositions=select_decomp_table(),
                               dynamic=guards is not None, num_params_buffers=state)


def _autocast() -> tuple[Any, ...]:
    """The autocast in force (a graph traced under one has its casts in it)."""
    return tuple(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
                 for d in ("cpu", "cuda"))


def _apart(grads: Any, weights: int) -> list[Any]:
    """``grads`` with each of the first ``weights`` (parameters' gradients) that shares its
    storage with another output cloned. Inductor may return one parameter's gradient as a
    view of another's (a ViT's class token and position embedding on one-row
    micro-batches), and accumulating the next micro-batch into one would add it to both."""
    out = list(grads)
    ptrs = [g.untyped_storage().data_ptr() if isinstance(g, torch.Tensor) and g.numel()
            else None for g in out]
    shared = Counter(p for p in ptrs if p is not None)
    for k, ptr in enumerate(ptrs[:weights]):
        if ptr is not None and shared[ptr] > 1:
            shared[ptr] -= 1
            out[k] = out[k].clone()
    return out


def _accumulate(params: list[torch.Tensor], grads: Any) -> None:
    """Add ``grads`` to the parameters' ``.grad``, as autograd's AccumulateGrad does (a
    DTensor weight's gradient comes as its local part)."""
    for p, g in zip(params, grads, strict=True):
        if g is None or not p.requires_grad:
            continue
        g = like_param(p, g.detach())
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


class CompiledStage:
    """Calls ``module`` (a stage's fx graph) through compiled graphs; see the module doc.

    The parameters and buffers are read off ``module`` at every call, so loading a state
    dict, an optimizer step or a recompute's swapped buffers are seen."""

    def __init__(self, module: torch.nn.Module, recompute: bool | str = False,
                 layers: Sequence[tuple[str | None, list[str]]] = (),
                 weights_of: torch.nn.Module | None = None) -> None:
        self.module = module
        #: where the weights are read, by their names in ``module`` (a piece of a
        #: :class:`SegmentedStage`: the stage, whose tensors FSDP2 swaps, not the piece's)
        self.weights_of = module if weights_of is None else weights_of
        #: the partitioner's tags for ``recompute`` ``"layer"``/``"selective"``, None: the
        #: min-cut partitioner's own choice (:mod:`orgel.runtime.compiled_recompute`)
        self.tags = recompute_tags(module, recompute, layers)
        #: bytes the compiled forwards keep for their backward, by input signature
        self.saved_bytes: list[int] = []
        self.compile_s = 0.0  # seconds spent compiling, all signatures together
        self._cache: dict[Any, _Compiled] = {}
        self._params_now: list[torch.Tensor] = []
        #: (qualified name, the owner's parameter or buffer table, attribute), for _state
        self._slots: list[tuple[str, dict[str, Any], str]] | None = None
        self._weights = 0
        #: by a call's kind (:func:`~orgel.runtime.compiled_shapes.sizeless_key`): the sizes
        #: of its first call, the symbolic graphs compiled, whether only static ones do
        self._first: dict[Any, tuple[Any, ...]] = {}
        self._symbolic: dict[Any, list[_Compiled]] = {}
        self._static_only: set[Any] = set()
        self._depth = 0

    @contextmanager
    def _counting(self) -> Iterator[None]:
        """Inside, time adds to :attr:`compile_s` (once, where such blocks nest)."""
        from orgel.graph.dynamo import dynamo_settings

        self._depth += 1
        start = time.perf_counter()
        try:
            with dynamo_settings():  # torch 2.11 fails to log the compile's config otherwise
                yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.compile_s += time.perf_counter() - start

    def _state(self) -> tuple[list[str], list[torch.Tensor], int]:
        """The module's parameters, then its buffers: their names, the tensors, how many
        are parameters. Where each lives (the submodule, the attribute) is found once; the
        tensors are read afresh at every call (FSDP2's whole weights, a state dict loaded
        with ``assign=True``, a recompute's swapped buffers), without walking every
        submodule at every call (on a GPU, host time the step waits for)."""
        if self._slots is None:
            slots = []
            for table, named in (("_parameters", self.module.named_parameters()),
                                 ("_buffers", self.module.named_buffers())):
                for name, _ in named:
                    owner, _, attr = name.rpartition(".")
                    slots.append((name, getattr(self.weights_of.get_submodule(owner), table),
                                  attr))
                if table == "_parameters":
                    self._weights = len(slots)
            self._slots = slots
        found = [table.get(attr) for _, table, attr in self._slots]
        tensors = [t for t in found if t is not None]
        if len(tensors) < len(found):  # a slot emptied or gone: find them again
            self._slots = None
            return self._state()
        return [name for name, _, _ in self._slots], tensors, self._weights

    def __call__(self, *args: Any) -> Any:
        unshard = getattr(self.module, "unshard", None)
        if unshard is not None:  # FSDP2: its forward hook would gather; the weights whole
            unshard()  # are the module's parameters until the step's reduce reshards them
        names, tensors, weights = self._state()
        head = (self.module.training, torch.is_grad_enabled(), _autocast(), tuple(names),
                tuple(shapes.exact_key(t) for t in tensors))
        key = (head, tuple(shapes.exact_key(a) for a in args))
        compiled = self._cache.get(key)
        if compiled is not None:
            return self._run(compiled, tensors, weights, args)
        sizeless = (head, tuple(shapes.sizeless_key(a) for a in args))
        compiled, new = self._compiled_for(sizeless, names, tensors, args)
        self._cache[key] = compiled
        if not new:  # symbolic graphs compiled before serve these sizes
            return self._run(compiled, tensors, weights, args)
        with self._counting():  # the first call: AOTAutograd's trace, Inductor's compiles
            if compiled.guards is None:
                return self._run(compiled, tensors, weights, args)
            try:
                with compiled.guards.tracing(args):
                    return self._run(compiled, tensors, weights, args)
            except Exception:  # a trace the symbols defeat: static graphs, these sizes
                self._symbolic[sizeless].remove(compiled)
                self._static_only.add(sizeless)
                compiled = self._cache[key] = self._compile(names, tensors, args, None)
                return self._run(compiled, tensors, weights, args)

    def _run(self, compiled: _Compiled, tensors: list[torch.Tensor], weights: int,
             args: tuple[Any, ...]) -> Any:
        compiled.weights = weights
        self._params_now = tensors[:weights]
        return compiled.fn(*(own_part(t) for t in tensors), *(args[k] for k in compiled.flat))

    def _compiled_for(self, sizeless: Any, names: list[str], tensors: list[torch.Tensor],
                      args: tuple[Any, ...]) -> tuple[_Compiled, bool]:
        """The graphs for a call of new sizes (see :mod:`orgel.runtime.compiled_shapes`)
        and whether they are new: symbolic ones compiled before where their guards hold;
        new symbolic ones where a call of the same kind but other sizes came before; else
        new static ones."""
        for earlier in self._symbolic.get(sizeless, []):
            if earlier.guards is not None and earlier.guards.serve(args):
                return earlier, False
        first = self._first.setdefault(sizeless, shapes.sizes_of(args))
        symbolic = None if sizeless in self._static_only else shapes.Symbolic.between(first, args)
        if symbolic is None:
            return self._compile(names, tensors, args, None), True
        compiled = self._compile(names, tensors, args, Guards(symbolic, args))
        self._symbolic.setdefault(sizeless, []).append(compiled)
        return compiled, True

    def _compile(self, names: list[str], tensors: list[torch.Tensor], args: tuple[Any, ...],
                 guards: Guards | None) -> _Compiled:
        """The function of the stage's weights and ``args`` that AOTAutograd traces, and its
        graphs (symbolic in ``guards``' sizes, or static)."""
        module, count = self.module, len(args)
        flat = (guards.symbolic.flat(args) if guards is not None
                else [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)])
        constants = {k: a for k, a in enumerate(args) if k not in flat}

        def fn(*values: Any) -> Any:
            # a DTensor weight (tensor parallelism) enters as its local part and is made
            # a DTensor again here: AOTAutograd then sees plain tensors in and out, so
            # the input half can leave it without a gradient, as any other weight
            state = {n: like_param(like, t) for n, like, t in
                     zip(names, tensors, values[:len(names)], strict=True)}
            # not the first call's ``args``: a closure over them would keep that
            # micro-batch's inputs alive as long as the stage
            call_args: list[Any] = [None] * count
            for k, t in zip(flat, values[len(names):], strict=True):
                call_args[k] = t
            for k, v in constants.items():
                call_args[k] = v
            if guards is not None:
                guards.record(call_args)
            if self.tags is None or not isinstance(module, torch.fx.GraphModule):
                return torch.func.functional_call(module, state, tuple(call_args))
            return tagged_call(module, state, call_args, self.tags)

        return _Compiled(self, fn, len(tensors), flat, guards)


class SegmentedStage:
    """A stage whose graph holds exchanges with a controller (a forward of several graphs,
    :mod:`orgel.graph.glue`): the graph cut at each exchange, the pieces between them run
    through :class:`CompiledStage` and the exchanges eagerly between them (they send and
    receive: AOTAutograd cannot trace them), as are the entry and exit of an autocast
    region around them (the pieces are traced under the autocast they run in). Each piece
    is a graph of its own over the stage's weights (read as the stage's attributes, so the
    weight half of a split backward adds to the stage's parameters) and one autograd node
    with its own input and weight halves, so ``B``, ``I`` and ``W`` run as for a stage of
    one piece; the exchanges' backwards run between them, in autograd's order.
    """

    def __init__(self, module: torch.fx.GraphModule, recompute: bool | str = False,
                 layers: Sequence[tuple[str | None, list[str]]] = ()) -> None:
        self.module = module
        graph = module.graph
        self.inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
        self.output = graph.output_node()
        #: in order: a compiled piece (its runner, its inputs' and outputs' node names), or
        #: an exchange's node (and the items taken from what it returns) run as it is
        self.steps: list[tuple[CompiledStage | None, list[str], list[str], torch.fx.Node]] = []
        self.pieces: list[CompiledStage] = []
        run: list[torch.fx.Node] = []
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            # an autocast region's entry and exit (around all the graphs of a forward of
            # several) run eagerly too: a piece cannot return the region's context
            if is_exchange(node) or node.target in (AUTOCAST_ENTER, AUTOCAST_EXIT) or (
                    node.op == "call_function" and node.args
                    and isinstance(node.args[0], torch.fx.Node) and is_exchange(node.args[0])):
                self._piece(module, run, recompute, layers)
                run = []
                self.steps.append((None, [], [], node))
            else:
                run.append(node)
        self._piece(module, run, recompute, layers)

    def _piece(self, module: torch.fx.GraphModule, nodes: list[torch.fx.Node],
               recompute: bool | str, layers: Sequence[tuple[str | None, list[str]]]) -> None:
        if not nodes:
            return
        inside = set(nodes)
        piece = torch.fx.Graph()
        piece.placeholder("piece_anchor")  # unused: see __call__
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs: list[str] = []

        def arg(n: torch.fx.Node) -> torch.fx.Node:
            if n not in env:
                if n.op == "get_attr":  # the stage's weight, read by the piece itself
                    env[n] = piece.get_attr(str(n.target))
                else:
                    env[n] = piece.placeholder(n.name)
                    inputs.append(n.name)
            return env[n]

        for node in nodes:
            env[node] = piece.node_copy(node, arg)
        outputs = [n.name for n in nodes if any(u not in inside for u in n.users)]
        by_name = {n.name: n for n in nodes}
        piece.output(tuple(env[by_name[n]] for n in outputs))
        names = {n.name for n in nodes}
        kept = [(layer, [n for n in run if n in names]) for layer, run in layers]
        runner = CompiledStage(torch.fx.GraphModule(module, piece), recompute, kept, module)
        self.pieces.append(runner)
        self.steps.append((runner, inputs, outputs, nodes[-1]))

    @property
    def compile_s(self) -> float:
        return sum(piece.compile_s for piece in self.pieces)

    @property
    def saved_bytes(self) -> list[int]:
        return [b for piece in self.pieces for b in piece.saved_bytes]

    def __call__(self, *args: Any) -> Any:
        unshard = getattr(self.module, "unshard", None)
        if unshard is not None:  # FSDP2: the pieces read the stage's gathered weights
            unshard()
        from orgel.graph.glue import side_leaf

        env: dict[str, Any] = dict(zip(self.inputs, args, strict=True))
        for runner, inputs, outputs, node in self.steps:
            if runner is not None:
                # a leaf of the split backward's I for every piece (the exchanges' side
                # leaves): a piece whose inputs carry no gradient (it reads only the
                # controller's values and weights) lies on no path from the stage's outputs
                # to its inputs, and I would leave its weight half out
                anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())
                if anchor.requires_grad:
                    side_leaf(anchor)
                env.update(zip(outputs, runner(anchor, *(env[n] for n in inputs)),
                               strict=True))
                continue
            a, kw = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
            env[node.name] = node.target(*a, **kw)  # type: ignore[operator]
        return torch.fx.node.map_arg(self.output.args[0], lambda n: env[n.name])


def is_exchange(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls :func:`orgel.graph.glue.exchange` (the calling process's)."""
    from orgel.graph.glue import exchange

    return node.op == "call_function" and node.target is exchange


def compiled_stage(module: torch.nn.Module, recompute: bool | str = False,
                   layers: Sequence[tuple[str | None, list[str]]] = ()
                   ) -> CompiledStage | SegmentedStage:
    """The compiled runner of stage ``module``: cut at its exchanges where it holds any."""
    if isinstance(module, torch.fx.GraphModule) and any(
            is_exchange(n) for n in module.graph.nodes):
        return SegmentedStage(module, recompute, layers)
    return CompiledStage(module, recompute, layers)


def _saved_bytes(forward: torch.fx.GraphModule) -> int:
    """The bytes of every tensor a compiled forward returns (its outputs and what it saves
    for the backward)."""
    total = 0
    for value in forward.graph.output_node().args[0]:  # type: ignore[union-attr]
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if isinstance(meta, torch.Tensor):
            total += meta.numel() * meta.element_size()
    return total
