"""Plans the runtime makes on its own: a replicated pipeline for dp, a balanced split."""

from __future__ import annotations

import pytest

from orgel.graph.capture import capture
from orgel.plan.balanced import balanced_plan
from orgel.plan.transforms import replicate
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import PlanError
from orgel.schedule.validate import validate
from orgel.split.assign import balanced_assignment


def test_replicate_gives_every_stage_dp_ranks_and_the_same_actions() -> None:
    plan = replicate(build_schedule("1f1b", 2, 4), 2)
    assert plan.num_ranks == 4
    assert plan.placement == [(0, 2), (1, 3)]
    assert plan.schedule[2] == plan.schedule[0] and plan.schedule[3] == plan.schedule[1]
    assert plan.meta["dp"] == 2
    validate(plan)


def test_balanced_plan_cuts_in_node_order_and_schedules() -> None:
    import torch

    from orgel.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=16, d_model=8, n_layers=4, n_heads=2, seq_len=4))
    graph = capture(model, {"tokens": torch.randint(0, 16, (2, 4))})
    assignment = balanced_assignment(graph, 4)
    stages = list(assignment)
    assert stages == sorted(stages) and set(stages) == {0, 1, 2, 3}
    plan = balanced_plan(graph, ranks=4, microbatches=4, schedule="interleaved", dp=2)
    assert plan.num_stages == 4 and plan.num_ranks == 4
    assert plan.placement == [(0, 2), (1, 3), (0, 2), (1, 3)]
    with pytest.raises(PlanError, match="must divide"):
        balanced_plan(graph, ranks=3, microbatches=4, dp=2)
