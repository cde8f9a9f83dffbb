"""Exactness over the model zoo: every model, 2/3/4 stages, block-aligned and random cuts.

For each model the stages (run with the runtime's boundary protocol, see
``orgel.split.reference``) must give the same loss and gradients as the
unmodified model with gradient accumulation over the same 2 micro-batches:

* loss: bit-exact (the forward runs the same ops in the same order);
* gradients: within ``GRAD_ATOL`` absolute (float32). They are bit-exact
  unless a value feeds several consumers or a parameter is tied: then the
  split sums the gradient parts in a different order than autograd does;
* buffers (BatchNorm running statistics): bit-exact.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from orgel.graph import BlockGraph, GraphBreakError, OpGraph, capture, coarsen
from orgel.split import split_model
from orgel.split.assign import balanced_assignment, random_assignment
from orgel.split.reference import StepResult, compare, copy_stages, reference_step, stages_step
from orgel.workload import Workload, microbatches
from zoo import CAPTURABLE, GRAPH_BREAKING, workload

GRAD_ATOL = 1e-6
MICROBATCHES = 2




@dataclass
class Case:
    w: Workload
    graph: OpGraph
    blocks: BlockGraph
    batches: list
    ref: StepResult


_CASES: dict[str, Case] = {}


def _case(name: str) -> Case:
    """Capture once per model (dynamo compiles are the slow part)."""
    if name not in _CASES:
        w = Workload(*workload(name))
        batches = microbatches(w, MICROBATCHES)
        graph = capture(w.model, batches[0][0])
        ref = reference_step(copy.deepcopy(w.model), batches, w.loss_fn)
        _CASES[name] = Case(w, graph, coarsen(graph, 12), batches, ref)
    return _CASES[name]


def _run(case: Case, graph: OpGraph | BlockGraph, assignment: list[int]) -> dict[str, float]:
    split = split_model(graph, assignment)
    assert split.stage_graph.num_stages == max(assignment) + 1
    got = stages_step(copy_stages(split), case.batches, case.w.loss_fn)
    assert set(got.grads) == set(case.ref.grads)
    assert set(got.buffers) == set(case.graph.buffers)  # every buffer lives in some stage
    diff = compare(case.ref, got)
    assert diff["loss"] == 0.0, diff
    assert diff["grad"] <= GRAD_ATOL, diff
    assert diff["buffer"] == 0.0, diff
    return diff


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name", CAPTURABLE)
def test_stages_reproduce_the_model(name: str, stages: int) -> None:
    case = _case(name)
    _run(case, case.blocks, balanced_assignment(case.blocks, stages))  # block-aligned
    _run(case, case.blocks, random_assignment(case.blocks, stages, seed=stages))
    _run(case, case.graph, random_assignment(case.graph, stages, seed=100 + stages))  # any node


def test_batchnorm_running_stats_move_like_the_model() -> None:
    case = _case("resnet")
    assert any(n.endswith("running_mean") for n in case.graph.buffers)
    split = copy_stages(split_model(case.blocks, balanced_assignment(case.blocks, 3)))
    got = stages_step(split, case.batches, case.w.loss_fn)
    for name, value in got.buffers.items():
        assert torch.equal(value, case.ref.buffers[name]), name
        assert not torch.equal(value, case.w.model.get_buffer(name)), name  # they did move
    owners = [[s.index for s in split.stages if name in s.buffer_names.values()]
              for name in case.graph.buffers]
    assert all(len(o) == 1 for o in owners)  # one stage owns each BatchNorm's statistics


def test_tied_embeddings_are_one_parameter_shared_by_stages() -> None:
    case = _case("tied")
    (canonical, aliases), = case.graph.aliases.items()
    assert len(aliases) == 2 and len(case.graph.param_users()[canonical]) >= 2
    first = list(case.graph.nodes).index(case.graph.param_users()[canonical][0])
    split = split_model(case.graph, [0 if i <= first else 1 for i in range(len(case.graph.nodes))])
    assert split.tied == [canonical]


def test_second_tower_reads_only_its_own_input() -> None:
    case = _case("clip")
    split = split_model(case.blocks, balanced_assignment(case.blocks, 2))
    readers = {m: [s.index for s in split.stages if m in s.model_inputs]
               for m in case.graph.model_inputs}
    assert all(len(r) == 1 for r in readers.values()), readers
    assert set(readers) == set(case.graph.model_inputs)


@pytest.mark.parametrize("name", GRAPH_BREAKING)
def test_graph_break_is_a_clear_error(name: str) -> None:
    w = Workload(*workload(name))
    with pytest.raises(GraphBreakError, match=r"graph break .* at .*\.py:\d+ `.+`.*torch\.where"):
        capture(w.model, w.inputs, several=False)
