"""The block cost table: per-block time and memory, the costs file, and stage costs for a split.

A :class:`BlockCosts` is what the profiler measures and what the planners search
over: for every block of the coarsened graph its forward, backward and
weight-grad times for one micro-batch, its parameter, saved-activation, output
and temporary bytes, plus the block DAG, the link model and the memory per rank.
It is also the on-disk "costs file" (``orgel plan --costs FILE``), so plans can be
studied without a model. Times are milliseconds, sizes bytes::

    {"blocks": [{"fwd": 1.2, "bwd": 2.4, "wgrad": 1.1, "params": 16777216,
                 "activations": 8388608, "output": 8388608, "temporary": 0,
                 "weight_kept": 0, "input_saved": 0, "split_input": 1.5, "split_weight": 1.4,
                 "optimizer_ms": 0.3}, ...],
     "edges": [[0, 1], [1, 2]],            # optional: default a chain
     "link": {"latency": 0.02, "per_mib": 0.05},
     "memory_per_rank": 85899345920,       # optional
     "optimizer_factor": 4,                # weights + grads + optimizer state = 4 x params
     "optimizer_temporary": 0,             # optional: the optimizer step's extra x params
     "action_overhead": 0.0,               # optional, ms per compute action
     "optimizer_ms_per_mib": 0.0,          # optional, optimizer step ms per MiB of params
     "step_overhead": 0.8,                 # optional, ms per step outside the actions
     "rows": 4,                            # optional: rows per micro-batch it was measured at
     "tied": [{"blocks": [0, 11], "nbytes": 4194304, "name": "tok_emb.weight"}],  # optional
     "node": {"ranks": 8, "link": {"latency": 0.005, "per_mib": 0.04}},  # optional
     "cores": 2}                           # optional: ranks sharing a host's processors

An edge ``[a, b]`` carries block ``a``'s ``output`` bytes. ``wgrad`` defaults to half of
``bwd``. ``rows`` (optional) is the micro-batch size, in rows along the batch dimension,
that the times and activation bytes were measured at: ``orgel plan --costs FILE --batch
B`` needs it to scale the table to other micro-batch sizes (:meth:`BlockCosts.scaled`).
``weight_kept`` (optional, default 0) is what a split backward's ``I`` keeps for its
``W`` beyond the forward's activations (the gradients ``W`` starts from).
``input_saved`` (optional, default 0) is the part of a block's inputs from other blocks
that it saves for backward, counted only when another stage feeds the block (inside a
stage the producer's ``activations`` hold it); without it ``activations`` should include
them. ``output_unsaved`` (optional, default 0) is the part of ``activations`` that is
the block's own outputs it does not save: inside a stage whose blocks consume all of
them, they stay alive only as far as those blocks save their inputs.
``split_input``/``split_weight`` (optional, all blocks or none) are a block's
``I`` and ``W`` as measured when the backward runs split: apart, the halves cost more
than one backward (``I`` walks the graph and keeps gradients, ``W`` starts autograd
again per parameter group), so a split schedule's stages take these instead of ``bwd -
wgrad`` and ``wgrad``. ``optimizer_ms`` (optional, all blocks or none) is each block's
optimizer step; without it a rank's step takes ``optimizer_ms_per_mib`` per MiB of its
parameters. ``step_overhead`` (optional) is what every step costs outside its actions on
two ranks (setup, the loss all-reduce round).

``tp`` (optional, all blocks or none): what tensor parallelism splits of the
block, ``{"fwd", "bwd", "wgrad", "params", "activations", "allreduce",
"regions"}`` (:class:`~orgel.costs.mesh.TPSplit`; the roofline estimate
writes it), which :func:`orgel.costs.mesh.tp_costs` prices.

``cores`` (optional): the ranks share one host's processors, and this many of
them can compute at full speed at once (CPU ranks: the host's cores divided by
each rank's threads; the profiler writes it for CPU ranks). Block times are a
rank's with a core to itself; with more ranks than ``cores`` the simulator
slows each action by how many ranks compute during it over the cores
(:meth:`orgel.sim.compiled.CompiledPlan.shared_timeline`). Leave it out when
every rank has its own device.

``node`` (optional): ranks ``0..ranks-1`` share a node, and so on; a
message or all-reduce between ranks on different nodes takes ``node.link``
instead of ``link`` (``orgel plan --device`` writes it from the device's
interconnects).

``tied`` (optional) lists parameters that several blocks read (a token
embedding tied to the LM head): ``blocks`` (two or more block indices),
``nbytes`` (the parameter's bytes) and ``name``. Each such block's ``params``
includes the parameter; a stage holds it once, and so does a rank (stages on
one rank share it), so :func:`stage_costs` counts it once there. Stages on
different ranks each hold a copy whose gradients the runtime all-reduces
every step (see :func:`orgel.costs.tied.plan_tied_weights`).

:func:`stage_costs` sums blocks into stages and :func:`stage_graph` builds
the stage DAG (with edge bytes) for a split.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orgel.costs.mesh import TPSplit
from orgel.costs.tied import TiedGroup, check_group, tied_shared, tied_within
from orgel.schedule.costs import Costs, Link, StageCost
from orgel.schedule.ir import Edge, Stage, StageGraph, Value

_BLOCK_KEYS = ("fwd", "bwd", "wgrad", "params", "activations", "output", "temporary", "name",
               "nodes", "weight_kept", "input_saved", "output_unsaved", "split_input",
               "split_weight", "optimizer_ms", "tp")
#: Optional per-block times: given for every block or for none.
_OPTIONAL_TIMES = ("split_input", "split_weight", "optimizer_ms")
_TOP_KEYS = ("blocks", "edges", "link", "links", "memory_per_rank", "optimizer_factor",
             "optimizer_temporary", "action_overhead", "meta", "optimizer_ms_per_mib", "rows",
             "tied", "step_overhead", "node", "edge_grads", "cores")


class CostsFileError(ValueError):
    """A costs file (or dict) is malformed; the message says which field and how to fix it."""


@dataclass
class BlockCosts:
    """Per-block costs of one micro-batch and the block DAG (see the module docstring).

    ``wgrad[i]`` is the weight-grad half of ``bwd[i]`` (the input-grad half is
    the rest). ``optimizer_factor`` multiplies ``params`` for weights + grads +
    optimizer state. ``edges`` are ``(producer, consumer)`` block pairs; each
    carries the producer's ``output`` bytes. ``meta`` records where the table
    came from (graph hash, device, block-graph settings). ``tied`` lists the
    parameters several blocks read (:class:`~orgel.costs.tied.TiedGroup`).
    """

    fwd: list[float]
    bwd: list[float]
    wgrad: list[float]
    params: list[int]
    activations: list[int]
    output: list[int]
    temporary: list[int]
    edges: list[tuple[int, int]]
    link: Link = field(default_factory=Link)
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    memory_per_rank: int | None = None
    optimizer_factor: float = 4.0
    action_overhead: float = 0.0
    names: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    nodes: list[list[str]] = field(default_factory=list)  # fx node names per block, if known
    optimizer_temporary: float = 0.0  # optimizer step's extra bytes, as a multiple of params
    weight_kept: list[int] = field(default_factory=list)  # I -> W bytes per block (0 if empty)
    input_saved: list[int] = field(default_factory=list)  # saved inputs from blocks (0 if empty)
    output_unsaved: list[int] = field(default_factory=list)  # outputs it does not save
    optimizer_ms_per_mib: float = 0.0  # the optimizer step's time per MiB of parameters
    rows: int | None = None  # rows per micro-batch the table was measured at, if known
    tied: list[TiedGroup] = field(default_factory=list)  # parameters several blocks read
    split_input: list[float] = field(default_factory=list)  # I run apart, per block (or none)
    split_weight: list[float] = field(default_factory=list)  # W run apart, per block (or none)
    optimizer_ms: list[float] = field(default_factory=list)  # optimizer step, per block (or none)
    step_overhead: float | None = None  # ms per step outside the actions, on two ranks
    node_ranks: int | None = None  # ranks per node: pairs across nodes take node_link
    node_link: Link | None = None
    # bytes of edge (a, b)'s values that carry a gradient back (absent: all of output[a]);
    # a mask or a position table read by every layer carries none
    edge_grads: dict[tuple[int, int], int] = field(default_factory=dict)
    cores: float | None = None  # ranks that compute at once on a shared host (None: own devices)
    # what tensor parallelism splits, per block (or none): see orgel.costs.mesh
    tp_split: list[TPSplit] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.fwd)
        if n == 0:
            raise CostsFileError("costs have no blocks: give at least one entry in 'blocks'")
        for name in ("bwd", "wgrad", "params", "activations", "output", "temporary"):
            if len(getattr(self, name)) != n:
                raise CostsFileError(f"'{name}' has {len(getattr(self, name))} entries, "
                                     f"expected one per block ({n})")
        if not self.names:
            self.names = [f"block{i}" for i in range(n)]
        for name in ("weight_kept", "input_saved", "output_unsaved"):
            if not getattr(self, name):
                setattr(self, name, [0] * n)
            if len(getattr(self, name)) != n:
                raise CostsFileError(f"'{name}' has {len(getattr(self, name))} entries, "
                                     f"expected one per block ({n})")
        if any(u > a for u, a in zip(self.output_unsaved, self.activations, strict=True)):
            raise CostsFileError("a block's output_unsaved is part of its activations: it "
                                 "cannot exceed them")
        for name in _OPTIONAL_TIMES:
            got = getattr(self, name)
            if got and len(got) != n:
                raise CostsFileError(f"'{name}' has {len(got)} entries: give one per block "
                                     f"({n}) or leave it out of every block")
            if any(t < 0 for t in got):
                raise CostsFileError(f"'{name}' has a negative time; times are ms >= 0")
        if self.tp_split and len(self.tp_split) != n:
            raise CostsFileError(f"'tp' is given for {len(self.tp_split)} blocks: give it for "
                                 f"every block ({n}) or for none")
        if self.cores is not None and not self.cores > 0:
            raise CostsFileError(f"'cores' must be a positive number of ranks that compute at "
                                 f"once, got {self.cores!r}; leave it out when every rank has "
                                 "its own device")
        if bool(self.split_input) != bool(self.split_weight):
            raise CostsFileError("give 'split_input' and 'split_weight' together (a block's "
                                 "I and W measured apart) or neither")
        for i in range(n):
            if self.wgrad[i] > self.bwd[i] + 1e-12:
                raise CostsFileError(f"block {i}: wgrad ({self.wgrad[i]}) exceeds bwd "
                                     f"({self.bwd[i]}); the weight-grad half is part of it")
        if self.nodes and len(self.nodes) != n:
            raise CostsFileError(f"'nodes' has {len(self.nodes)} entries, expected one per block")
        self.edges = [(int(a), int(b)) for a, b in self.edges]
        known = set(self.edges)
        for (a, b), nbytes in self.edge_grads.items():
            if (a, b) not in known or nbytes < 0:
                raise CostsFileError(f"edge_grads names [{a}, {b}] with {nbytes} bytes: give "
                                     "bytes >= 0 for edges listed in 'edges'")
        for a, b in self.edges:
            if not (0 <= a < n and 0 <= b < n):
                raise CostsFileError(f"edge [{a}, {b}] names a block outside 0..{n - 1}")
            if a >= b:
                raise CostsFileError(
                    f"edge [{a}, {b}] goes backwards: number blocks in a topological "
                    "order so every edge goes from a lower to a higher index")
        if self.rows is not None and (isinstance(self.rows, bool) or not isinstance(self.rows, int)
                                      or self.rows < 1):
            raise CostsFileError(f"rows must be a positive integer (rows per micro-batch the "
                                 f"costs were measured at), got {self.rows!r}")
        if self.optimizer_factor < 1:
            raise CostsFileError(f"optimizer_factor must be >= 1 (weights alone), got "
                                 f"{self.optimizer_factor}")
        try:
            self.tied = [check_group(g, f"tied[{j}]", self.params)
                         for j, g in enumerate(self.tied)]
        except ValueError as exc:
            raise CostsFileError(str(exc)) from None

    @property
    def num_blocks(self) -> int:
        return len(self.fwd)

    @property
    def receives_posted_ahead(self) -> bool:
        """Profiled on the CPU, so run on gloo, which posts every receive of a step
        at its start into buffers kept across steps
        (:meth:`orgel.sim.compiled.CompiledPlan.posted_receive_bytes`)."""
        return str(self.meta.get("device", "")).startswith("cpu")

    def is_chain(self) -> bool:
        """Whether every edge joins consecutive blocks (a plain sequence)."""
        return all(b == a + 1 for a, b in self.edges)

    def static_bytes(self, block: int) -> int:
        """Weights + grads + optimizer state of one block."""
        return int(self.params[block] * self.optimizer_factor)

    def scaled(self, factor: float) -> BlockCosts:
        """Costs for micro-batches ``factor`` times as large (times and activations scale).

        The per-action overhead, links and parameters stay as they are; ``rows``
        scales too (None when the result is not a whole number of rows).
        """
        return BlockCosts(
            fwd=[t * factor for t in self.fwd], bwd=[t * factor for t in self.bwd],
            wgrad=[t * factor for t in self.wgrad], params=list(self.params),
            activations=[int(b * factor) for b in self.activations],
            output=[int(b * factor) for b in self.output],
            temporary=[int(b * factor) for b in self.temporary], edges=list(self.edges),
            link=self.link, links=dict(self.links), memory_per_rank=self.memory_per_rank,
            optimizer_factor=self.optimizer_factor, action_overhead=self.action_overhead,
            names=list(self.names), meta=dict(self.meta), nodes=[list(n) for n in self.nodes],
            optimizer_temporary=self.optimizer_temporary,
            weight_kept=[int(b * factor) for b in self.weight_kept],
            input_saved=[int(b * factor) for b in self.input_saved],
            output_unsaved=[int(b * factor) for b in self.output_unsaved],
            optimizer_ms_per_mib=self.optimizer_ms_per_mib, rows=_scaled_rows(self.rows, factor),
            tied=list(self.tied),  # parameter bytes do not scale with rows
            split_input=[t * factor for t in self.split_input],
            split_weight=[t * factor for t in self.split_weight],
            optimizer_ms=list(self.optimizer_ms),  # the optimizer works on parameters
            step_overhead=self.step_overhead, node_ranks=self.node_ranks,
            node_link=self.node_link,
            edge_grads={e: int(b * factor) for e, b in self.edge_grads.items()},
            cores=self.cores, tp_split=[t.scaled(factor) for t in self.tp_split])

    # -- JSON --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        blocks = [
            {"name": self.names[i], "fwd": self.fwd[i], "bwd": self.bwd[i],
             "wgrad": self.wgrad[i], "params": self.params[i],
             "activations": self.activations[i], "output": self.output[i],
             "temporary": self.temporary[i], "weight_kept": self.weight_kept[i],
             "input_saved": self.input_saved[i], "output_unsaved": self.output_unsaved[i]}
            for i in range(self.num_blocks)
        ]
        for i, nodes in enumerate(self.nodes):
            blocks[i]["nodes"] = list(nodes)
        for key in _OPTIONAL_TIMES:
            for i, t in enumerate(getattr(self, key)):
                blocks[i][key] = t
        for i, split in enumerate(self.tp_split):
            blocks[i]["tp"] = split.to_dict()
        return {
            "blocks": blocks,
            "edges": [list(e) for e in self.edges],
            "link": {"latency": self.link.latency, "per_mib": self.link.per_mib},
            "links": [[s, d, {"latency": lk.latency, "per_mib": lk.per_mib}]
                      for (s, d), lk in sorted(self.links.items())],
            "memory_per_rank": self.memory_per_rank,
            "optimizer_factor": self.optimizer_factor,
            "optimizer_temporary": self.optimizer_temporary,
            "action_overhead": self.action_overhead,
            "optimizer_ms_per_mib": self.optimizer_ms_per_mib,
            **({} if self.rows is None else {"rows": self.rows}),
            **({"tied": [g.to_dict() for g in self.tied]} if self.tied else {}),
            **({"edge_grads": [[a, b, n] for (a, b), n in sorted(self.edge_grads.items())]}
               if self.edge_grads else {}),
            **({} if self.step_overhead is None else {"step_overhead": self.step_overhead}),
            **({} if self.node_ranks is None or self.node_link is None else
               {"node": {"ranks": self.node_ranks,
                         "link": {"latency": self.node_link.latency,
                                  "per_mib": self.node_link.per_mib}}}),
            **({} if self.cores is None else {"cores": self.cores}),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Any) -> BlockCosts:
        """Parse the costs-file dict; raises :class:`CostsFileError` naming the bad field."""
        if not isinstance(data, dict):
            raise CostsFileError("a costs file must be a JSON object with a 'blocks' list")
        unknown = sorted(set(data) - set(_TOP_KEYS))
        if unknown:
            raise CostsFileError(f"unknown field(s) {unknown}: allowed are {list(_TOP_KEYS)}")
        blocks = data.get("blocks")
        if not isinstance(blocks, list) or not blocks:
            raise CostsFileError("'blocks' must be a non-empty list of objects with 'fwd' "
                                 "and 'bwd' times (ms)")
        cols: dict[str, list[Any]] = {k: [] for k in _BLOCK_KEYS}
        for i, b in enumerate(blocks):
            if not isinstance(b, dict):
                raise CostsFileError(f"blocks[{i}] must be an object, got {type(b).__name__}")
            bad = sorted(set(b) - set(_BLOCK_KEYS))
            if bad:
                raise CostsFileError(f"blocks[{i}] has unknown field(s) {bad}: allowed are "
                                     f"{list(_BLOCK_KEYS)}")
            for key in ("fwd", "bwd"):
                if key not in b:
                    raise CostsFileError(f"blocks[{i}] is missing '{key}' (time in ms)")
            fwd = _number(b["fwd"], f"blocks[{i}].fwd")
            bwd = _number(b["bwd"], f"blocks[{i}].bwd")
            wgrad = _number(b.get("wgrad", bwd / 2), f"blocks[{i}].wgrad")
            if wgrad > bwd:
                raise CostsFileError(f"blocks[{i}].wgrad ({wgrad}) exceeds bwd ({bwd}): the "
                                     "weight-grad half is part of the full backward")
            cols["fwd"].append(fwd)
            cols["bwd"].append(bwd)
            cols["wgrad"].append(wgrad)
            for key in ("params", "activations", "output", "temporary", "weight_kept",
                        "input_saved", "output_unsaved"):
                cols[key].append(int(_number(b.get(key, 0), f"blocks[{i}].{key}")))
            for key in _OPTIONAL_TIMES:
                if key in b:
                    cols[key].append(_number(b[key], f"blocks[{i}].{key}"))
            if "tp" in b:
                try:
                    cols["tp"].append(TPSplit.from_dict(b["tp"], f"blocks[{i}].tp"))
                except ValueError as exc:
                    raise CostsFileError(str(exc)) from None
            cols["name"].append(str(b.get("name", f"block{i}")))
            nodes = b.get("nodes", [])
            if not isinstance(nodes, list) or not all(isinstance(x, str) for x in nodes):
                raise CostsFileError(f"blocks[{i}].nodes must be a list of graph node names")
            cols["nodes"].append(nodes)
        n = len(blocks)
        edges_data = data.get("edges")
        if edges_data is None:
            edges = [(i, i + 1) for i in range(n - 1)]
        else:
            if not isinstance(edges_data, list):
                raise CostsFileError("'edges' must be a list of [producer, consumer] pairs")
            edges = []
            for j, e in enumerate(edges_data):
                if (not isinstance(e, (list, tuple)) or len(e) != 2
                        or not all(isinstance(x, int) and not isinstance(x, bool) for x in e)):
                    raise CostsFileError(f"edges[{j}] must be a pair of block indices like "
                                         f"[0, 1], got {e!r}")
                edges.append((e[0], e[1]))
        link = _link(data.get("link", {}), "link")
        links: dict[tuple[int, int], Link] = {}
        for j, item in enumerate(data.get("links", []) or []):
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise CostsFileError(f"links[{j}] must be [src_rank, dst_rank, "
                                     "{latency, per_mib}]")
            links[(int(item[0]), int(item[1]))] = _link(item[2], f"links[{j}]")
        memory = data.get("memory_per_rank")
        if memory is not None:
            memory = int(_number(memory, "memory_per_rank"))
        return cls(
            fwd=cols["fwd"], bwd=cols["bwd"], wgrad=cols["wgrad"], params=cols["params"],
            activations=cols["activations"], output=cols["output"],
            temporary=cols["temporary"], edges=edges, link=link, links=links,
            memory_per_rank=memory,
            optimizer_factor=_number(data.get("optimizer_factor", 4.0), "optimizer_factor"),
            action_overhead=_number(data.get("action_overhead", 0.0), "action_overhead"),
            optimizer_temporary=_number(data.get("optimizer_temporary", 0.0),
                                        "optimizer_temporary"),
            optimizer_ms_per_mib=_number(data.get("optimizer_ms_per_mib", 0.0),
                                         "optimizer_ms_per_mib"),
            weight_kept=cols["weight_kept"], input_saved=cols["input_saved"],
            output_unsaved=cols["output_unsaved"],
            names=cols["name"], meta=dict(data.get("meta") or {}),
            nodes=cols["nodes"] if any(cols["nodes"]) else [], rows=data.get("rows"),
            tied=_tied_list(data.get("tied", [])),
            split_input=cols["split_input"], split_weight=cols["split_weight"],
            optimizer_ms=cols["optimizer_ms"],
            step_overhead=(None if data.get("step_overhead") is None
                           else _number(data["step_overhead"], "step_overhead")),
            **_node(data.get("node")),
            edge_grads=_edge_grads(data.get("edge_grads", [])),
            cores=None if data.get("cores") is None else _number(data["cores"], "cores"),
            tp_split=cols["tp"],
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BlockCosts:
        """Read a costs file; raises :class:`CostsFileError` with the file name and problem."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise CostsFileError(f"cannot read costs file {path}: {exc.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CostsFileError(f"costs file {path} is not valid JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except CostsFileError as exc:
            raise CostsFileError(f"costs file {path}: {exc}") from None


def _scaled_rows(rows: int | None, factor: float) -> int | None:
    """``rows x factor`` when it is a whole number of rows, else None."""
    if rows is None:
        return None
    exact = rows * factor
    whole = round(exact)
    return whole if whole >= 1 and abs(exact - whole) < 1e-6 else None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CostsFileError(f"{where} must be a finite number, got {value!r}")
    if value < 0:
        raise CostsFileError(f"{where} must not be negative, got {value!r}")
    return float(value)


def _tied_list(data: Any) -> list[Any]:
    if not isinstance(data, list):
        raise CostsFileError("'tied' must be a list of {\"blocks\": [0, 11], \"nbytes\": N, "
                             "\"name\": \"...\"} objects (blocks that read one parameter)")
    return data


def _edge_grads(data: Any) -> dict[tuple[int, int], int]:
    if not isinstance(data, list) or not all(
            isinstance(x, list) and len(x) == 3 and all(isinstance(v, int) for v in x)
            for x in data):
        raise CostsFileError("'edge_grads' must be a list of [producer, consumer, bytes]")
    return {(a, b): n for a, b, n in data}


def _node(data: Any) -> dict[str, Any]:
    """The ``node`` entry as BlockCosts' ``node_ranks`` and ``node_link`` (empty: none)."""
    if data is None:
        return {}
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or set(data) - {"ranks", "link"} or isinstance(ranks, bool)
            or not isinstance(ranks, int) or ranks < 1):
        raise CostsFileError("'node' must be {\"ranks\": ranks per node (>= 1), \"link\": "
                             f"{{\"latency\": ms, \"per_mib\": ms}}}}, got {data!r}")
    return {"node_ranks": ranks, "node_link": _link(data.get("link", {}), "node.link")}


def _link(data: Any, where: str) -> Link:
    if not isinstance(data, dict) or set(data) - {"latency", "per_mib"}:
        raise CostsFileError(f"{where} must be an object {{\"latency\": ms, \"per_mib\": ms}}, "
                             f"got {data!r}")
    return Link(latency=_number(data.get("latency", 0.0), f"{where}.latency"),
                per_mib=_number(data.get("per_mib", 0.0), f"{where}.per_mib"))


# -- from blocks to stages ---------------------------------------------------------


def stage_cost(bc: BlockCosts, blocks: list[int] | range, *, split: bool = False,
               shared: int = 0) -> StageCost:
    """One stage made of ``blocks``: times add up, temporary is the largest block's.

    ``split``: the schedule splits the backward into ``I`` and ``W``. Then a
    stage takes its blocks' halves as measured apart (``split_input`` and
    ``split_weight``, when the table has them), and ``weight_kept`` is what
    its ``I`` keeps for ``W`` (alive from ``I`` to ``W``). A stage that no
    other stage feeds has no input gradient to compute: its ``W`` is the whole
    backward and its ``I`` only hands over the gradients ``W`` starts from: the
    gradients of its outputs, all it keeps for ``W``.
    A tied parameter counts once however many of ``blocks`` read it;
    ``shared``: parameter bytes another stage on the same rank already holds
    (see :func:`orgel.costs.tied.tied_shared`), left out here.
    """
    inside = set(blocks)
    entered = {b for a, b in bc.edges if b in inside and a not in inside}
    fed = bool(entered)
    freed = 0  # outputs that neither their block nor, inside the stage, a consumer saves
    if any(bc.output_unsaved):
        spare, consumers = unsaved_outputs(bc)
        freed = sum(spare[b] for b in blocks if consumers[b] and consumers[b] <= inside)
    params = sum(bc.params[b] for b in blocks) - tied_within(bc, blocks) - shared
    params, grads, optimizer = static_parts(params, bc.optimizer_factor)
    bwd = sum(bc.bwd[b] for b in blocks)
    weight = sum(bc.wgrad[b] for b in blocks) if fed else bwd
    if split and fed and bc.split_input:
        weight = sum(bc.split_weight[b] for b in blocks)
        bwd = sum(bc.split_input[b] for b in blocks) + weight
    return StageCost(
        fwd=sum(bc.fwd[b] for b in blocks), bwd=bwd, bwd_weight=weight,
        params=params, grads=grads, optimizer=optimizer,
        activations=sum(bc.activations[b] + (bc.input_saved[b] if b in entered else 0)
                        for b in blocks) - freed,
        weight_kept=(0 if not split else sum(bc.weight_kept[b] for b in blocks) if fed
                     else _outgoing(bc, inside)),
        temporary=max((bc.temporary[b] for b in blocks), default=0),
        grad_overlap=max(0, grad_overlap(bc, blocks, grads) - freed),
    )


def unsaved_outputs(bc: BlockCosts) -> tuple[list[int], list[set[int]]]:
    """Per block: its outputs' bytes that no one saves, and the blocks consuming them.

    A block's ``output_unsaved`` bytes stay alive after the forward only as far
    as a consumer saves its inputs; at most the consumers' ``input_saved`` of
    them is (their saved inputs may come from other blocks too). So a stage
    whose blocks consume all of a block's outputs keeps
    ``output_unsaved - min(output_unsaved, sum of the consumers' input_saved)``
    bytes less than its blocks' ``activations`` add up to: the first list.
    A block no other block reads (a model output) keeps its outputs.
    """
    consumers: list[set[int]] = [set() for _ in range(bc.num_blocks)]
    for a, b in bc.edges:
        consumers[a].add(b)
    spare = [max(0, bc.output_unsaved[b] - sum(bc.input_saved[c] for c in consumers[b]))
             if consumers[b] else 0 for b in range(bc.num_blocks)]
    return spare, consumers


def grad_overlap(bc: BlockCosts, blocks: list[int] | range, grads: int) -> int:
    """Bytes of a stage's activations and ``grads`` never alive together in its backward.

    Autograd runs a backward in the reverse order of the forward (blocks in
    index order) and frees each op's saved tensors once it has run, as it
    makes the gradients of the weights it used. While block ``k`` runs, the
    stage holds at most the gradients of blocks ``>= k`` and the activations
    of blocks ``<= k`` (block ``k`` counted both ways); the peak over ``k``
    is at most activations + gradients, and the difference is the overlap.
    A block's gradients are taken as its whole parameter bytes (a tied
    weight counted in every block that reads it), which only lowers the overlap.
    """
    order = sorted(blocks)
    acts = [bc.activations[b] for b in order]
    made = [bc.params[b] for b in order]
    later, peak = sum(made), 0
    earlier = 0
    for a, g in zip(acts, made, strict=True):
        earlier += a
        peak = max(peak, later + earlier)
        later -= g
    return max(0, sum(acts) + grads - peak)


def _outgoing(bc: BlockCosts, inside: set[int]) -> int:
    """Bytes of the outputs of ``inside`` that blocks outside it read (each counted once)."""
    return sum(bc.output[a] for a in {a for a, b in bc.edges if a in inside and b not in inside})


def static_parts(params: int, factor: float) -> tuple[int, int, int]:
    """``(params, grads, optimizer)`` bytes whose sum is ``params x factor``."""
    static = int(params * factor)
    grads = min(params, static - params)
    return params, grads, static - params - grads


def stage_costs(bc: BlockCosts, stage_blocks: list[list[int]] | list[range], *,
                split: bool = False, placement: list[tuple[int, ...]] | None = None) -> Costs:
    """Sum blocks into stages: ``stage_blocks[s]`` lists the blocks of stage ``s``.

    ``placement`` (the plan's, optional) lets a tied parameter count once per
    rank (:func:`orgel.costs.tied.tied_shared`); without it, once per stage.
    """
    shared = (tied_shared(bc, stage_blocks, placement) if placement is not None
              else [0] * len(stage_blocks))
    return Costs(
        stages=[stage_cost(bc, stage_blocks[s], split=split, shared=shared[s])
                for s in range(len(stage_blocks))],
        link=bc.link, links=dict(bc.links), action_overhead=bc.action_overhead,
        memory_per_rank=bc.memory_per_rank, node_ranks=bc.node_ranks, node_link=bc.node_link,
        edge_grad_bytes=edge_grad_bytes(bc, stage_blocks), cores=bc.cores,
    )


def edge_grad_bytes(bc: BlockCosts, stage_blocks: list[list[int]] | list[range]
                    ) -> list[int] | None:
    """Bytes each edge of :func:`stage_graph` carries back as gradients (None: all of them).

    A producing block's share is the most that any of its edges into the
    consuming stage carries back (``bc.edge_grads``; the whole output without
    an entry): its values that need a gradient, once per stage as in
    :func:`stage_graph`.
    """
    if not bc.edge_grads:
        return None
    owner = [0] * bc.num_blocks
    for s, blocks in enumerate(stage_blocks):
        for b in blocks:
            owner[b] = s
    grads: dict[tuple[int, int], dict[int, int]] = {}
    for a, b in bc.edges:
        sa, sb = owner[a], owner[b]
        if sa != sb:
            per = grads.setdefault((sa, sb), {})
            per[a] = max(per.get(a, 0), min(bc.output[a], bc.edge_grads.get((a, b), bc.output[a])))
    return [sum(per.values()) for _, per in sorted(grads.items())]


def stage_graph(bc: BlockCosts, stage_blocks: list[list[int]] | list[range]) -> StageGraph:
    """The stage DAG of a split: one edge per stage pair, one value per producing block.

    A block's output goes to another stage once, however many of that stage's
    blocks read it; it carries a gradient (``Value.grad``) unless none of its
    edges into that stage sends one back (``bc.edge_grads``, as in
    :func:`edge_grad_bytes`). Raises ValueError when the split leaves a block out, puts
    one in two stages or makes a cycle between stages.
    """
    owner = [-1] * bc.num_blocks
    for s, blocks in enumerate(stage_blocks):
        for b in blocks:
            if owner[b] != -1:
                raise ValueError(f"block {b} is in stages {owner[b]} and {s}")
            owner[b] = s
    missing = [b for b, s in enumerate(owner) if s == -1]
    if missing:
        raise ValueError(f"blocks {missing[:10]} are in no stage")
    values: dict[tuple[int, int], dict[int, int]] = {}
    grads: dict[tuple[int, int], set[int]] = {}  # blocks whose value sends a gradient back
    for a, b in bc.edges:
        sa, sb = owner[a], owner[b]
        if sa != sb:
            values.setdefault((sa, sb), {})[a] = bc.output[a]
            if (a, b) not in bc.edge_grads or bc.edge_grads[(a, b)] > 0:
                grads.setdefault((sa, sb), set()).add(a)
    stages = tuple(Stage(name=f"stage{s}", blocks=tuple(blocks),
                         nodes=tuple(n for b in sorted(blocks) for n in bc.nodes[b])
                         if bc.nodes else ())
                   for s, blocks in enumerate(stage_blocks))
    edges = tuple(
        Edge(sa, sb, tuple(Value(f"block{a}", nbytes, a in grads.get((sa, sb), ()))
                           for a, nbytes in sorted(vals.items())))
        for (sa, sb), vals in sorted(values.items())
    )
    graph = StageGraph(stages, edges)
    graph.check()
    return graph


#: Bytes of the scalars a rank's step holds to its end (see :func:`optimizer_peak`).
STEP_SCALARS = 512


def optimizer_peak(bc: BlockCosts, costs: Costs, placement: list[tuple[int, ...]],
                   num_ranks: int) -> list[int]:
    """Bytes per rank at the step's end: static bytes plus the larger of two temporaries.

    The data-parallel all-reduce sums a flat copy of a replicated stage's
    gradients (freed once copied back), then the optimizer step makes its own
    temporaries (``optimizer_temporary`` x params; 0 when unknown). Activations
    are gone by then, so this is a floor under the simulated peak, not an
    addition to it.
    """
    # plus the step's running loss and its all-reduced summary (0-dim tensors:
    # 512 bytes covers them, the CUDA allocator's smallest block)
    static, step, flat = [STEP_SCALARS] * num_ranks, [0] * num_ranks, [0] * num_ranks
    for s, ranks in enumerate(placement):
        st = costs.stages[s]
        for r in ranks:
            static[r] += st.static_bytes
            step[r] += int(bc.optimizer_temporary * st.params)
            if len(ranks) > 1:
                flat[r] += st.grad_bytes
    return [a + max(b, c) for a, b, c in zip(static, step, flat, strict=True)]


def chain_split(bounds: list[int] | tuple[int, ...], num_blocks: int) -> list[range]:
    """Stages of a linear split: ``bounds`` are the first block of stages 1..n-1."""
    points = [0, *bounds, num_blocks]
    return [range(points[i], points[i + 1]) for i in range(len(points) - 1)]
