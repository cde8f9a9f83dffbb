"""The block cost table: per-block time and memory, and the costs file it reads and writes.

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

An edge ``[a, b]`` carries block ``a``'s ``output`` bytes, or the bytes ``edge_bytes``
(optional, ``[[a, b, bytes], ...]``) gives it: the values of ``a`` that ``b`` reads (a
layer reads the mask the embedding's block makes, not its hidden state). ``wgrad``
defaults to half of ``bwd``. ``rows`` (optional) is the micro-batch size, in rows along
the batch dimension, that the times and activation bytes were measured at: ``orgel plan
--costs FILE --batch B`` needs it to scale the table to other micro-batch sizes
(:meth:`BlockCosts.scaled`).
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

``recompute`` (optional, all blocks or none): what ``"layer"`` and ``"selective"``
recompute keep, rebuild and run again of the block, ``{"layer_kept", "layer_rebuilt",
"layer_fwd", "selective_kept", "selective_rebuilt", "selective_fwd"}``
(:class:`~orgel.costs.recompute.BlockRecompute`; the profiler and the roofline estimate
write it from the capture); without it those policies are priced as a stage's whole
recompute.

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
one rank share it), so :func:`~orgel.costs.blocks.stage_costs` counts it once
there. Stages on different ranks each hold a copy whose gradients the runtime
all-reduces every step (see :func:`orgel.costs.tied.plan_tied_weights`).

:func:`orgel.costs.blocks.stage_costs` sums blocks into stages and
:func:`orgel.costs.blocks.stage_graph` builds the stage DAG for a split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orgel.costs.fields import (
    BLOCK_KEYS,
    OPTIONAL_TIMES,
    TOP_KEYS,
    CostsFileError,
    read_edge_grads,
    read_link,
    read_node,
    read_number,
    read_tied,
)
from orgel.costs.mesh import TPSplit
from orgel.costs.recompute import BlockRecompute
from orgel.costs.tied import TiedGroup, check_group
from orgel.schedule.costs import Link


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
    # bytes of edge (a, b)'s values (absent: all of output[a]): a layer reads the mask and
    # the position table of the embedding's block, not the hidden state it also outputs
    edge_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    cores: float | None = None  # ranks that compute at once on a shared host (None: own devices)
    # what tensor parallelism splits, per block (or none): see orgel.costs.mesh
    tp_split: list[TPSplit] = field(default_factory=list)
    # what "layer" and "selective" recompute keep and run again, per block (or none: priced
    # as a stage's whole recompute); see orgel.costs.recompute
    recompute: list[BlockRecompute] = field(default_factory=list)

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
        for name in OPTIONAL_TIMES:
            got = getattr(self, name)
            if got and len(got) != n:
                raise CostsFileError(f"'{name}' has {len(got)} entries: give one per block "
                                     f"({n}) or leave it out of every block")
            if any(t < 0 for t in got):
                raise CostsFileError(f"'{name}' has a negative time; times are ms >= 0")
        if self.tp_split and len(self.tp_split) != n:
            raise CostsFileError(f"'tp' is given for {len(self.tp_split)} blocks: give it for "
                                 f"every block ({n}) or for none")
        if self.recompute and len(self.recompute) != n:
            raise CostsFileError(f"'recompute' is given for {len(self.recompute)} blocks: give "
                                 f"it for every block ({n}) or for none")
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
        for key in ("edge_grads", "edge_bytes"):
            for (a, b), nbytes in getattr(self, key).items():
                if (a, b) not in known or nbytes < 0:
                    raise CostsFileError(f"{key} names [{a}, {b}] with {nbytes} bytes: give "
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
            edge_bytes={e: int(b * factor) for e, b in self.edge_bytes.items()},
            cores=self.cores, tp_split=[t.scaled(factor) for t in self.tp_split],
            recompute=[r.scaled(factor) for r in self.recompute])

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
        for key in OPTIONAL_TIMES:
            for i, t in enumerate(getattr(self, key)):
                blocks[i][key] = t
        for i, split in enumerate(self.tp_split):
            blocks[i]["tp"] = split.to_dict()
        for i, facts in enumerate(self.recompute):
            blocks[i]["recompute"] = facts.to_dict()
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
            **({"edge_bytes": [[a, b, n] for (a, b), n in sorted(self.edge_bytes.items())]}
               if self.edge_bytes else {}),
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
        unknown = sorted(set(data) - set(TOP_KEYS))
        if unknown:
            raise CostsFileError(f"unknown field(s) {unknown}: allowed are {list(TOP_KEYS)}")
        blocks = data.get("blocks")
        if not isinstance(blocks, list) or not blocks:
            raise CostsFileError("'blocks' must be a non-empty list of objects with 'fwd' "
                                 "and 'bwd' times (ms)")
        cols: dict[str, list[Any]] = {k: [] for k in BLOCK_KEYS}
        for i, b in enumerate(blocks):
            if not isinstance(b, dict):
                raise CostsFileError(f"blocks[{i}] must be an object, got {type(b).__name__}")
            bad = sorted(set(b) - set(BLOCK_KEYS))
            if bad:
                raise CostsFileError(f"blocks[{i}] has unknown field(s) {bad}: allowed are "
                                     f"{list(BLOCK_KEYS)}")
            for key in ("fwd", "bwd"):
                if key not in b:
                    raise CostsFileError(f"blocks[{i}] is missing '{key}' (time in ms)")
            fwd = read_number(b["fwd"], f"blocks[{i}].fwd")
            bwd = read_number(b["bwd"], f"blocks[{i}].bwd")
            wgrad = read_number(b.get("wgrad", bwd / 2), f"blocks[{i}].wgrad")
            if wgrad > bwd:
                raise CostsFileError(f"blocks[{i}].wgrad ({wgrad}) exceeds bwd ({bwd}): the "
                                     "weight-grad half is part of the full backward")
            cols["fwd"].append(fwd)
            cols["bwd"].append(bwd)
            cols["wgrad"].append(wgrad)
            for key in ("params", "activations", "output", "temporary", "weight_kept",
                        "input_saved", "output_unsaved"):
                cols[key].append(int(read_number(b.get(key, 0), f"blocks[{i}].{key}")))
            for key in OPTIONAL_TIMES:
                if key in b:
                    cols[key].append(read_number(b[key], f"blocks[{i}].{key}"))
            if "tp" in b:
                try:
                    cols["tp"].append(TPSplit.from_dict(b["tp"], f"blocks[{i}].tp"))
                except ValueError as exc:
                    raise CostsFileError(str(exc)) from None
            if "recompute" in b:
                try:
                    cols["recompute"].append(BlockRecompute.from_dict(
                        b["recompute"], f"blocks[{i}].recompute"))
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
        link = read_link(data.get("link", {}), "link")
        links: dict[tuple[int, int], Link] = {}
        for j, item in enumerate(data.get("links", []) or []):
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise CostsFileError(f"links[{j}] must be [src_rank, dst_rank, "
                                     "{latency, per_mib}]")
            links[(int(item[0]), int(item[1]))] = read_link(item[2], f"links[{j}]")
        memory = data.get("memory_per_rank")
        if memory is not None:
            memory = int(read_number(memory, "memory_per_rank"))
        return cls(
            fwd=cols["fwd"], bwd=cols["bwd"], wgrad=cols["wgrad"], params=cols["params"],
            activations=cols["activations"], output=cols["output"],
            temporary=cols["temporary"], edges=edges, link=link, links=links,
            memory_per_rank=memory,
            optimizer_factor=read_number(data.get("optimizer_factor", 4.0), "optimizer_factor"),
            action_overhead=read_number(data.get("action_overhead", 0.0), "action_overhead"),
            optimizer_temporary=read_number(data.get("optimizer_temporary", 0.0),
                                        "optimizer_temporary"),
            optimizer_ms_per_mib=read_number(data.get("optimizer_ms_per_mib", 0.0),
                                         "optimizer_ms_per_mib"),
            weight_kept=cols["weight_kept"], input_saved=cols["input_saved"],
            output_unsaved=cols["output_unsaved"],
            names=cols["name"], meta=dict(data.get("meta") or {}),
            nodes=cols["nodes"] if any(cols["nodes"]) else [], rows=data.get("rows"),
            tied=read_tied(data.get("tied", [])),
            split_input=cols["split_input"], split_weight=cols["split_weight"],
            optimizer_ms=cols["optimizer_ms"],
            step_overhead=(None if data.get("step_overhead") is None
                           else read_number(data["step_overhead"], "step_overhead")),
            **read_node(data.get("node")),
            edge_grads=read_edge_grads(data.get("edge_grads", [])),
            edge_bytes=read_edge_grads(data.get("edge_bytes", []), "edge_bytes"),
            cores=None if data.get("cores") is None else read_number(data["cores"], "cores"),
            tp_split=cols["tp"], recompute=cols["recompute"],
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
