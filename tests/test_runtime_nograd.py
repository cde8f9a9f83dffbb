"""Values that carry no gradient (masks, integer ids, tables made from buffers) send none back.

A stage graph's value says whether it carries a gradient (``Value.grad``, from
the split); a gradient message exists only for an edge with at least one value
that does (:func:`orgel.schedule.comm.derive_comm`), for the simulator and the
runtime alike: no send, no receive, no wait. The test model makes a mask and a
position table once, as a decoder does, and every layer reads them; split in
three stages on two ranks, stage 0 sends stage 2 (on the other rank) only the
mask and the table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from orgel.graph import capture
from orgel.schedule import build_schedule
from orgel.schedule.comm import derive_comm
from orgel.schedule.ir import Plan, PlanError, Value
from orgel.sim import simulate
from orgel.sim.compiled import CompiledPlan
from orgel.split import split_model
from orgel.split.types import SplitModel

WIDTH, ROWS, TOKENS, MICROBATCHES = 16, 8, 5, 2


class Masked(torch.nn.Module):
    """Layers that all read one mask (bool) and one table (float, no gradient) made up front."""

    freq: torch.Tensor

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.register_buffer("freq", torch.linspace(0.1, 1.0, WIDTH))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids > 2).unsqueeze(-1)
        table = torch.cos(ids.unsqueeze(-1).float() * self.freq)
        for layer in self.layers:
            x = torch.where(mask, torch.relu(layer(x)) * table, x)
        return x


def workload() -> tuple[Masked, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = Masked()
    g = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(ROWS, TOKENS, WIDTH, generator=g),
              "ids": torch.randint(0, 6, (ROWS, TOKENS), generator=g)}
    return model, inputs, torch.randn(ROWS, TOKENS, WIDTH, generator=g)


def masked_split(model: Masked, inputs: dict[str, torch.Tensor]) -> SplitModel:
    """Stage 0: mask, table and layer 0; stage 1: layer 1; stage 2: layer 2."""
    first = {k: v[: ROWS // MICROBATCHES] for k, v in inputs.items()}
    graph = capture(model, first)
    stage, assignment = 0, []
    for name in graph.nodes:
        assignment.append(stage)
        if graph.nodes[name].op == "where":
            stage = min(stage + 1, 2)
    return split_model(graph, assignment)


def masked_plan(split: SplitModel) -> Plan:
    """Stage 0 on rank 0, stages 1 and 2 on rank 1."""
    return build_schedule("dag-1f1b", 2, MICROBATCHES, stage_graph=split.stage_graph,
                          placement=[(0,), (1,), (1,)])


def _edge(plan: Plan, src: int, dst: int) -> int:
    return next(i for i, e in enumerate(plan.stage_graph.edges) if (e.src, e.dst) == (src, dst))


def test_an_edge_of_values_without_gradient_sends_no_gradient() -> None:
    model, inputs, _ = workload()
    split = masked_split(model, inputs)
    plan = masked_plan(split)
    both, mask_only = _edge(plan, 0, 1), _edge(plan, 0, 2)
    edges = plan.stage_graph.edges
    assert [v.name for v in edges[mask_only].values] == ["mask", "table"]
    assert [v.name for v in edges[both].values] == ["mask", "table", "x_v"]
    assert [v.grad for v in edges[both].values] == [False, False, True]  # as the split says
    assert all(split.requires_grad[v.name] == v.grad for e in edges for v in e.values)
    comm = derive_comm(plan)
    sent = {(m.edge, m.grad) for m in comm.messages}
    # activations go on both edges; a gradient comes back only on the one with x_v
    assert sent == {(both, False), (mask_only, False), (both, True)}
    assert sum(m.grad for m in comm.messages) == MICROBATCHES
    # the plan file keeps it, and a value written without the flag carries a gradient
    again = Plan.from_json(plan.to_json())
    assert again.stage_graph == plan.stage_graph
    assert derive_comm(again).messages == comm.messages
    assert Value("act", 8) == Value("act", 8, True) == Value.from_json(["act", 8])
    with pytest.raises(PlanError, match=r"\[name, bytes, false\]"):
        Value.from_json(["act", 8, "no"])


def test_the_simulator_prices_only_the_gradients_that_go_back() -> None:
    model, inputs, _ = workload()
    plan = masked_plan(masked_split(model, inputs))
    both = _edge(plan, 0, 1)
    x_v = next(v for v in plan.stage_graph.edges[both].values if v.name == "x_v")
    cp = CompiledPlan(plan)
    nbytes = cp.message_bytes()
    grads = [k for k, m in enumerate(cp.comm.messages) if m.grad]
    assert grads and all(nbytes[k] == x_v.nbytes for k in grads)  # not the mask and table too
    from orgel.schedule.costs import Costs, Link

    costs = Costs.uniform(3, fwd=1.0, bwd=2.0)
    costs.link = Link(latency=0.1, per_mib=1.0)
    sim = simulate(plan, costs=costs)
    back = [e for e in sim.timeline.events if e.track == "comm" and e.label.startswith("grad")]
    assert len(back) == MICROBATCHES and all(f"e{both} " in e.label for e in back)


def test_a_plan_that_drops_a_gradient_the_split_needs_is_refused() -> None:
    from orgel.runtime.executor import check_gradient_values

    model, inputs, _ = workload()
    split = masked_split(model, inputs)
    plan = masked_plan(split)
    check_gradient_values(plan, split)  # the split's own flags
    graph = plan.stage_graph
    both = _edge(plan, 0, 1)
    wrong = [e if i != both else type(e)(e.src, e.dst, tuple(v._replace(grad=False)
                                                              for v in e.values))
             for i, e in enumerate(graph.edges)]
    bad = Plan(type(graph)(graph.stages, tuple(wrong)), plan.placement, plan.num_ranks,
               plan.microbatches, plan.schedule)
    with pytest.raises(ValueError, match=r"x_v .*edge 0->1.*carries no gradient"):
        check_gradient_values(bad, split)


# -- on two gloo ranks --------------------------------------------------------------------------


def run_rank(rank: int, world: int) -> dict[str, Any]:
    """Two steps of the masked model; what this rank sent and posted, its gradients."""
    from orgel.runtime.executor import Executor

    model, inputs, targets = workload()
    split = masked_split(model, inputs)
    plan = masked_plan(split)
    ex = Executor(plan, split, loss_fn=torch.nn.functional.mse_loss, timeout=30)
    transport, messages = ex.transport, ex.comm.messages
    sent: list[tuple[int, bool, int]] = []
    posted: list[tuple[int, bool]] = []
    send, post = transport.send, transport._post

    def counted_send(i: int, tensors: list[torch.Tensor]) -> None:
        sent.append((messages[i].edge, messages[i].grad, len(tensors)))
        send(i, tensors)

    def counted_post(i: int) -> None:
        posted.append((messages[i].edge, messages[i].grad))
        post(i)

    transport.send = counted_send  # type: ignore[method-assign]
    transport._post = counted_post  # type: ignore[method-assign]
    # the first step exchanges shapes and posts just in time; the second posts ahead
    losses = [ex.step(inputs, targets) for _ in range(2)]
    grads = {n: p.grad.clone() for n, p in ex.named_parameters() if p.grad is not None}
    return {"losses": losses, "grads": grads, "sent": sent, "posted": posted,
            "edges": [(e.src, e.dst) for e in plan.stage_graph.edges]}


@pytest.mark.slow
def test_two_ranks_train_exactly_and_send_no_gradient_for_the_mask() -> None:
    from orgel.launch.spawn import spawn

    per_rank = spawn(run_rank, 2, timeout=60)
    model, inputs, targets = workload()
    loss = torch.nn.functional.mse_loss(model(**inputs), targets)
    loss.backward()
    edges = per_rank[0]["edges"]
    both, mask_only = edges.index((0, 1)), edges.index((0, 2))
    steps = 2 * MICROBATCHES
    # rank 0 sends activations on both edges (3 and 2 tensors); rank 1 sends x_v's gradient
    assert sorted(per_rank[0]["sent"]) == sorted([(both, False, 3), (mask_only, False, 2)] * steps)
    assert per_rank[1]["sent"] == [(both, True, 1)] * steps
    assert sorted(per_rank[0]["posted"]) == [(both, True)] * steps  # no wait for the mask's
    assert sorted(per_rank[1]["posted"]) == sorted([(both, False), (mask_only, False)] * steps)
    got: dict[str, torch.Tensor] = {}
    for r in per_rank:
        assert r["losses"] == [pytest.approx(loss.item(), rel=1e-6)] * 2
        got.update(r["grads"])
    assert sorted(got) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.hf
def test_hugging_face_llama_drops_the_rotary_tables_gradient_and_trains_exactly() -> None:
    """Llama from a tiny config on 2 ranks, 3 interleaved stages each (orgel.pipeline).

    Stage 0 makes the attention mask and the rotary cos/sin tables; stage 3, on the
    other rank, reads them and nothing else from stage 0: that edge has no gradient
    message, and the step still matches one process.
    """
    import copy

    from archzoo import archs
    from archzoo.check import balanced_check
    from orgel.plan.balanced import balanced_plan
    from orgel.workload import Workload, microbatches

    build = archs()["hf_llama"]
    schedule: dict[str, Any] = {"schedule": "interleaved", "stages_per_rank": 3}
    w = build()
    model = copy.deepcopy(w.model)  # the plan balanced_check makes, to look at its messages
    first, _ = microbatches(Workload(model, w.inputs, w.targets, w.loss_fn), 2)[0]
    plan = balanced_plan(capture(model, first), ranks=2, microbatches=2, **schedule)
    edges = plan.stage_graph.edges
    free = [i for i, e in enumerate(edges) if not e.carries_grad
            and plan.placement[e.src] != plan.placement[e.dst]]
    assert free  # e.g. the mask and the cos/sin tables, stage 0 -> 3
    comm = derive_comm(plan)
    assert not any(m.grad and m.edge in free for m in comm.messages)
    assert any(not m.grad and m.edge in free for m in comm.messages)
    outcome = balanced_check("hf_llama", build, **schedule)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace
