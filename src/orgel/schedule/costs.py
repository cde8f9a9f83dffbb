"""Costs: what each stage's actions take (time, memory) and what links cost.

Times are milliseconds for one whole micro-batch, sizes are bytes. The profiler
measures these per block; a planner sums blocks into stages; the simulator reads
them; a Plan may carry them so it can be re-simulated without the model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple


class PolicyCost(NamedTuple):
    """What one stage's ``policy`` costs per micro-batch: ``kept`` bytes from its forward to
    its backward (``"selective"``: besides the stage's inputs), the most bytes its backward
    ``rebuilt`` at once, and the ms of forward it runs ``again``."""

    policy: str
    kept: int
    rebuilt: int
    again: float


@dataclass(frozen=True)
class StageCost:
    """Cost of one stage for one whole micro-batch.

    ``bwd`` is the full backward. With a split backward, the weight-grad half
    ``W`` takes ``bwd_weight`` (default: half of ``bwd``) and the input-grad half
    ``I`` takes ``bwd - bwd_weight``. ``activations`` are the bytes saved for
    backward by one forward, alive until the backward (or its ``W`` half)
    finishes; with recompute only the stage's inputs stay alive and the
    backward also pays ``fwd`` again. ``weight_kept`` is what a split
    backward's ``I`` keeps for its ``W`` (output gradients, inputs of weight
    gradients), alive from the start of ``I`` to the end of ``W``; schedules
    without ``I``/``W`` ignore it. ``temporary`` is the peak extra memory
    while an action runs. ``params``/``grads``/``optimizer`` are static bytes.
    ``grad_overlap``: bytes of activations and gradients that are never alive
    together during the stage's first backward of a step, which makes the
    gradients while it frees that micro-batch's activations block by block
    (see :func:`orgel.costs.blocks.stage_cost`); 0 counts both in full. A stage on
    several ranks: one replica's, which makes all the gradients from its share of the
    activations (not the share of the whole micro-batch's overlap).
    """

    fwd: float
    bwd: float
    bwd_weight: float | None = None
    params: int = 0
    grads: int | None = None
    optimizer: int = 0
    activations: int = 0
    temporary: int = 0
    weight_kept: int = 0
    grad_overlap: int = 0
    #: what ``"layer"`` and ``"selective"`` recompute cost this stage (none: priced as the
    #: stage whole; see :mod:`orgel.costs.recompute`)
    recompute: tuple[PolicyCost, ...] = ()

    @property
    def weight_grad(self) -> float:
        return self.bwd / 2 if self.bwd_weight is None else self.bwd_weight

    @property
    def input_grad(self) -> float:
        return self.bwd - self.weight_grad

    @property
    def grad_bytes(self) -> int:
        """The gradients' bytes (``params`` when ``grads`` is not given)."""
        return self.params if self.grads is None else self.grads

    @property
    def static_bytes(self) -> int:
        return self.params + self.grad_bytes + self.optimizer


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``latency`` ms plus ``per_mib`` ms per MiB sent."""

    latency: float = 0.0
    per_mib: float = 0.0

    def time(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency + self.per_mib * nbytes / (1 << 20)


@dataclass
class Costs:
    """Per-stage costs, the link model and per-rank memory capacity.

    ``links`` overrides ``link`` for particular (sender, receiver) rank pairs.
    ``action_overhead`` is the fixed cost (dispatch, Python, launch) added to
    every compute action. ``node_ranks`` (with ``node_link``): ranks
    ``0..node_ranks-1`` share a node, and so on; two ranks on different nodes
    talk over ``node_link`` instead of ``link`` (a pair in ``links`` still wins).
    ``cores``: how many ranks can compute at full speed at once when the ranks
    share one host's processors (CPU ranks: the cores divided by each rank's
    threads); None when each rank has a device of its own. Stage times are a
    rank's with a core to itself; with more ranks than ``cores``, an action
    slows down by how many ranks compute during it over the cores, and the
    step takes at least every rank's compute over the cores: the bubble of
    one rank is the time another gets its core
    (:meth:`orgel.sim.compiled.CompiledPlan.shared_timeline`).
    """

    stages: list[StageCost]
    link: Link = field(default_factory=Link)
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    action_overhead: float = 0.0
    memory_per_rank: int | None = None
    node_ranks: int | None = None
    node_link: Link | None = None
    #: per stage-graph edge, the bytes its gradient messages carry (None: the edge's bytes);
    #: values that need no gradient (masks, position tables) send none back
    edge_grad_bytes: list[int] | None = None
    cores: float | None = None

    def link_between(self, src: int, dst: int) -> Link:
        link = self.links.get((src, dst))
        if link is not None:
            return link
        if self.node_ranks and self.node_link is not None \
                and src // self.node_ranks != dst // self.node_ranks:
            return self.node_link
        return self.link

    @property
    def uniform_links(self) -> bool:
        """Whether every rank pair takes ``link`` (no pairs, no nodes)."""
        return not self.links and not (self.node_ranks and self.node_link is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": [asdict(s) for s in self.stages],
            "link": asdict(self.link),
            "links": [[s, d, asdict(link)] for (s, d), link in sorted(self.links.items())],
            "action_overhead": self.action_overhead,
            "memory_per_rank": self.memory_per_rank,
            **({} if self.node_ranks is None or self.node_link is None else
               {"node_ranks": self.node_ranks, "node_link": asdict(self.node_link)}),
            **({} if self.edge_grad_bytes is None
               else {"edge_grad_bytes": list(self.edge_grad_bytes)}),
            **({} if self.cores is None else {"cores": self.cores}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Costs:
        return cls(
            stages=[StageCost(**{**s, "recompute": tuple(PolicyCost(*c) for c in
                                                         s.get("recompute", ()))})
                    for s in data["stages"]],
            link=Link(**data.get("link", {})),
            links={(int(s), int(d)): Link(**lk) for s, d, lk in data.get("links", [])},
            action_overhead=float(data.get("action_overhead", 0.0)),
            memory_per_rank=data.get("memory_per_rank"),
            node_ranks=data.get("node_ranks"),
            node_link=Link(**data["node_link"]) if data.get("node_link") else None,
            edge_grad_bytes=(None if data.get("edge_grad_bytes") is None
                             else [int(b) for b in data["edge_grad_bytes"]]),
            cores=None if data.get("cores") is None else float(data["cores"]),
        )

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        fwd: float,
        bwd: float,
        bwd_weight: float | None = None,
        latency: float = 0.0,
        activations: int = 0,
        params: int = 0,
    ) -> Costs:
        """The same cost for every stage; a link that costs ``latency`` per message."""
        stage = StageCost(
            fwd=fwd, bwd=bwd, bwd_weight=bwd_weight, activations=activations, params=params
        )
        return cls(stages=[stage] * num_stages, link=Link(latency=latency))
