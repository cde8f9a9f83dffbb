"""The eval-mode split: a capture of the model in eval mode, cut into the training split's stages.

The training stages are fx graphs captured in train mode: ``dropout(..., training=True)``
and ``batch_norm(..., training=True)`` are baked in, and a forward that branches on
``self.training`` took its training branch. Evaluation therefore runs a second
capture, made with ``model.eval()``, split into the same stages (same index, same
ranks) so that each rank runs its eval stages with the very parameter and buffer
objects its training stages hold (:func:`share_weights`).

Which eval node goes to which stage (:func:`split_like`), in this order:

1. a node that reads parameters or buffers goes where the training split holds
   them (a node of the same name when that stage is one of them, else the
   first of them that is not before its producers);
2. a node whose name is a training node's goes to that node's stage, unless that
   stage comes before one of its producers';
3. any other node follows its producers (the latest of their stages), and one
   that reads only model inputs follows its first consumer.

The stages must come out non-empty and acyclic; otherwise :class:`SplitError`
says that this model's eval-mode forward does not fit the training plan.
"""

from __future__ import annotations

import torch

from orgel.graph.measure import GRAD_SWITCH
from orgel.graph.opgraph import OpGraph
from orgel.split.split import SplitError, split_model
from orgel.split.types import SplitModel


def split_like(graph: OpGraph, train: SplitModel) -> SplitModel:
    """Split ``graph`` (an eval-mode capture) into ``train``'s stages; see the module docstring.

    The stage modules run under ``torch.no_grad()`` only: their grad-mode switches are
    removed (a no-grad region inside the model would otherwise end by turning grad on).
    """
    stages = train.stage_graph.stages
    order = {s: i for i, s in enumerate(train.stage_graph.topological_order())}
    named = {n: s for s, st in enumerate(stages) for n in st.nodes}
    holders: dict[str, set[int]] = {}
    for st in train.stages:
        for name in list(st.param_names.values()) + list(st.buffer_names.values()):
            holders.setdefault(name, set()).add(st.index)
    assignment: dict[str, int] = {}
    waiting: list[str] = []
    for name, node in graph.nodes.items():
        producers = [assignment[i] for i in node.inputs if i in assignment]
        floor = max((order[s] for s in producers), default=-1)
        held = [holders[p] for p in node.params if p in holders]
        if held:
            allowed = set.intersection(*held) or set.union(*held)
            if named.get(name) in allowed:
                assignment[name] = named[name]
            else:
                after = [s for s in allowed if order[s] >= floor]
                assignment[name] = min(after or allowed, key=order.__getitem__)
        elif name in named and order[named[name]] >= floor:
            assignment[name] = named[name]
        elif producers:
            assignment[name] = max(producers, key=order.__getitem__)
        else:
            waiting.append(name)
    users = graph.users()
    for name in reversed(waiting):  # consumers first: a chain of them follows its end
        consumers = [assignment[u] for u in users.get(name, []) if u in assignment]
        assignment[name] = (min(consumers, key=order.__getitem__) if consumers
                            else train.loss_stage)
    used = set(assignment.values())
    empty = [s for s in range(len(stages)) if s not in used]
    if empty:
        raise SplitError(
            f"the model's eval-mode forward has no operation for stage(s) {empty} of the "
            "training plan (they hold only train-mode work, such as dropout): evaluation "
            "cannot run on this plan; give those stages more of the model")
    try:
        split = split_model(graph, assignment)
    except SplitError as exc:
        raise SplitError(f"the model's eval-mode forward cannot be cut into the training "
                         f"plan's stages: {exc}") from None
    if split.loss_stage != train.loss_stage:
        raise SplitError(
            f"the model's eval-mode forward ends in stage {split.loss_stage}, its training "
            f"forward in stage {train.loss_stage}: evaluation cannot run on this plan")
    for stage in split.stages:
        _drop_grad_switches(stage.module)
    return split


def _drop_grad_switches(module: torch.nn.Module) -> None:
    if not isinstance(module, torch.fx.GraphModule):
        return
    switches = [n for n in module.graph.nodes
                if n.op == "call_function" and n.target is GRAD_SWITCH]
    for node in switches:
        module.graph.erase_node(node)
    if switches:
        module.recompile()


def share_weights(evaluation: SplitModel, train: SplitModel, stages: list[int]) -> None:
    """Make the eval stages ``stages`` hold the training stages' own parameters and buffers.

    By original name, stage by stage: evaluation then always reads the current
    trained values, and holds no copy. A tensor only the eval-mode forward reads
    (no training stage holds it: training never changes it) stays the capture's own.
    """
    for s in stages:
        held = _held(train, s)
        stage = evaluation.stages[s]
        for local, original, is_param in _tensor_names(evaluation, s):
            if original not in held:
                continue
            owner, _, leaf = local.rpartition(".")
            holder = stage.module.get_submodule(owner)
            table = holder._parameters if is_param else holder._buffers
            table[leaf] = held[original]  # type: ignore[assignment]


def eval_only(evaluation: SplitModel, train: SplitModel) -> list[str]:
    """The parameters and buffers an eval stage reads that its training stage does not hold."""
    return [original for s in range(len(evaluation.stages))
            for _, original, _ in _tensor_names(evaluation, s) if original not in _held(train, s)]


def _held(train: SplitModel, s: int) -> dict[str, torch.Tensor]:
    own = train.stages[s]
    held: dict[str, torch.Tensor] = {}
    for local, p in own.module.named_parameters():
        held[own.param_names.get(local, local)] = p
    for local, b in own.module.named_buffers():
        held[own.buffer_names.get(local, local)] = b
    return held


def _tensor_names(split: SplitModel, s: int) -> list[tuple[str, str, bool]]:
    """``(local name, original name, is a parameter)`` of stage ``s``'s parameters and buffers."""
    stage = split.stages[s]
    return ([(local, stage.param_names.get(local, local), True)
             for local, _ in stage.module.named_parameters()]
            + [(local, stage.buffer_names.get(local, local), False)
               for local, _ in stage.module.named_buffers()])
