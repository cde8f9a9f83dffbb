"""Where a split of a forward of several graphs keeps its exchanges and the controller's
parameters (see :mod:`orgel.graph.glue`)."""

from __future__ import annotations

from typing import Any

from orgel.graph.glue import Glue, exchange


def exchange_stages(split: Any) -> dict[int, int]:
    """For each exchange in ``split`` (by graph call), the index of the stage that holds it."""
    found: dict[int, int] = {}
    for s, stage in enumerate(split.stages):
        graph = getattr(stage.module, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "call_function" and node.target is exchange:
                found[int(node.args[1])] = s
    return found


def home_rank(name: str, plan: Any, split: Any) -> int:
    """The rank that steps parameter ``name`` when the controller computes its gradient.

    A parameter that a stage also reads lives on the lowest rank holding such a
    stage: the controller's gradient is added to that copy's before the tied
    sum. Any other lives on rank 0, as a parameter of no stage.
    """
    ranks = [plan.placement[s][0] for s, st in enumerate(split.stages)
             if name in st.param_names.values()]
    return min(ranks, default=0)


def grad_ranks(name: str, plan: Any, split: Any) -> list[int]:
    """The ranks the controller sends its gradient of parameter ``name`` to: the
    :func:`home_rank`, and where the home stage is FSDP-sharded every replica of it (each
    adds its shard; :meth:`orgel.worker.closure.ClosureEngine._add_controller_grads`)."""
    home = home_rank(name, plan, split)
    for s, st in enumerate(split.stages):
        if (name in st.param_names.values() and plan.placement[s][0] == home
                and plan.sharded(s)):
            return list(plan.placement[s])
    return [home]


def eager_homes(glue: Glue, plan: Any, split: Any) -> dict[str, list[int]]:
    """For each parameter the controller trains (:attr:`Glue.eager`), the ranks that step
    it: its :func:`grad_ranks` (every replica of an FSDP home stage: each steps its shard
    and sends it back)."""
    return {name: grad_ranks(name, plan, split) for name in glue.eager}


def homed_on(rank: int, names: list[str], plan: Any, split: Any) -> list[str]:
    """Of ``names`` (parameters the controller trains), those rank ``rank`` steps: where it is
    one of their :func:`grad_ranks`."""
    return sorted(n for n in names if rank in grad_ranks(n, plan, split))
