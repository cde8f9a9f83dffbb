"""orgel's simulator on torch's hand split: what the time model predicts for each torch schedule.

``benchmarks/auto_vs_hand.py`` measures torch's hand split (``hand_split.cut``) under
torch's own schedules against orgel's plan. To judge orgel's time model by the ratio it
would predict, the hand split is priced on the same block table orgel planned from: each
hand stage starts at the first block that reads one of its parameters, and each torch
schedule is the orgel schedule that runs the same actions in the same order:

* GPipe, 1F1B and interleaved 1F1B: orgel's families of those names (the same orders,
  checked action by action in ``vs_torch_pipelining.py``);
* ZBV: torch's own ``ScheduleZBVZeroBubble`` order, computed by torch for the rank count
  and converted action by action (``vs_torch_pipelining.torch_order_plan``).

Every prediction is :func:`orgel.plan.predict.predict`: the simulator plus the step's end
(the loss all-reduce and the optimizer), as for orgel's own plan.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hand_split import Workload, cut
from torch.distributed.pipelining import schedules as torch_schedules
from vs_torch_pipelining import torch_order_plan

from orgel.flow.capture import capture_microbatch, default_optimizer
from orgel.plan.predict import predict
from orgel.plan.scorer import Scorer
from orgel.plan.templates import Template
from orgel.plan.workload import planning_costs
from orgel.profile.memory import optimizer_factor
from orgel.schedule.families import build_schedule
from orgel.workload import Workload as OrgelWorkload

#: stages per rank of each torch schedule
PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2}


def block_table(work: Workload, ranks: int, m: int) -> tuple[Any, Any]:
    """The block table ``orgel.pipeline`` planned from (the profile cache's, after it ran)
    and the graph it was measured on (:func:`orgel.plan.workload.planning_costs`, with the
    default optimizer's state, as ``orgel.pipeline`` counts it)."""
    workload = OrgelWorkload(work.model, work.inputs, work.targets, work.loss_fn)
    graph = capture_microbatch(workload, m)
    costs = planning_costs(workload, graph, ranks=ranks, microbatches=m,
                           optimizer_factor=optimizer_factor(default_optimizer))
    return costs, graph


def hand_blocks(work: Workload, costs: Any, graph: Any, stages: int) -> list[list[int]]:
    """The blocks of each stage of ``cut(work.pieces, stages)``: a stage starts at the first
    block that reads one of its parameters (the blocks between go with the stage before)."""
    names = {id(p): n for n, p in work.model.named_parameters(remove_duplicate=False)}
    reads = [{graph.attr_of.get(q, q) for n in nodes for q in graph.nodes[n].params}
             if nodes else set() for nodes in costs.nodes]
    starts = [0]
    for stage in cut(work.pieces, stages)[1:]:
        own = {names[id(p)] for p in stage.parameters()}
        first = next((b for b, r in enumerate(reads) if r & own), None)
        if first is None or first <= starts[-1]:
            raise ValueError(f"hand stage {len(starts)} does not map to blocks after "
                             f"block {starts[-1]}")
        starts.append(first)
    ends = [*starts[1:], costs.num_blocks]
    return [list(range(a, b)) for a, b in zip(starts, ends, strict=True)]


def torch_template(name: str, ranks: int, m: int) -> Template:
    """torch's schedule ``name`` as an orgel template (the actions in torch's order)."""
    if name == "zbv":
        stages = 2 * ranks
        ns = SimpleNamespace(pp_group_size=ranks, num_stages=stages, _n_microbatches=m)
        zbv = torch_schedules.ScheduleZBVZeroBubble
        order = {r: zbv._calculate_single_rank_operations(ns, r) for r in range(ranks)}
        chain = build_schedule("interleaved", ranks, m, stages_per_rank=2).stage_graph
        return Template(name, name, {}, torch_order_plan(order, chain, m))
    options = {"stages_per_rank": 2} if name == "interleaved" else {}
    return Template(name, name, options, build_schedule(name, ranks, m, **options))


def predicted_steps(work: Workload, ranks: int, m: int, schedules: list[str],
                    orgel_plan: Any) -> dict[str, float]:
    """Predicted ms per step of torch's hand split under each schedule, and of orgel's plan
    (``"orgel"``), all from one block table."""
    costs, graph = block_table(work, ranks, m)
    scorer = Scorer(costs)
    out: dict[str, float] = {}
    for name in schedules:
        template = torch_template(name, ranks, m)
        blocks = hand_blocks(work, costs, graph, PER_RANK[name] * ranks)
        out[name] = predict(scorer.to_plan(template, blocks), costs).step_time
    out["orgel"] = predict(orgel_plan, costs).step_time
    return out
