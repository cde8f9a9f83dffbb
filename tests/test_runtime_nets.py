"""Tiny hand-built models and splits for the runtime tests (no capture needed).

A :class:`GraphNet` is a list of named nodes, each a module reading named
values; any assignment of nodes to stages gives a SplitModel whose stages keep
the original parameter names. Chains, branches, joins, skips and tied weights
are all just node lists. Also: the single-process reference and the scenario
runner used by the multi-rank tests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from orgel.plan.transforms import with_recompute
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import Edge, Plan, Stage, StageGraph, Value
from orgel.split.types import SplitModel, StageModule

Nodes = list[tuple[str, nn.Module, list[str]]]


class GraphNet(nn.Module):
    """Runs named nodes in order; each reads named values, writes its own name."""

    def __init__(self, nodes: Nodes, inputs: list[str], outputs: list[str]) -> None:
        super().__init__()
        self.mods = nn.ModuleDict({name: mod for name, mod, _ in nodes})
        self.reads = {name: reads for name, _, reads in nodes}
        self.order = [name for name, _, _ in nodes]
        self.inputs, self.outputs = inputs, outputs

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env = dict(zip(self.inputs, args, strict=True))
        for name in self.order:
            env[name] = self.mods[name](*[env[r] for r in self.reads[name]])
        return tuple(env[o] for o in self.outputs)


class Block(nn.Module):
    """Residual MLP block with LayerNorm (optionally dropout)."""

    def __init__(self, d: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.tanh(self.fc1(self.norm(x)))))


class Head(nn.Module):
    """Output projection; with ``weight`` given, it is tied to that parameter."""

    def __init__(self, d: int, vocab: int, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.randn(vocab, d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class Join(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.stack(xs).sum(0))


class Embed(nn.Embedding):
    """Embedding whose output also feeds the next stage under a second name (a skip)."""


V, D, T = 16, 8, 4


def gpt(layers: int = 4, *, tied: bool = False, dropout: float = 0.0) -> GraphNet:
    """Embedding, ``layers`` blocks, head (tied to the embedding if asked)."""
    torch.manual_seed(0)
    emb = nn.Embedding(V, D)
    nodes: Nodes = [("emb", emb, ["tokens"])]
    prev = "emb"
    for i in range(layers):
        nodes.append((f"b{i}", Block(D, dropout), [prev]))
        prev = f"b{i}"
    nodes.append(("head", Head(D, V, emb.weight if tied else None), [prev]))
    return GraphNet(nodes, ["tokens"], ["head"])


class Ids(nn.Module):
    """Passes integer ids on, so they cross a stage boundary (no gradient goes back)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.clone()


def mixed() -> GraphNet:
    """Integer ids and hidden states travel together on one edge."""
    torch.manual_seed(0)
    nodes: Nodes = [
        ("emb", nn.Embedding(V, D), ["tokens"]), ("ids", Ids(), ["tokens"]),
        ("b0", Block(D), ["emb"]), ("emb2", nn.Embedding(V, D), ["ids"]),
        ("join", Join(D), ["b0", "emb2"]), ("head", Head(D, V), ["join"]),
    ]
    return GraphNet(nodes, ["tokens"], ["head"])


def clip() -> GraphNet:
    """Two towers (image, text) joined at the end: they can run at the same time."""
    torch.manual_seed(0)
    nodes: Nodes = [
        ("i0", nn.Linear(6, D), ["image"]), ("i1", Block(D), ["i0"]),
        ("t0", nn.Embedding(V, D), ["tokens"]), ("t1", Block(D), ["t0"]),
        ("join", Join(D), ["i1", "t1"]), ("out", nn.Linear(D, V), ["join"]),
    ]
    return GraphNet(nodes, ["image", "tokens"], ["out"])


def branches4() -> GraphNet:
    """Stem, four parallel branches, a join: fan-out 4, fan-in 4."""
    torch.manual_seed(0)
    nodes: Nodes = [("stem", nn.Linear(6, D), ["image"])]
    for b in range(4):
        nodes.append((f"br{b}", Block(D), ["stem"]))
    nodes.append(("join", Join(D), [f"br{b}" for b in range(4)]))
    nodes.append(("out", nn.Linear(D, V), ["join"]))
    return GraphNet(nodes, ["image"], ["out"])


def unet() -> GraphNet:
    """Down, middle, up with skip connections from each down level to its up level."""
    torch.manual_seed(0)
    nodes: Nodes = [
        ("d0", nn.Linear(6, D), ["image"]), ("d1", Block(D), ["d0"]), ("mid", Block(D), ["d1"]),
        ("u1", Join(D), ["mid", "d1"]), ("u0", Join(D), ["u1", "d0"]),
        ("out", nn.Linear(D, V), ["u0"]),
    ]
    return GraphNet(nodes, ["image"], ["out"])


def split(net: GraphNet, assignment: dict[str, int]) -> SplitModel:
    """Stages from ``assignment`` (node -> stage); parameter names kept, ties found."""
    n = max(assignment.values()) + 1
    produced = {name: assignment[name] for name in net.order}
    full_names = {id(p): name for name, p in net.named_parameters()}
    stages, edges = [], {}
    for s in range(n):
        names = [x for x in net.order if assignment[x] == s]
        reads = [r for x in names for r in net.reads[x] if produced.get(r) != s]
        inputs = list(dict.fromkeys(reads))
        outs = [x for x in names if x in net.outputs or any(
            x in net.reads[y] and assignment[y] != s for y in net.order)]
        for x in inputs:
            if x in produced:
                edges.setdefault((produced[x], s), []).append(x)
        nodes = [(x, net.mods[x], net.reads[x]) for x in names]
        part = copy.deepcopy(GraphNet(nodes, inputs, outs))
        originals = dict(GraphNet(nodes, inputs, outs).named_parameters())
        param_names = {local: full_names[id(originals[local])]
                       for local, _ in part.named_parameters()}
        stages.append(StageModule(s, part, inputs, outs,
                                  model_inputs=[x for x in inputs if x in net.inputs],
                                  param_names=param_names))
    counts: dict[str, int] = {}
    for st in stages:
        for q in st.param_names.values():
            counts[q] = counts.get(q, 0) + 1
    graph = StageGraph(
        tuple(Stage(name=f"stage{s}", model_inputs=tuple(stages[s].model_inputs))
              for s in range(n)),
        tuple(Edge(a, b, tuple(Value(x, 0) for x in vals))
              for (a, b), vals in sorted(edges.items())),
    )
    loss_stage = assignment[net.outputs[0]]
    return SplitModel(stages, graph, loss_stage, list(net.outputs), lambda outs: outs[0],
                      list(net.inputs), tied=sorted(q for q, c in counts.items() if c > 1))


def ce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def batch(kind: str, rows: int = 8, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (rows, T), generator=g)
    image = torch.randn(rows, T, 6, generator=g)
    targets = torch.randint(0, V, (rows, T), generator=g)
    inputs = {"gpt": {"tokens": tokens}, "clip": {"image": image, "tokens": tokens}}
    return inputs.get(kind, {"image": image}), targets


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference(net: GraphNet, kind: str, microbatches: int, steps: int,
              max_norm: float | None = None,
              rows: list[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """Parameters after each step of single-process gradient accumulation."""
    net = copy.deepcopy(net)
    opt = sgd(list(net.parameters()))
    snapshots = []
    for step in range(steps):
        inputs, targets = batch(kind, rows[step] if rows else 8)
        opt.zero_grad()
        chunks = {k: v.chunk(microbatches) for k, v in inputs.items()}
        for m, y in enumerate(targets.chunk(microbatches)):
            out = net(*[chunks[k][m] for k in net.inputs])[0]
            (ce_loss(out, y) / microbatches).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()
        snapshots.append({k: v.detach().clone() for k, v in net.named_parameters()})
    return snapshots


Scenario = tuple[str, Callable[[], GraphNet], str, dict[str, int], Callable[[StageGraph], Plan]]


def family(name: str, ranks: int, microbatches: int,
           **options: Any) -> Callable[[StageGraph], Plan]:
    return lambda graph: build_schedule(name, ranks, microbatches, stage_graph=graph, **options)


C2 = {"emb": 0, "b0": 0, "b1": 0, "b2": 1, "b3": 1, "head": 1}
C3 = {"emb": 0, "b0": 0, "b1": 1, "b2": 1, "b3": 2, "head": 2}
C4 = {"emb": 0, "b0": 0, "b1": 1, "b2": 2, "b3": 3, "head": 3}


def _dag(ranks: int, placement: list[tuple[int, ...]], m: int = 4) -> Callable[[StageGraph], Plan]:
    return family("dag-1f1b", ranks, m, placement=placement)


#: name -> (world, net, batch kind, assignment, plan builder, options)
SCENARIOS: dict[str, tuple[int, Callable[[], GraphNet], str, dict[str, int],
                           Callable[[StageGraph], Plan], dict[str, Any]]] = {
    "gpipe": (2, gpt, "gpt", C2, family("gpipe", 2, 4), {}),
    "1f1b": (2, gpt, "gpt", C2, family("1f1b", 2, 4), {}),
    "dropout": (2, lambda: gpt(dropout=0.2), "gpt", C2, family("1f1b", 2, 4), {}),
    "dropout-recompute": (2, lambda: gpt(dropout=0.2), "gpt", C2, family("1f1b", 2, 4),
                          {"recompute": True}),
    "interleaved": (2, gpt, "gpt", C4, family("interleaved", 2, 4, stages_per_rank=2), {}),
    "looped-bfs": (2, gpt, "gpt", C4, family("looped-bfs", 2, 4, stages_per_rank=2), {}),
    "looped": (2, gpt, "gpt", C4,
               family("looped", 2, 4, loops=2, loop_microbatches=2, prefetch=[1, 0]), {}),
    "zb-h1": (2, gpt, "gpt", C2, family("zb-h1", 2, 4), {}),
    "zb-h1-recompute": (2, gpt, "gpt", C2, family("zb-h1", 2, 4), {"recompute": True}),
    "new-batch-size": (2, gpt, "gpt", C2, family("1f1b", 2, 4), {"rows": [8, 16, 8]}),
    "dynamic-shapes": (2, gpt, "gpt", C4, family("interleaved", 2, 4),
                       {"rows": [8, 4, 12], "dynamic": True}),
    "int-values": (2, mixed, "gpt", {"emb": 0, "ids": 0, "b0": 0, "emb2": 1, "join": 1,
                                     "head": 1}, family("zb-h1", 2, 4), {}),
    "just-in-time": (2, gpt, "gpt", C4, family("interleaved", 2, 4),
                     {"post_ahead": False, "rows": [8, 8, 16]}),
    "tied-clip": (2, lambda: gpt(tied=True), "gpt", C2, family("1f1b", 2, 4),
                  {"max_norm": 0.05}),
    "clip-towers": (2, clip, "clip", {"i0": 0, "i1": 0, "t0": 1, "t1": 1, "join": 2, "out": 2},
                    _dag(2, [(0,), (1,), (1,)]), {}),
    "1f1b-3": (3, gpt, "gpt", C3, family("1f1b", 3, 4), {}),
    "clip-3": (3, clip, "clip", {"i0": 0, "i1": 0, "t0": 1, "t1": 1, "join": 2, "out": 2},
               _dag(3, [(0,), (1,), (2,)]), {}),
    "unet": (3, unet, "image", {"d0": 0, "d1": 1, "mid": 1, "u1": 2, "u0": 2, "out": 2},
             _dag(3, [(0,), (1,), (2,)]), {"recompute": True}),
    "dp-in-stage": (3, gpt, "gpt", C2, _dag(3, [(0,), (1, 2)]), {}),
    "branches4": (4, branches4, "image",
                  {"stem": 0, "br0": 1, "br1": 2, "br2": 3, "br3": 4, "join": 5, "out": 5},
                  _dag(4, [(0,), (0,), (1,), (2,), (3,), (0,)]), {}),
    "dp2xpp2-tied": (4, lambda: gpt(tied=True), "gpt", C2, _dag(4, [(0, 2), (1, 3)]),
                     {"max_norm": 0.05}),
    "gpipe-4": (4, lambda: gpt(tied=True), "gpt", C4, family("gpipe", 4, 4), {}),
}


def build(name: str) -> tuple[GraphNet, SplitModel, Plan, dict[str, Any]]:
    """The net, its split and plan for scenario ``name``."""
    _, make, _, assignment, plan_of, options = SCENARIOS[name]
    net = make()
    split_model = split(net, assignment)
    plan = plan_of(split_model.stage_graph)
    if options.get("recompute"):
        plan = with_recompute(plan, [True] * plan.num_stages)
    return net, split_model, plan, options


Snapshots = list[list[tuple[str, torch.Tensor]]]


def run_scenarios(rank: int, world: int, names: list[str],
                  steps: int = 3) -> dict[str, tuple[list[float], Snapshots]]:
    """On every rank: run each scenario ``steps`` steps; parameters after each step."""
    from orgel.runtime.executor import Executor

    results = {}
    for name in names:
        net, split_model, plan, options = build(name)
        ex = Executor(plan, split_model, loss_fn=ce_loss, optimizer_factory=sgd,
                      max_grad_norm=options.get("max_norm"), timeout=20,
                      dynamic_shapes=options.get("dynamic", False),
                      post_ahead=options.get("post_ahead"))
        torch.manual_seed(123)  # dropout draws: same stream as the reference's
        losses, snaps = [], []
        for step in range(steps):
            rows = options.get("rows", [8] * steps)[step]
            inputs, targets = batch(SCENARIOS[name][2], rows)
            losses.append(ex.step(inputs, targets))
            snaps.append([(q, p.detach().clone()) for q, p in ex.named_parameters()])
        results[name] = (losses, snaps)
        if name == "1f1b":
            from orgel.runtime.trace import gather_events

            results["events:1f1b"] = gather_events(ex.events)  # type: ignore[assignment]
    return results
