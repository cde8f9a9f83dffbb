"""Profile a workload into a block cost table: capture, coarsen, measure, cache on disk.

``profile_workload("model.py:fn", microbatches=8, blocks=32)`` captures one
micro-batch's forward, coarsens it into about ``blocks`` blocks, splits every
block into its own module, measures each (:mod:`orgel.profile.blocks`) with a
progress bar, measures the link between two ranks over the real backend
(:mod:`orgel.profile.links`), the runtime's fixed costs per action and per
step (:mod:`orgel.profile.overhead`) and returns a :class:`BlockCosts`. Results are
cached under ``$ORGEL_CACHE`` (default ``~/.cache/orgel``), keyed by the graph's
hash, the device, the dtype, the micro-batch shapes and the intra-op thread
count, so a second run is quick: it times the blocks in sequence briefly and
measures again only if they now take more than ``recheck`` (25%) off what the
table recorded (a table timed under another load is stale;
:func:`~orgel.profile.measure.drifted`). Blocks are
timed in interleaved rounds (:mod:`orgel.profile.measure`), with
``threads`` intra-op threads (default 1, what :func:`orgel.launch.spawn.spawn` gives each rank;
:func:`rank_threads` is what a local group of ``ranks`` gives each), since a
block's time depends on it and ranks train with few threads each. The table
also carries what the planner's prediction needs beyond the blocks' own
times: ``step_overhead`` (ms per step), ``optimizer_ms`` (each block's
optimizer step) and ``split_input``/``split_weight`` (each block's ``I`` and
``W`` as measured apart, ms). ``meta`` records what is needed to rebuild the
same blocks (``target_blocks``, ``num_blocks``, ``graph_hash``).
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

import torch

from orgel.costs.blocks import BlockCosts
from orgel.launch.devices import profiling_device
from orgel.profile.cache import _cached, _store, cache_key, graph_hash
from orgel.profile.measure import OPTIMIZER_COPY_LIMIT, BlockRun, drifted, measure_table
from orgel.profile.memory import optimizer_temporary
from orgel.profile.timing import intra_op_threads
from orgel.schedule.costs import Link
from orgel.workload import microbatch_rows

#: Bump when the measurement changes, so stale cached tables are not reused.
PROFILE_VERSION = 19

#: A cached table is re-measured when its blocks now run this much faster or slower.
RECHECK = 0.25


def rank_threads(ranks: int) -> int:
    """Intra-op threads each of ``ranks`` local ranks trains with: one, since they are
    forked (:func:`orgel.launch.forks.fork_threads`); ``ranks`` is kept for callers."""
    return 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def link_world(device: torch.device, ranks: int, *, gpus: int | None = None,
               cores: int | None = None) -> tuple[str, int]:
    """``(backend, world)`` to measure the links of a ``ranks``-rank plan with on this host.

    On CUDA with at least two GPUs: NCCL between ``min(ranks, GPUs)`` of them
    (the links the runtime will use, NVLink or PCIe per pair). Otherwise gloo
    between ``min(ranks, cores)`` CPU processes: more processes than cores
    would measure the scheduler, not the link. Never fewer than 2.
    """
    if device.type == "cuda":
        gpus = torch.cuda.device_count() if gpus is None else gpus
        if gpus >= 2:
            return "nccl", max(2, min(ranks, gpus))
    cores = _cores() if cores is None else cores
    return "gloo", max(2, min(ranks, cores))


def shared_cores(device: torch.device, threads: int) -> float | None:
    """How many ranks of ``threads`` threads compute at full speed at once (None: all).

    CPU ranks share this host's cores; blocks are timed by their CPU time
    (:func:`orgel.profile.timing.interleaved`), a rank's with a core to itself,
    and the simulator spreads a step's compute over the cores when more
    ranks than this compute (:func:`orgel.sim.sharing.shared_step`). CUDA ranks
    that outnumber the GPUs share them (:mod:`orgel.launch.devices`): as many
    compute at once as there are GPUs, the others' kernels wait their turn.
    """
    if device.type == "cuda":
        return float(max(1, torch.cuda.device_count()))
    if device.type != "cpu":
        return None
    return max(1, _cores()) / max(1, threads)


def link_costs(*, ranks: int = 2, backend: str = "gloo", use_cache: bool = True,
               tolerance: float = 0.2) -> tuple[Link, dict[tuple[int, int], Link]]:
    """The measured links between ``ranks`` local ranks of this host and backend (cached).

    Every ordered pair is measured (:func:`orgel.profile.links.measure_links`);
    returns the default link (the median over pairs) and the pairs whose 1 MiB
    message differs from it by more than ``tolerance`` (usually none on one host:
    then a single link describes every pair). Cached by host, backend and ``ranks``.
    """
    from orgel.profile.links import measure_links, summarize_links

    key = cache_key(host=socket.gethostname(), backend=backend, world=ranks,
                    torch=torch.__version__)
    data = _cached("links", key) if use_cache else None
    if data is None:
        measured = measure_links(ranks, backend=backend)
        data = {"pairs": [[a, b, lk.latency, lk.per_mib] for (a, b), lk in measured.items()]}
        _store("links", key, data)
    pairs = {(int(a), int(b)): Link(latency=float(lat), per_mib=float(mib))
             for a, b, lat, mib in data["pairs"]}
    return summarize_links(pairs, tolerance=tolerance)


def runtime_overhead(link: Link, *, use_cache: bool = True) -> tuple[float, float]:
    """The runtime's ``(per action, per step)`` overhead on this host (ms, see :mod:`.overhead`).

    A property of the host and orgel's runtime, not of the model: cached (under
    :func:`orgel.profile.cache.cache_dir`) per host, torch and orgel version and the link
    it was fitted with, so it is measured once, not again for every model planned.
    """
    import orgel
    from orgel.profile.overhead import measure_overhead

    key = cache_key(host=socket.gethostname(), torch=torch.__version__,
                    orgel=orgel.__version__, link=[link.latency, link.per_mib])
    data = _cached("overhead", key) if use_cache else None
    if data is None or not isinstance(data.get("fitted"), list):
        data = {"fitted": list(measure_overhead(link))}
        _store("overhead", key, data)
    action, step = data["fitted"]
    return float(action), float(step)


def profile_workload(workload: Any, *, microbatches: int, blocks: int = 32,
                     device: str | None = None, warmup: int = 3, repeats: int = 5,
                     link: bool = True, use_cache: bool = True, progress: bool = True,
                     optimizer_factor: float = 4.0, threads: int = 1, ranks: int = 2,
                     recheck: float | None = RECHECK) -> BlockCosts:
    """Measure ``workload`` (``"file.py:fn"`` or a Workload) into a :class:`BlockCosts`.

    ``device`` defaults to :func:`orgel.launch.devices.profiling_device` (``cuda`` when
    present, else ``cpu``). ``link=False``
    skips the link benchmark (zero-cost links). ``ranks``: the links of every
    pair among that many local ranks are measured, as far as this host has
    GPUs (NCCL) or cores (gloo) for them (:func:`link_world`). ``threads``: intra-op threads
    to time with, the count each rank will train with. ``recheck``: see
    :func:`profile_graph`. Raises ValueError (WorkloadError,
    CaptureError's message) on a workload that cannot be profiled.
    """
    w, opgraph = capture_workload(workload, microbatches)
    costs = profile_graph(w, opgraph, microbatches=microbatches, blocks=blocks, device=device,
                          warmup=warmup, repeats=repeats, link=link, use_cache=use_cache,
                          progress=progress, optimizer_factor=optimizer_factor,
                          threads=threads, ranks=ranks, recheck=recheck)
    if isinstance(workload, str):
        costs.meta["workload"] = workload
    return costs


def as_workload(workload: Any) -> Any:
    """``workload`` as a Workload: loaded if it is named ``"file.py:function"``."""
    from orgel.workload import Workload, load_workload

    w = load_workload(workload) if isinstance(workload, str) else workload
    if not isinstance(w, Workload):
        raise ValueError("workload must be 'file.py:function' or an orgel.workload.Workload")
    return w


def capture_workload(workload: Any, microbatches: int) -> tuple[Any, Any]:
    """Load (if named) and check a workload; capture one micro-batch: (Workload, OpGraph)."""
    from orgel.graph import capture
    from orgel.workload import microbatches as split_batches
    from orgel.workload import named_inputs, validate_workload

    w = as_workload(workload)
    validate_workload(w, microbatches)
    inputs, _ = split_batches(w, microbatches)[0]
    return w, capture(w.model, named_inputs(w.model, inputs), precision=w.precision,
                      shallow=True)


def profile_graph(w: Any, opgraph: Any, *, microbatches: int, blocks: int = 32,
                  device: str | None = None, warmup: int = 3, repeats: int = 5,
                  link: bool = True, use_cache: bool = True, progress: bool = True,
                  optimizer_factor: float = 4.0, optimizer: str = "adamw",
                  threads: int = 1, contention: int = 0, ranks: int | None = None,
                  recheck: float | None = RECHECK, source: Any = None,
                  compiled: bool = False) -> BlockCosts:
    """Like :func:`profile_workload` for a workload already captured into ``opgraph``.

    ``optimizer`` (``adamw``, ``adam``, ``sgd``) is measured for the extra memory
    and the time of its step. ``contention``: how many other ranks will train
    at the same time on this machine (CPU only); that many companion processes
    run the same blocks while they are timed. ``ranks``: the plan's rank count,
    whose links are measured as far as this host has the devices
    (:func:`link_world`; default ``contention + 1``). ``recheck``: a cached table is
    used only if the blocks, run once more in sequence, take within this
    fraction of the time it recorded (None: trust the cache as it is).
    ``source``: for a model on the meta device, where its values come from
    (:class:`orgel.split.materialize.Weights`): the blocks are measured one at
    a time, each made and freed (:mod:`orgel.profile.meta`). ``compiled``: time each
    block as a compiled stage runs it (``compile=True``; :mod:`orgel.profile.compiled`).
    """
    from orgel.costs.tied import tied_groups
    from orgel.graph import coarsen
    from orgel.profile.recompute import block_facts
    from orgel.profile.roofline import Roofline, measured_tp_splits, reference_device
    from orgel.split import split_model
    from orgel.workload import microbatches as split_batches
    from orgel.workload import named_inputs

    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"blocks must be a positive integer, got {blocks!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer (intra-op threads per rank), "
                         f"got {threads!r}")
    if recheck is not None and (isinstance(recheck, bool) or not isinstance(recheck, (int, float))
                                or recheck <= 0):
        raise ValueError(f"recheck must be a positive fraction (e.g. 0.25) or None, "
                         f"got {recheck!r}")
    if isinstance(contention, bool) or not isinstance(contention, int) or contention < 0:
        raise ValueError(f"contention must be a non-negative integer (other ranks training "
                         f"at the same time), got {contention!r}")
    dev = torch.device(device) if device else profiling_device()
    inputs, targets = split_batches(w, microbatches)[0]
    named = named_inputs(w.model, inputs)
    bg = coarsen(opgraph, blocks)
    dtypes = sorted({str(p.dtype) for p in w.model.parameters()})
    shapes = {k: list(v.shape) for k, v in named.items() if isinstance(v, torch.Tensor)}
    # the table is per block: the key names the blocks' nodes, not only their target count
    # (how the graph coarsens follows the FLOPs counted, which an orgel upgrade may change)
    key = cache_key(version=PROFILE_VERSION, optimizer=optimizer, graph=graph_hash(opgraph),
                    blocks=blocks, partition=cache_key(nodes=[b.nodes for b in bg.blocks]),
                    device=str(dev), dtype=dtypes,
                    shapes=shapes, repeats=repeats, warmup=warmup, torch=torch.__version__,
                    threads=threads, contention=contention,
                    **({"compiled": True} if compiled else {}))
    if compiled and source is not None:
        raise ValueError("a meta model's blocks are measured one at a time, eagerly: "
                         "profile it with compiled=False")
    cached = _cached("blocks", key) if use_cache else None
    blocks_run: BlockRun | None = None
    if cached is not None and recheck is not None and source is None:
        blocks_run = BlockRun(bg, split_model, named, dev, compiled)
        with intra_op_threads(threads):
            if drifted(blocks_run, cached, dev, contention, threads, recheck):
                cached = None
    if cached is None and source is not None:
        from orgel.profile.meta import measure_blocks

        with intra_op_threads(threads):
            cached = measure_blocks(split_model(bg, list(range(len(bg.blocks)))), named, source,
                                    dev, warmup=warmup, repeats=repeats,
                                    loss=(w.loss_fn, targets))
    if cached is None:
        with intra_op_threads(threads):
            cached = measure_table(blocks_run or BlockRun(bg, split_model, named, dev, compiled),
                                   dev, warmup,
                              repeats, progress, contention, threads,
                              loss=(w.loss_fn, targets), optimizer=optimizer)
        # The optimizer's time has a per-tensor part: time it on every parameter
        # tensor when they are small enough to copy, else on the largest eight. In
        # the model's order, as the ranks step them: a per-tensor optimizer still
        # holds the previous tensor's temporaries while it starts the next one.
        params = list(w.model.parameters())
        if source is not None:  # a meta model: shapes of its largest tensors
            from orgel.profile.meta import optimizer_sample

            params = optimizer_sample(w.model)
        if sum(p.numel() * p.element_size() for p in params) > OPTIMIZER_COPY_LIMIT:
            keep = set(sorted(range(len(params)), key=lambda i: -params[i].numel())[:8])
            params = [p for i, p in enumerate(params) if i in keep]
        with intra_op_threads(threads):
            extra, ms_per_mib = optimizer_temporary(params, optimizer, timed=True)
        cached["optimizer_temporary"] = extra
        cached["optimizer_ms_per_mib"] = ms_per_mib
        _store("blocks", key, cached)
    for note in cached.get("notes", []):
        warnings.warn(f"profile: {note}", stacklevel=2)
    n = len(bg.blocks)
    edges = sorted({(e.src, e.dst) for e in bg.edges if e.src != e.dst})
    memory = None
    if dev.type == "cuda":
        memory = int(torch.cuda.get_device_properties(dev).total_memory)
    if link:
        backend, world = link_world(dev, contention + 1 if ranks is None else ranks)
        link_model, links = link_costs(ranks=world, backend=backend, use_cache=use_cache)
        if backend == "gloo":  # processes of one host over loopback: every pair is the
            # same path, so a pair that differs measured noise (and per-pair links
            # refused tp > 1 and left it out of tp="auto": a test failed under load)
            links = {}
    else:
        link_model, links = Link(), {}
    overhead = float(cached["action_overhead"])
    step_overhead = None
    if link:
        # Through the runtime itself (dispatch, bookkeeping, sends): usually far more
        # than the bare autograd call measured next to the blocks. Measured with the
        # blocks and kept in their table, so it is as fresh as they are (re-checked).
        fitted = cached.get("runtime_overhead")
        if cached.get("runtime_overhead_link") != [link_model.latency, link_model.per_mib] \
                or not isinstance(fitted, list) or len(fitted) != 2:
            fitted = list(runtime_overhead(link_model))
            cached["runtime_overhead"] = fitted
            cached["runtime_overhead_link"] = [link_model.latency, link_model.per_mib]
            _store("blocks", key, cached)
        action, step_overhead = float(fitted[0]), float(fitted[1])
        overhead = max(overhead, action)
    rows = microbatch_rows(w, microbatches)
    sent, grads = bg.edge_bytes(cached["output"])  # what each edge carries, as estimated
    return BlockCosts(
        rows=rows, tied=tied_groups(opgraph, bg),
        fwd=cached["fwd"], bwd=cached["bwd"], wgrad=cached["wgrad"], params=cached["params"],
        activations=cached["activations"], output=cached["output"],
        temporary=cached["temporary"], edges=edges, link=link_model, links=links,
        memory_per_rank=memory, optimizer_factor=optimizer_factor,
        action_overhead=overhead, edge_bytes=sent, edge_grads=grads,
        optimizer_temporary=float(cached.get("optimizer_temporary", 0.0)),
        optimizer_ms_per_mib=float(cached.get("optimizer_ms_per_mib", 0.0)),
        weight_kept=[int(b) for b in cached.get("weight_kept", [])],
        input_saved=[int(b) for b in cached.get("input_saved", [])],
        output_unsaved=[int(b) for b in cached.get("output_unsaved", [])],
        names=[b.name for b in bg.blocks], nodes=[list(b.nodes) for b in bg.blocks],
        meta={"workload": type(w.model).__name__, "target_blocks": blocks, "num_blocks": n,
              "graph_hash": graph_hash(opgraph), "device": str(dev), "dtype": dtypes,
              "microbatch_shapes": shapes, "microbatches": microbatches,
              "threads": threads, "contention": contention, "compiled": compiled,
              "compile_s": cached.get("compile_s", 0.0),
              "in_sequence_scale": cached.get("in_sequence_scale", 1.0),
              "wall_per_cpu": cached.get("wall_per_cpu", 1.0),
              "notes": list(cached.get("notes", []))},
        split_input=[float(t) for t in cached.get("split_input", [])],
        split_weight=[float(t) for t in cached.get("split_weight", [])],
        optimizer_ms=[float(t) for t in cached.get("optimizer_ms", [])],
        step_overhead=step_overhead, cores=shared_cores(dev, threads),
        tp_split=measured_tp_splits(opgraph, bg, reference_device(dev), cached["fwd"],
                                    cached["bwd"], cached["wgrad"], cached["params"],
                                    cached["activations"]),
        recompute=block_facts(opgraph, [b.nodes for b in bg.blocks], cached["fwd"],
                              Roofline(opgraph, reference_device(dev))),
    )
