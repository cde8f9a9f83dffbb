"""Assignment of nodes (or blocks) to stages → one fx GraphModule per stage and the stage DAG.

A stage's module takes, by name, the model inputs it reads and the values it
receives, and returns the values later stages need (plus, for the loss stage,
the model's outputs). A value read by several later stages travels straight to
each of them. Parameters keep their original qualified names inside a stage's
module (``transformer.h.0.attn.c_attn.weight``), so ``param_names`` is the
identity map and a tied parameter appears, under one name, in every stage that
reads it. Buffers go with the nodes that read them, so a BatchNorm's running
statistics are updated in place by the stage that runs it.

The stage modules hold the model's own Parameter and buffer objects, not
copies (stages in one process share a tied parameter);
:func:`orgel.split.reference.copy_stages` makes independent copies, as on
separate ranks. Sizes the capture left symbolic (:mod:`orgel.graph.sizes`) are stage
inputs (``StageModule.sizes`` says which input dimension each is), and size
arithmetic is recomputed in every stage that uses it; other sizes are fixed to
the micro-batch the graph was captured on.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from orgel.graph.blocks import BlockGraph, layer_runs
from orgel.graph.measure import AUTOCAST_ENTER, AUTOCAST_EXIT, GRAD_SWITCH
from orgel.graph.opgraph import OpGraph, tuple_of
from orgel.nesting import placeholder
from orgel.schedule.ir import Edge, Plan, Stage, StageGraph, Value
from orgel.split.types import SplitModel, StageModule

Assignment = Sequence[int] | Mapping[Any, int]


class SplitError(ValueError):
    """An assignment of nodes to stages cannot be split; the message names why and where."""


def split_model(graph: OpGraph | BlockGraph, assignment: Assignment) -> SplitModel:
    """Build one module per stage from ``assignment``.

    ``assignment`` maps blocks (a sequence with one stage per block, or a
    mapping ``{block index: stage}``) when ``graph`` is a :class:`BlockGraph`,
    or nodes (a sequence in node order, or ``{node name: stage}``) for an
    :class:`OpGraph`. Stages are numbered from 0 and none may be empty. The
    stages must form a DAG (each stage convex); otherwise :class:`SplitError`
    names a path that leaves a stage and comes back.
    """
    opg, node_stage, stage_blocks = _node_stages(graph, assignment)
    return _build(opg, node_stage, stage_blocks)


def split_plan(graph: OpGraph | BlockGraph, plan: Plan | StageGraph) -> SplitModel:
    """Split by a Plan's stages: each stage lists its ``blocks`` (or its ``nodes``)."""
    stages = plan.stage_graph.stages if isinstance(plan, Plan) else plan.stages
    mapping: dict[Any, int] = {}
    for s, stage in enumerate(stages):
        if stage.blocks and isinstance(graph, BlockGraph):
            mapping.update({b: s for b in stage.blocks})
        elif stage.nodes:
            mapping.update({n: s for n in stage.nodes})
        else:
            raise SplitError(f"plan stage {s} lists neither blocks nor nodes to compute")
    if all(isinstance(k, str) for k in mapping) and isinstance(graph, BlockGraph):
        graph = graph.opgraph
    if all(isinstance(k, str) for k in mapping) and isinstance(graph, OpGraph):
        _check_same_graph(graph, set(mapping))
    return split_model(graph, mapping)


def names_other_nodes(graph: OpGraph, plan: Plan) -> bool:
    """Whether ``plan``'s stages list nodes by name and ``graph`` has other ones (the plan
    was made on another capture: another model, or sizes the model's code specialises on)."""
    named = {n for stage in plan.stage_graph.stages for n in stage.nodes}
    return bool(named) and named != set(graph.nodes)


def _check_same_graph(graph: OpGraph, named: set[str]) -> None:
    """Refuse a plan whose stages name other nodes than ``graph`` has (another model's plan)."""
    missing = [n for n in graph.nodes if n not in named]
    extra = sorted(named - set(graph.nodes))
    if not missing and not extra:
        return
    found = []
    if missing:
        found.append(f"{len(missing)} of its graph's {len(graph.nodes)} nodes are in no stage "
                     f"of the plan (e.g. {missing[:3]})")
    if extra:
        found.append(f"the plan names {len(extra)} nodes the graph lacks (e.g. {extra[:3]})")
    raise SplitError(
        f"the plan does not match this model: {' and '.join(found)}. The plan, or the "
        "checkpoint it came from, was made for another model or other input shapes: plan "
        "again (plan=None, or leave out --plan) or give the plan made for this model")


# -- assignment → node stages --------------------------------------------------------


def _node_stages(
    graph: OpGraph | BlockGraph, assignment: Assignment
) -> tuple[OpGraph, dict[str, int], dict[int, list[int]]]:
    stage_blocks: dict[int, list[int]] = {}
    if isinstance(graph, BlockGraph):
        opg = graph.opgraph
        keys: list[Any] = list(range(len(graph.blocks)))
        what = "block"
    else:
        opg = graph
        keys = list(opg.nodes)
        what = "node"
    if isinstance(assignment, Mapping):
        table = dict(assignment)
    else:
        if len(assignment) != len(keys):
            raise SplitError(
                f"assignment has {len(assignment)} entries but the graph has {len(keys)} "
                f"{what}s; give one stage per {what}"
            )
        table = dict(zip(keys, assignment, strict=True))
    unknown = [k for k in table if k not in set(keys)]
    if unknown:
        raise SplitError(f"assignment names unknown {what}s {unknown[:5]}")
    missing = [k for k in keys if k not in table]
    if missing:
        raise SplitError(
            f"assignment leaves {len(missing)} {what}s without a stage, e.g. {missing[:5]}"
        )
    stages = sorted(set(int(v) for v in table.values()))
    if stages != list(range(len(stages))):
        raise SplitError(
            f"stages must be numbered 0..K-1 with none empty; the assignment uses {stages}"
        )
    if isinstance(graph, BlockGraph):
        node_stage = {}
        for b, s in table.items():
            stage_blocks.setdefault(int(s), []).append(int(b))
            for n in graph.blocks[b].nodes:
                node_stage[n] = int(s)
    else:
        node_stage = {str(k): int(v) for k, v in table.items()}
    # A tuple-valued node cannot be sent: its getitems run where it runs.
    for node in opg.nodes.values():
        if (src := tuple_of(opg, node)) is not None:
            node_stage[node.name] = node_stage[src]
    return opg, node_stage, stage_blocks


def _check_acyclic(opg: OpGraph, node_stage: dict[str, int], num_stages: int) -> list[int]:
    """A topological order of the stages; raise naming a path that leaves a stage and returns."""
    witness: dict[tuple[int, int], tuple[str, str]] = {}
    for node in opg.nodes.values():
        for src in node.inputs:
            if src in node_stage and node_stage[src] != node_stage[node.name]:
                witness.setdefault((node_stage[src], node_stage[node.name]), (src, node.name))
    succ: dict[int, list[int]] = {s: [] for s in range(num_stages)}
    for a, b in witness:
        succ[a].append(b)
    color = dict.fromkeys(range(num_stages), 0)
    stack_path: list[int] = []

    def visit(s: int) -> None:
        color[s] = 1
        stack_path.append(s)
        for t in sorted(succ[s]):
            if color[t] == 1:
                cycle = stack_path[stack_path.index(t):] + [t]
                hops = [witness[(a, b)] for a, b in zip(cycle, cycle[1:], strict=False)]
                path = "; ".join(
                    f"{u} (stage {node_stage[u]}) -> {v} (stage {node_stage[v]})" for u, v in hops
                )
                raise SplitError(
                    f"stage assignment is not convex: a path leaves stage {t} and comes back "
                    f"({' -> '.join(str(c) for c in cycle)}) through {path}; move these nodes "
                    "so that values only flow forward between stages"
                )
            if color[t] == 0:
                visit(t)
        stack_path.pop()
        color[s] = 2

    for s in range(num_stages):
        if color[s] == 0:
            visit(s)
    # The order itself: the lowest-numbered ready stage first, so that stages
    # numbered in a topological order (blocks, chains) keep their own order.
    indegree = {s: 0 for s in range(num_stages)}
    for _, b in witness:
        indegree[b] += 1
    ready = [s for s in range(num_stages) if indegree[s] == 0]
    heapq.heapify(ready)
    stable: list[int] = []
    while ready:
        s = heapq.heappop(ready)
        stable.append(s)
        for t in succ[s]:
            indegree[t] -= 1
            if indegree[t] == 0:
                heapq.heappush(ready, t)
    return stable


# -- building the stage modules ------------------------------------------------------


def _build(
    opg: OpGraph, node_stage: dict[str, int], stage_blocks: dict[int, list[int]]
) -> SplitModel:
    num_stages = max(node_stage.values()) + 1
    order = _check_acyclic(opg, node_stage, num_stages)
    rank_of = {s: i for i, s in enumerate(order)}
    inputs_set = set(opg.model_inputs)
    out_names = opg.outputs
    producers = [node_stage[n] for n in out_names if n in node_stage]
    loss_stage = max(producers, key=lambda s: rank_of[s]) if producers else order[-1]

    # What each stage reads: model inputs (by name) and values from other stages.
    reads: dict[int, dict[str, None]] = {s: {} for s in range(num_stages)}
    for node in opg.nodes.values():
        s = node_stage[node.name]
        for src in node.inputs:
            if src in inputs_set or node_stage[src] != s:
                src_node = opg.nodes.get(src)
                if src_node is not None and src_node.constant is not None:
                    continue  # a size or flag: inlined as a constant where it is read
                if src_node is not None and not src_node.is_tensor:
                    raise SplitError(
                        f"node {node.name} (stage {s}) reads {src} (stage {node_stage[src]}), "
                        f"a {src_node.op} result that is not a tensor; put both in one stage"
                    )
                reads[s][src] = None
    for name in out_names:
        if name in inputs_set or node_stage[name] != loss_stage:
            reads[loss_stage][name] = None
    node_order = {n: i for i, n in enumerate(opg.nodes)}
    sends: dict[int, dict[str, None]] = {s: {} for s in range(num_stages)}
    edge_values: dict[tuple[int, int], list[str]] = {}
    for s in range(num_stages):
        # Every list of values is in node order: stage inputs, outputs and edges agree.
        for name in sorted(reads[s], key=lambda n: node_order.get(n, -1)):
            if name in inputs_set:
                continue
            src_stage = node_stage[name]
            sends[src_stage][name] = None
            edge_values.setdefault((src_stage, s), []).append(name)

    fx_nodes = {n.name: n for n in opg.graph_module.graph.nodes}
    size_reads = _size_reads(opg, fx_nodes, node_stage, num_stages)
    stages: list[StageModule] = []
    holders: dict[str, list[int]] = {}
    for s in range(num_stages):
        model_in = [n for n in opg.model_inputs if n in reads[s]]
        received = sorted((n for n in reads[s] if n not in inputs_set), key=node_order.__getitem__)
        outputs = sorted(sends[s], key=node_order.__getitem__)
        if s == loss_stage:
            outputs += [n for n in out_names if n not in sends[s]]
        names = sorted((n for n, st in node_stage.items() if st == s), key=node_order.__getitem__)
        sizes = [n for n in opg.sizes if n in size_reads[s]]
        module = _stage_module(opg, fx_nodes, names, model_in + sizes + received, outputs)
        pnames = {n: n for n, _ in module.named_parameters()}
        bnames = {n: n for n, _ in module.named_buffers() if n in opg.buffers}
        for n in pnames:
            holders.setdefault(n, []).append(s)
        stages.append(StageModule(
            index=s, module=module, inputs=model_in + sizes + received, outputs=outputs,
            model_inputs=model_in, param_names=pnames, buffer_names=bnames,
            written=[n for n in bnames if n in opg.written],
            sizes={n: opg.sizes[n] for n in sizes},
            layers=layer_runs(names, [opg.nodes[n].module for n in names]),
        ))

    # A buffer the forward updates must live in exactly one stage: a copy read
    # elsewhere would go stale (BatchNorm statistics stay with their BatchNorm).
    for buf in opg.written:
        owners = sorted({s.index for s in stages if buf in s.buffer_names})
        if len(owners) > 1:
            readers = opg.param_users().get(buf, [])
            raise SplitError(
                f"buffer {buf} is updated in place and read by stages {owners} (nodes "
                f"{', '.join(f'{r} (stage {node_stage[r]})' for r in readers)}); assign "
                "these nodes to one stage"
            )

    def nbytes(name: str) -> int:
        return opg.nodes[name].nbytes

    ir_stages = tuple(
        Stage(
            name=f"stage{s}",
            nodes=tuple(sorted((n for n, st in node_stage.items() if st == s),
                               key=node_order.__getitem__)),
            blocks=tuple(sorted(stage_blocks.get(s, []))),
            model_inputs=tuple(stages[s].model_inputs),
            model_outputs=tuple(out_names) if s == loss_stage else (),
        )
        for s in range(num_stages)
    )
    crossing = {n for vals in edge_values.values() for n in vals}
    reached = opg.carries_grad()
    requires_grad = {n: _differentiable(opg, n) and n in reached for n in sorted(crossing)}
    edges = tuple(
        Edge(a, b, tuple(Value(n, nbytes(n), requires_grad[n]) for n in vals))
        for (a, b), vals in sorted(edge_values.items())
    )
    stage_graph = StageGraph(ir_stages, edges)
    stage_graph.check()
    return SplitModel(
        stages=stages, stage_graph=stage_graph, loss_stage=loss_stage,
        output_names=list(out_names), unflatten_outputs=opg.unflatten(list(out_names)),
        model_input_names=list(opg.model_inputs),
        tied=sorted(n for n, ss in holders.items() if len(ss) > 1),
        requires_grad=requires_grad, sizes=dict(opg.sizes), shapes=opg.shapes,
        value_shapes={n: opg.symbolic_shapes[n] for n in crossing if n in opg.symbolic_shapes},
    )


def _size_reads(opg: OpGraph, fx_nodes: dict[str, torch.fx.Node], node_stage: dict[str, int],
                num_stages: int) -> dict[int, set[str]]:
    """The size placeholders each stage reads, directly or through size nodes it recomputes."""
    size_nodes = set(opg.size_nodes)
    below: dict[str, set[str]] = {}

    def sizes_of(n: torch.fx.Node) -> set[str]:
        if n.name in opg.sizes:
            return {n.name}
        if n.name not in size_nodes:
            return set()
        if n.name not in below:
            below[n.name] = set().union(*(sizes_of(a) for a in n.all_input_nodes))
        return below[n.name]

    reads: dict[int, set[str]] = {s: set() for s in range(num_stages)}
    for name, s in node_stage.items():
        for arg in fx_nodes[name].all_input_nodes:
            reads[s] |= sizes_of(arg)
    return reads


def _differentiable(opg: OpGraph, name: str) -> bool:
    node = opg.nodes[name]
    return node.requires_grad and node.dtype is not None and (
        node.dtype.startswith("float") or node.dtype.startswith("bfloat")
        or node.dtype.startswith("complex")
    )


def _attr(opg: OpGraph, qual: str) -> torch.Tensor:
    for table in (opg.params, opg.buffers, opg.constants):
        if qual in table:
            return table[qual]
    raise SplitError(f"the graph reads {qual!r}, which is no parameter, buffer or constant")


def _stage_module(
    opg: OpGraph, fx_nodes: dict[str, torch.fx.Node], names: list[str], inputs: list[str],
    outputs: list[str],
) -> torch.fx.GraphModule:
    """One GraphModule: placeholders ``inputs``, the nodes ``names``, returns ``outputs``."""
    g = torch.fx.Graph()
    env: dict[str, Any] = {n: placeholder(g, n) for n in inputs}
    attrs: dict[str, torch.Tensor] = {}
    # In-place updates (``out += identity``, ``relu(inplace=True)``): a received
    # value is a leaf of its own, so update a copy; a value this stage sends and
    # then updates is sent as it was before the update (later readers were
    # rewired to the update at capture, so they never need the stale value).
    mutators = {name: opg.nodes[name].mutates for name in names if opg.nodes[name].mutates}
    for value in dict.fromkeys(mutators.values()):
        if value in env:
            env[value] = g.call_method("clone", (env[value],))
    first_mutator: dict[str, str] = {}
    for name, value in mutators.items():
        if value in outputs and value not in inputs:
            first_mutator.setdefault(value, name)
    sent: dict[str, Any] = {}

    def lookup(n: torch.fx.Node) -> Any:
        if n.name in env:
            return env[n.name]
        qual = opg.attr_of.get(n.name)
        if qual is not None:
            attrs[qual] = _attr(opg, qual)
            env[n.name] = g.get_attr(qual)
            return env[n.name]
        node = opg.nodes.get(n.name)
        if node is not None and node.constant is not None:
            return node.constant
        if n.name in opg.size_nodes:  # size arithmetic: recomputed here from the sizes
            env[n.name] = g.node_copy(n, lookup)
            return env[n.name]
        raise SplitError(f"value {n.name} is not available in this stage")

    grad = True
    regions: list[tuple[tuple[Any, ...], torch.fx.Node]] = []  # open autocast regions
    for name in names:
        info = opg.nodes[name]
        if tuple(args for args, _ in regions) != info.autocast:
            _enter_regions(g, regions, info.autocast)
        if info.grad_enabled != grad:
            g.call_function(GRAD_SWITCH, (info.grad_enabled,))
            grad = info.grad_enabled
        if info.mutates is not None and first_mutator.get(info.mutates) == name:
            sent[info.mutates] = g.call_method("clone", (env[info.mutates],))
        env[name] = g.node_copy(fx_nodes[name], lookup)
    _enter_regions(g, regions, ())
    if not grad:
        g.call_function(GRAD_SWITCH, (True,))
    g.output(tuple(sent.get(n, env[n]) for n in outputs))
    return torch.fx.GraphModule(attrs, g)


def _enter_regions(g: torch.fx.Graph, regions: list[tuple[tuple[Any, ...], torch.fx.Node]],
                   target: tuple[tuple[Any, ...], ...]) -> None:
    """Exit and enter autocast regions until ``regions`` holds ``target`` (outermost first).

    A stage that starts inside a region the model opened in an earlier stage
    enters it again; one that ends inside a region exits it before returning.
    """
    keep = 0
    while keep < min(len(regions), len(target)) and regions[keep][0] == target[keep]:
        keep += 1
    while len(regions) > keep:
        _, entered = regions.pop()
        g.call_function(AUTOCAST_EXIT, (entered,))
    for args in target[keep:]:
        regions.append((args, g.call_function(AUTOCAST_ENTER, args)))
