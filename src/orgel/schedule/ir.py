"""The Plan IR: actions, the stage graph, placement, schedule and the Plan itself.

Everything in orgel meets here. The planners write a :class:`Plan`, the simulator
scores it, the runtime executes it, the visualiser draws it and a person can write
one by hand. A Plan is plain data: it round-trips through JSON (``to_dict`` /
``from_dict``, ``save`` / ``load``) with a version field and never uses pickle.

Conventions used everywhere in orgel:

* times are milliseconds, sizes are bytes;
* a value's ``nbytes`` is its size for one whole micro-batch;
* stages, ranks and micro-batches are numbered from 0.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from orgel.schedule.costs import Costs
from orgel.schedule.stage_graph import Edge, PlanError, Stage, StageGraph, Value

PLAN_VERSION = 1

#: Action kinds: forward, full backward, input-grad half, weight-grad half.
KINDS = ("F", "B", "I", "W")

#: How a stage's data-parallel replicas hold its state: ``"none"`` (each a whole
#: copy; gradients all-reduced) or ``"fsdp"`` (torch's FSDP2 over the replicas:
#: parameters, gradients and optimizer state sharded, gathered once per step).
SHARDS = ("none", "fsdp")
#: what ``Plan.recompute[s]`` may say: keep the activations (False), recompute the stage
#: whole (True), checkpoint each layer, or keep only the costly operators' outputs
#: (:mod:`orgel.runtime.checkpointing`)
RECOMPUTE: tuple[bool | str, ...] = (False, True, "layer", "selective")

_ACTION_RE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


class Action(NamedTuple):
    """One unit of work on a rank: ``kind`` of ``stage`` for ``microbatch``.

    Text form is ``F3.0``: kind, stage, ``.``, micro-batch.
    """

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the text form (``F3.0``, ``B0.12``, ``I1.2``, ``W1.2``)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise PlanError(
                f"cannot parse action {text!r}: expected KIND STAGE '.' MICROBATCH "
                f"with KIND one of {'/'.join(KINDS)}, e.g. 'F3.0'"
            )
        return cls(match.group(1), int(match.group(2)), int(match.group(3)))


def _parse_rank(rank: int, line: str) -> list[Action]:
    """One rank's actions from the JSON schedule string, naming the rank on error."""
    try:
        return [Action.parse(tok) for tok in line.split()]
    except PlanError as exc:
        raise PlanError(f"schedule of rank {rank}: {exc}") from None


@dataclass(frozen=True)
class TiedWeight:
    """A parameter that stages on more than one rank share: its copies' gradients are summed.

    ``stages``: the stages holding a copy (at least two ranks among them);
    ``nbytes``: the parameter's size, the all-reduce's message.
    """

    name: str
    stages: tuple[int, ...]
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "stages": list(self.stages), "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, data: Any, where: str = "tied_weights") -> TiedWeight:
        try:
            return cls(str(data.get("name", "")), tuple(int(s) for s in data["stages"]),
                       int(data["nbytes"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PlanError(f"{where} must look like {{'name': 'emb.weight', 'stages': [0, 3], "
                            f"'nbytes': 1024}}, got {data!r}") from None


@dataclass(frozen=True)
class Plan:
    """Everything needed to run (or simulate) one pipelined training step.

    * ``stage_graph``: the stages and the values between them;
    * ``placement[s]``: the ranks hosting stage ``s``. Several stages may share
      a rank; a stage on several ranks is data-parallel inside the stage, each
      replica taking an equal, contiguous share of every micro-batch (replica
      ``k`` of ``n`` takes rows ``[k*b/n, (k+1)*b/n)``). Data parallel × pipeline
      is the case where every stage has the same number of replicas;
    * ``schedule[r]``: rank ``r``'s ordered action list. A replica of a
      data-parallel stage runs the stage's actions for its share;
    * ``recompute[s]``: ``True`` drops stage ``s``'s activations after forward and
      recomputes them before its backward; ``"layer"`` checkpoints each layer of it,
      ``"selective"`` recomputes all but its matmul and attention outputs (:data:`RECOMPUTE`);
    * ``costs`` and ``prediction``: optional, filled by the profiler/planner and
      the simulator; ``meta``: free-form JSON (schedule family, parameters,
      planner name, …);
    * ``tied``: the parameters stages on different ranks share (:class:`TiedWeight`),
      whose gradients the ranks all-reduce every step;
    * ``shard[s]``: how stage ``s``'s replicas hold its state, one of :data:`SHARDS`
      (``"fsdp"`` needs at least two replicas);
    * ``tp``: the tensor-parallel degree. Each rank of the plan (a *pipeline
      rank*) is a group of ``tp`` processes that run its action list together,
      each holding a ``1/tp`` slice of the splittable layers; process ``r * tp + t``
      is member ``t`` of pipeline rank ``r`` (:meth:`world_size` processes in all;
      :meth:`processes_of`, :meth:`pipeline_rank_of`, :meth:`tp_member_of`);
    * ``sequence_parallel``: with ``tp > 1``, the values between the split layers (the
      residual stream, the norms) are cut along the sequence over the ``tp`` processes
      instead of held whole by each (:mod:`orgel.runtime.sequence_parallel`).

    A Plan is a value: frozen, its lists never edited in place. A rewrite
    (``dataclasses.replace``, the functions of :mod:`orgel.plan.rewrites`) returns a
    new Plan. Sends and receives are not written: they follow from the stage graph
    (see :mod:`orgel.schedule.comm`).
    """

    stage_graph: StageGraph
    placement: list[tuple[int, ...]]
    num_ranks: int
    microbatches: int
    schedule: list[list[Action]]
    recompute: list[bool | str] = field(default_factory=list)
    costs: Costs | None = None
    prediction: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    tied: list[TiedWeight] = field(default_factory=list)
    shard: list[str] = field(default_factory=list)
    tp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        # Normalise the fields as given (JSON lists, short lists) once, while building.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("placement", [tuple(int(r) for r in ranks) for ranks in self.placement])
        put("schedule", [list(actions) for actions in self.schedule])
        put("meta", dict(self.meta))
        put("recompute", [x if isinstance(x, str) else bool(x) for x in self.recompute]
            or [False] * self.stage_graph.num_stages)
        bad_recompute = [x for x in self.recompute if x not in RECOMPUTE]
        if bad_recompute:
            raise PlanError(f"recompute {bad_recompute[0]!r} is not one of "
                            f"{', '.join(map(repr, RECOMPUTE))}")
        put("shard", [str(x) for x in self.shard] or ["none"] * self.stage_graph.num_stages)
        bad_shard = [x for x in self.shard if x not in SHARDS]
        if bad_shard:
            raise PlanError(f"shard {bad_shard[0]!r} is not one of {', '.join(SHARDS)}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise PlanError(f"tp must be an integer >= 1 (processes per pipeline rank), "
                            f"got {self.tp!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"sequence_parallel must be true or false, got "
                            f"{self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("sequence_parallel cuts what the tensor-parallel members hold "
                            "whole along the sequence: it needs tp > 1")
        put("tied", [t if isinstance(t, TiedWeight) else TiedWeight.from_dict(t, f"tied[{i}]")
                     for i, t in enumerate(self.tied)])
        for i, t in enumerate(self.tied):
            bad = [st for st in t.stages if not 0 <= st < self.stage_graph.num_stages]
            if bad or len(t.stages) < 2 or t.nbytes < 0:
                raise PlanError(
                    f"tied weight {i} ({t.name or 'unnamed'}) names stages {list(t.stages)} and "
                    f"{t.nbytes} bytes: it needs at least two of the {self.num_stages} stages "
                    "and a size >= 0")

    @property
    def num_stages(self) -> int:
        return self.stage_graph.num_stages

    @property
    def world_size(self) -> int:
        """Processes the plan runs on: ``num_ranks`` pipeline ranks of ``tp`` each."""
        return self.num_ranks * self.tp

    @property
    def row_unit(self) -> int:
        """The pieces every micro-batch is made of: the least common multiple of the stages'
        replica counts (each replica takes one piece of a micro-batch, the pieces equal
        where they divide the batch; :func:`orgel.batching.micro_sizes`)."""
        return math.lcm(*(len(r) for r in self.placement)) if self.placement else 1

    def processes_of(self, rank: int) -> list[int]:
        """The processes of pipeline rank ``rank``: ``rank * tp + t`` for each member ``t``."""
        return [rank * self.tp + t for t in range(self.tp)]

    def process_of(self, rank: int, member: int) -> int:
        """The process that is member ``member`` of pipeline rank ``rank``."""
        return rank * self.tp + member

    def pipeline_rank_of(self, process: int) -> int:
        """The pipeline rank process ``process`` belongs to."""
        return process // self.tp

    def tp_member_of(self, process: int) -> int:
        """Which of its pipeline rank's ``tp`` processes ``process`` is."""
        return process % self.tp

    def sharded(self, stage: int) -> bool:
        """Whether ``stage``'s replicas shard its state with FSDP2."""
        return self.shard[stage] == "fsdp"

    def stages_on(self, rank: int) -> list[int]:
        """The stages ``rank`` hosts, in index order."""
        return [s for s, ranks in enumerate(self.placement) if rank in ranks]

    def uses_split_backward(self, stage: int) -> bool:
        """Whether ``stage`` runs ``I``/``W`` halves instead of a full ``B``."""
        return any(
            a.stage == stage and a.kind in ("I", "W")
            for r in self.placement[stage]
            for a in self.schedule[r]
        )

    # -- text form ---------------------------------------------------------------

    def schedule_text(self) -> str:
        """One line per rank: ``rank0: F0.0 F0.1 B0.0 ...``."""
        return "\n".join(
            f"rank{r}: " + " ".join(str(a) for a in actions)
            for r, actions in enumerate(self.schedule)
        )

    # -- JSON --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        g = self.stage_graph
        return {
            "version": self.version,
            "num_ranks": self.num_ranks,
            "microbatches": self.microbatches,
            "stages": [
                {
                    "name": s.name,
                    "nodes": list(s.nodes),
                    "blocks": list(s.blocks),
                    "model_inputs": list(s.model_inputs),
                    "model_outputs": list(s.model_outputs),
                    "ranks": list(self.placement[i]),
                    "recompute": self.recompute[i],
                    **({"shard": self.shard[i]} if self.shard[i] != "none" else {}),
                }
                for i, s in enumerate(g.stages)
            ],
            "edges": [
                {"src": e.src, "dst": e.dst, "values": [v.to_json() for v in e.values]}
                for e in g.edges
            ],
            "schedule": [" ".join(str(a) for a in actions) for actions in self.schedule],
            "costs": None if self.costs is None else self.costs.to_dict(),
            "prediction": self.prediction,
            "meta": self.meta,
            "tied_weights": [t.to_dict() for t in self.tied],
            **({"tp": self.tp} if self.tp != 1 else {}),
            **({"sequence_parallel": True} if self.sequence_parallel else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Build a Plan from :meth:`to_dict` output; raises :class:`PlanError`."""
        if not isinstance(data, dict):
            raise PlanError("a plan must be a JSON object")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(
                f"plan version {version!r} is not supported: this orgel reads version "
                f"{PLAN_VERSION}"
            )
        try:
            stages_data = data["stages"]
            stages = tuple(
                Stage(
                    name=str(s.get("name", "")),
                    nodes=tuple(s.get("nodes", ())),
                    blocks=tuple(int(b) for b in s.get("blocks", ())),
                    model_inputs=tuple(s.get("model_inputs", ())),
                    model_outputs=tuple(s.get("model_outputs", ())),
                )
                for s in stages_data
            )
            edges = tuple(
                Edge(
                    int(e["src"]),
                    int(e["dst"]),
                    tuple(Value.from_json(v) for v in e.get("values", ())),
                )
                for e in data.get("edges", ())
            )
            schedule = [_parse_rank(r, line) for r, line in enumerate(data["schedule"])]
            costs = data.get("costs")
            meta = dict(data.get("meta") or {})
            # plans written before the field existed kept the groups in their meta
            tied = data.get("tied_weights", meta.pop("tied_weights", ()))
            if not isinstance(tied, list | tuple):
                raise PlanError(f"tied_weights must be a list, got {tied!r}")
            return cls(
                stage_graph=StageGraph(stages, edges),
                placement=[tuple(s["ranks"]) for s in stages_data],
                num_ranks=int(data["num_ranks"]),
                microbatches=int(data["microbatches"]),
                schedule=schedule,
                recompute=[s.get("recompute", False) for s in stages_data],
                costs=None if costs is None else Costs.from_dict(costs),
                prediction=data.get("prediction"),
                meta=meta,
                tied=[TiedWeight.from_dict(t, f"tied_weights[{i}]") for i, t in enumerate(tied)],
                shard=[str(s.get("shard", "none")) for s in stages_data],
                tp=data.get("tp", 1),
                sequence_parallel=data.get("sequence_parallel", False),
            )
        except KeyError as exc:
            raise PlanError(f"plan is missing the field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"plan has a malformed field: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())
