"""Differential fuzzing: a drawn training setup through orgel against one process.

One place for the draw, the two runs and the comparison, used by ``tests/test_fuzz.py``
(a bounded number of draws under hypothesis, fixed seed) and ``benchmarks/fuzz.py``
(many draws, printing each setup and what differed).

:func:`draw` picks a :class:`Setup` through a ``pick(name, options)`` function: a
hypothesis draw in the test, a seeded ``random.Random`` in the benchmark. A setup
is a model of the zoo (``tests/zoo.py``; sequence-first data and a replicated input:
``tests/fuzz_models.py``), 2-4 ranks, ``dp`` (its replicas sharded with FSDP2
or not: ``shard``), tensor parallelism (``tp``), a schedule family with
its options (``orgel.plan.balanced.balanced_plan``), the micro-batch count, which
stages recompute, frozen parameters, precision (``32``, ``bf16-mixed``, ``16-mixed`` with
loss scaling), optimizer, learning-rate schedule
(``scheduler=`` or ``lr=``), clipping (``max_grad_norm=``), ``accumulate``, meta
init (``weights=`` or ``init=``), step batches of the example's sizes or of more
rows or shorter sequences, and the entry point: ``orgel.pipeline`` or
``torch.compile(model, backend=orgel.backend(...))`` with a closure
(``tests/fuzz_backend.py``), or where asked ``orgel.pipeline`` in a torchrun job
(``tests/fuzz_torchrun.py``); ``draw(auto=True)`` also draws the planner's own plan.

:func:`run_orgel` trains it for two optimizer steps through the production path
(forked gloo ranks, the real split and launcher), evaluates the first batch
(``pipe.evaluate``; not through ``orgel.backend``, which evaluates in the caller), and
reads every copy of every parameter, buffer and optimizer
state back from each rank's checkpoint shard;
:func:`run_reference` trains the same with plain torch in one process, micro-batch by
micro-batch (a loss over a micro-batch, BatchNorm's statistics per replica,
averaged each step: the pipeline's semantics); :func:`check` runs both and judges them with
:func:`fuzz_verdict.compare` (tight tolerances, or float64 for an ill-conditioned draw).

Corners with a known open defect are not drawn (see :data:`EXCLUDED`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import fuzz_backend
import fuzz_models
import fuzz_torchrun
import orgel
import zoo
from fuzz_loop import (
    _pieces,
    _to,
    build,
    freeze,
    fuzz_init,
    init_as_documented,
    make_optimizer,
    rate,
    share_weight,
    warmup,
    workloads,
)
from fuzz_verdict import Result, Verdict, compare
from orgel.batching import micro_sizes
from orgel.explicit.fallback import GlueError
from orgel.graph import capture
from orgel.graph.sizes import ShapeError
from orgel.launch.errors import WorkerError
from orgel.launch.processes import under_torchrun
from orgel.lossweights import weigh
from orgel.plan.balanced import LOOPED, balanced_plan
from orgel.plan.transforms import mark_sharded, with_recompute
from orgel.precision import autocast_dtype
from orgel.runtime import checkpoint as ckpt
from orgel.schedule.ir import PlanError
from orgel.split.materialize import MaterializeError
from orgel.workload import Workload, microbatches

Pick = Callable[[str, Sequence[Any]], Any]

#: models drawn (tests/zoo.py and tests/fuzz_models.py names); HF ones only where asked
#: (they are slower to capture)
MODELS: tuple[str, ...] = ("gpt", "tied", "vit", "clip", "unet", "resnet", "dlrm", "mmt",
                           *fuzz_models.NAMES, "graphbreak")
HF_MODELS: tuple[str, ...] = ("hf_gpt2", "hf_bert", "hf_llama")
FAMILIES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "looped-bfs", "looped", "zb-h1",
                             "dag-1f1b")
#: models whose inputs and targets are (batch, sequence): drawn with shorter sequences too
SEQUENCE: tuple[str, ...] = ("gpt", "tied", "hf_gpt2", "hf_llama")
#: models with linear layers tensor parallelism splits (``tp`` is drawn for them; GPT-2's
#: are ``Conv1D``, ``addmm`` with a ``[in, out]`` weight)
TENSOR_PARALLEL: tuple[str, ...] = ("gpt", "tied", "vit", "clip", "mmt", "hf_gpt2", "hf_bert",
                                    "hf_llama", "breaks", "aux")
#: the front ends a setup trains through (``tests/fuzz_backend.py`` for orgel.backend);
#: :data:`TORCHRUN` (either in a torchrun job, ``tests/fuzz_torchrun.py``) are drawn
#: where asked (``draw(entries=...)``): each draw starts a job of fresh interpreters
ENTRIES: tuple[str, ...] = ("pipeline", "backend")
TORCHRUN: tuple[str, ...] = ("torchrun", "backend-torchrun")
#: corners not drawn, each for a known open defect (issue 25's item)
EXCLUDED: dict[str, str] = {}


@dataclass(frozen=True)
class Setup:
    """One drawn configuration (plain data: printable, comparable)."""

    model: str
    ranks: int
    dp: int
    schedule: str
    microbatches: int
    rows: int  # rows of one micro-batch share (a replica's part of a micro-batch)
    stages_per_rank: int = 1
    loop_microbatches: int | None = None
    prefetch: tuple[int, ...] | None = None
    recompute: str = "none"  # none, all, first, last, alternate; layer, selective (every stage)
    frozen: str = "none"  # none, module (the frozen_module-th that holds any), every3, head
    frozen_module: int = 0
    shard: str = "none"  # how dp replicas hold their state: none, fsdp
    tp: int = 1  # tensor parallelism: processes per pipeline rank (``ranks`` counts processes)
    sequence_parallel: bool = False  # with tp: what the regions leave whole, cut by sequence
    precision: str = "32"
    optimizer: str = "sgd"  # sgd, momentum, adamw
    schedule_lr: str = "constant"  # constant, scheduler, lr
    max_grad_norm: float | None = None
    accumulate: int = 1
    meta: str = "none"  # none, weights, init
    shape: str = "same"  # the steps' batches: as the example, more rows, uneven, half the seq
    seed: int = 0
    entry: str = "pipeline"  # pipeline, backend (torch.compile(backend=orgel.backend)),
    # or either in a torchrun job: torchrun (orgel.pipeline), backend-torchrun
    #: ``orgel.backend``: some step calls' closures compute the loss without a backward
    #: (evaluation batches run through ``step``; :meth:`skips_backward`); one process alike
    no_backward: bool = False
    #: ``orgel.backend``: ``torch.compile``'s ``dynamic`` (None, its default: sizes turn
    #: symbolic at their first change; False: every graph static)
    dynamic: bool | None = None
    #: ``compile=True``: every stage's graphs compiled by Inductor on the ranks
    compile: bool = False

    def skips_backward(self, call: int) -> bool:
        """Whether step call ``call`` runs no backward (``no_backward``): the second call,
        and with ``accumulate=2`` the whole second optimizer step too (an accumulation
        beside a training call, and one of no training call at all)."""
        return self.no_backward and call in ((1,) if self.accumulate == 1 else (1, 2, 3))

    @property
    def backend(self) -> bool:
        """Whether the setup trains through ``orgel.backend``'s closures."""
        return self.entry.startswith("backend")

    @property
    def batch(self) -> int:
        return self.rows * self.microbatches * self.dp

    def line(self) -> str:
        """The setup in one line, only what differs from the defaults after the counts."""
        d = asdict(self)
        head = (f"{self.model} ranks={self.ranks} dp={self.dp} {self.schedule} "
                f"M={self.microbatches} batch={self.batch}")
        defaults = Setup("", 0, 0, "", 0, 0)
        rest = [f"{k}={v}" for k, v in d.items()
                if k not in ("model", "ranks", "dp", "schedule", "microbatches", "rows")
                and v != getattr(defaults, k)]
        return " ".join([head, *rest])


def draw(pick: Pick, models: Sequence[str] = MODELS, auto: bool = False,
         entries: Sequence[str] = ENTRIES, compiled: bool = False) -> Setup:
    """A setup drawn with ``pick(name, options)``; valid by construction where it can be
    (interleaved gets a micro-batch count that is a multiple of the pipeline's ranks).

    ``auto``: also draw ``schedule="auto"``, the planner's own plan (it profiles: slow).
    ``compiled``: also draw ``compile=True`` (Inductor compiles every stage: slow).
    Through ``orgel.backend`` the plan is its ``schedule=``: no meta model, no ``looped``
    family's options, recompute for every stage or none."""
    model = pick("model", models)
    entry = pick("entry", entries)
    backend = entry.startswith("backend")
    ranks = pick("ranks", (2, 3, 4))
    dp = pick("dp", [d for d in (1, 2, 4) if ranks % d == 0])
    shard = pick("shard", ("none", "fsdp")) if dp > 1 else "none"
    tp = pick("tp", (1, 2)) if model in TENSOR_PARALLEL and (ranks // dp) % 2 == 0 else 1
    pipeline = ranks // (dp * tp)
    schedule = pick("schedule", tuple(f for f in FAMILIES if not (backend and f == "looped"))
                    + (("auto",) if auto else ()))
    if schedule == "interleaved":
        m = pipeline * pick("groups", (1, 2))
    else:
        m = pick("microbatches", (1, 2, 3, 4, 6))
    per_rank = (2 if backend else pick("stages_per_rank", (2, 3))) if schedule in LOOPED else 1
    loop_mb = prefetch = None
    frozen = pick("frozen", ("none", "module", "every3", "head"))
    meta = ("none" if backend or model in fuzz_models.GRAPH_BREAKS  # (documented refusals)
            else pick("meta", ("none", "weights", "init")))
    if schedule == "looped":
        loop_mb = pick("loop_microbatches", [d for d in range(1, m + 1) if m % d == 0])
        prefetch = tuple(pick(f"prefetch{r}", (0, 1, 2)) for r in range(pipeline))
    setup = Setup(
        model=model, ranks=ranks, dp=dp, schedule=schedule, microbatches=m,
        rows=pick("rows", (1, 2, 3)), stages_per_rank=per_rank, loop_microbatches=loop_mb,
        prefetch=prefetch,
        recompute=pick("recompute", ("none", "all")
                       + (() if backend else ("first", "last", "alternate"))
                       + ("layer", "selective")),
        frozen=frozen, frozen_module=pick("frozen_module", range(8)) if frozen == "module" else 0,
        shard=shard, tp=tp,
        precision=pick("precision", ("32", "bf16-mixed", "16-mixed")),
        optimizer=pick("optimizer", ("sgd", "momentum", "adamw")),
        schedule_lr=pick("schedule_lr", ("constant", "scheduler", "lr")),
        max_grad_norm=pick("max_grad_norm", (None, 0.01, 1e3)),
        accumulate=pick("accumulate", (1, 2)),
        meta=meta,
        shape=pick("shape", ("same", "rows", "uneven") + (("seq",) if model in SEQUENCE else ())),
        seed=pick("seed", (0, 1, 2)), entry=entry,
    )
    if tp > 1:  # drawn last: the draws before it are as they were for every seed
        setup = replace(setup, sequence_parallel=pick("sequence_parallel", (False, True)))
    # after it (so too): GradScaler refuses an optimizer step that had no backward at all
    if backend and setup.precision != "16-mixed":
        setup = replace(setup, no_backward=pick("no_backward", (False, True)))
    if backend:  # (drawn last too)
        setup = replace(setup, dynamic=pick("dynamic", (None, False)))
    if compiled:  # (and this, only where asked: the draws of every seed stay as they were)
        setup = replace(setup, compile=pick("compile", (False, True)))
    return setup


# -- the two runs -----------------------------------------------------------------------------


class Refused(Exception):
    """orgel refused the setup before training, saying why (not a defect by itself)."""


def canonical(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter/buffer name -> the first name of the same tensor (tied aliases)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for n, t in named:
        out[n] = first.setdefault(id(t), n)
    return out


def make_plan(setup: Setup, model: torch.nn.Module, w: Any) -> Any:
    """A balanced chain scheduled by the setup's family, with its recompute flags (None:
    ``schedule="auto"``, orgel.pipeline plans; or orgel.backend, which makes the chain
    from its own capture: :func:`recompute_policy`)."""
    if setup.schedule == "auto" or setup.backend:
        return None
    cut = Workload(copy.deepcopy(model), w.inputs, w.targets, w.loss_fn, w.batch_dim,
                   w.replicated)
    first, _ = microbatches(cut, setup.microbatches * setup.dp)[0]
    graph = capture(copy.deepcopy(model), first, precision=setup.precision)
    options: dict[str, Any] = {}
    if setup.schedule == "looped":
        options = {"loop_microbatches": setup.loop_microbatches,
                   "prefetch": list(setup.prefetch or ())}
    plan = balanced_plan(graph, ranks=setup.ranks // setup.tp, microbatches=setup.microbatches,
                         schedule=setup.schedule, dp=setup.dp,
                         stages_per_rank=setup.stages_per_rank, **options)
    plan = mark_sharded(plan, setup.shard)
    n = plan.num_stages
    if setup.recompute in ("layer", "selective", "all"):
        return with_recompute(plan, [recompute_policy(setup)] * n)
    return with_recompute(plan, {"none": [False] * n, "all": [True] * n,
                                 "first": [s == 0 for s in range(n)],
                                 "last": [s == n - 1 for s in range(n)],
                                 "alternate": [s % 2 == 0 for s in range(n)]}[setup.recompute])


def recompute_policy(setup: Setup) -> bool | str:
    """Every stage's policy where the setup recomputes all stages alike ("none" and "all"
    too); torch's selective checkpoint allows one backward, so with a split one (ZB-H1,
    DualPipeV) "selective" becomes "layer"."""
    if setup.recompute == "selective" and setup.schedule in ("zb-h1", "dualpipev"):
        return "layer"
    return {"none": False, "all": True}.get(setup.recompute, setup.recompute)


def loop_options(setup: Setup) -> dict[str, Any]:
    """``orgel.pipeline``'s loop options for the setup."""
    options: dict[str, Any] = {"max_grad_norm": setup.max_grad_norm,
                               "accumulate": setup.accumulate, "precision": setup.precision}
    if setup.schedule_lr == "scheduler":
        options["scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    elif setup.schedule_lr == "lr":
        options["lr"] = rate
    return options


def run_orgel(setup: Setup, timeout_s: float = 120.0, folder: Path | None = None) -> Result:
    """Train ``setup`` through its entry point for :data:`STEPS` optimizer steps.

    ``entry="torchrun"`` or ``"backend-torchrun"``: launched under torchrun
    (:func:`fuzz_torchrun.launch`), whose
    processes run this function themselves, each saving its checkpoint shard in ``folder``
    (one for the job; otherwise a temporary folder of this process)."""
    if setup.entry.endswith("torchrun") and not under_torchrun():
        return fuzz_torchrun.launch(setup, timeout_s)
    w = workloads(setup)
    model = w.model
    extra: dict[str, Any] = {}
    seed = 1000 + setup.seed
    if setup.meta != "none":
        with orgel.build_on_meta():  # the constructors' buffers remade on each rank
            model = build(setup.model, batch_size=setup.batch, seed=setup.seed).model
        freeze(setup, model)
        if setup.meta == "weights":
            # with the buffers state_dict leaves out (non-persistent ones), as a user would
            extra["weights"] = {**dict(w.model.named_buffers()), **w.model.state_dict()}
        else:
            extra["init"] = fuzz_init
    try:
        plan = make_plan(setup, model, w)
    except PlanError as exc:
        raise Refused(f"plan: {exc}") from None
    if plan is None:
        extra.update(dp=setup.dp, shard=setup.shard)
    torch.manual_seed(seed)  # init= seeds each module from torch.initial_seed()
    optimizer = lambda params: make_optimizer(setup, params.named())  # noqa: E731
    try:
        if setup.backend:
            # a draw is a user's fresh process: Dynamo has not run this model's code before
            torch._dynamo.reset()
            pipe, step = fuzz_backend.start(setup, w, optimizer, loop_options(setup),
                                            recompute_policy(setup), timeout_s)
        else:
            pipe = orgel.pipeline(model, w.inputs, w.targets, w.loss_fn, ranks=setup.ranks,
                                  tp=setup.tp, sequence_parallel=setup.sequence_parallel,
                                  microbatches=setup.microbatches, plan=plan,
                                  threads=1, optimizer=optimizer, timeout_s=timeout_s,
                                  batch_dim=w.batch_dim, replicated=w.replicated,
                                  compile=setup.compile, **loop_options(setup), **extra)
            step = pipe.step
    except (ValueError, MaterializeError) as exc:
        raise Refused(f"{type(exc).__name__}: {exc}") from None
    except WorkerError as exc:  # a meta model's buffer init cannot make: named, as promised
        if f"failed in start: {MaterializeError.__name__}" not in str(exc):
            raise
        raise Refused(str(exc).splitlines()[0]) from None
    with pipe, tempfile.TemporaryDirectory() as tmp:
        tmp = str(folder or tmp)
        losses, lrs, norms = [], [], []
        for call, (inputs, targets) in enumerate(w.batches):
            try:
                losses.append(float(step(inputs, targets)))
            except ShapeError as exc:  # raised in the caller before any rank starts
                raise Refused(f"ShapeError: {exc}") from None
            except GlueError as exc:  # off the captured graphs with BatchNorm stages; a
                # frame past Dynamo's recompile limit (.item() under dynamic=False)
                if not any(s in str(exc) for s in ("orgel would run it", "recompile limit")):
                    raise
                raise Refused(f"GlueError: {exc}") from None
            except ValueError as exc:  # orgel.backend checks its options at the first step
                if call or not setup.backend:
                    raise
                raise Refused(f"ValueError: {exc}") from None
            if (call + 1) % setup.accumulate == 0:
                norms.append(pipe.grad_norm if setup.max_grad_norm is not None else None)
                lrs.append(list(pipe.lr))
        try:  # before the state is read: an evaluation changes no buffer
            evaluated: float | None = float(pipe.evaluate(*w.batches[0]))
        except RuntimeError as exc:
            if "evaluation is not available" not in str(exc):
                raise
            evaluated = None  # orgel.backend's too: it evaluates in the caller, not pipelined
        state = pipe.state_dict()
        folder = pipe.save(tmp)
        copies, optim = _shards(folder, setup.ranks // setup.tp)  # a shard per pipeline rank
    names = canonical(w.model)
    result = Result(losses, lrs, norms, {}, {}, keys=list(state), evaluated=evaluated)
    for n, t in state.items():  # the gathered state_dict, then every rank's own copy
        result.copies.setdefault(names.get(n, n), []).append(t)
    for n, ts in copies.items():  # non-persistent buffers are in no state_dict: not compared
        if names.get(n, n) in result.copies:
            result.copies[names.get(n, n)].extend(ts)
    for n, ss in optim.items():
        result.optim.setdefault(names.get(n, n), []).extend(ss)
    return result


def _shards(folder: Path, ranks: int) -> tuple[dict[str, list[torch.Tensor]],
                                                dict[str, list[dict[str, Any]]]]:
    copies: dict[str, list[torch.Tensor]] = {}
    optim: dict[str, list[dict[str, Any]]] = {}
    for r in range(ranks):
        shard = ckpt.read_shard(folder, r)
        for n, t in {**shard["params"], **shard["buffers"]}.items():
            copies.setdefault(n, []).append(t)
        for n, s in ((shard.get("optimizer") or {}).get("state") or {}).items():
            optim.setdefault(n, []).append(s)
    return copies, optim


def run_reference(setup: Setup, dtype: torch.dtype = torch.float32) -> Result:
    """The same training in one process with plain torch, micro-batch share by share.

    Share ``i`` is replica ``i % dp``'s rows of micro-batch ``i // dp``; under ``dp > 1``
    each replica's shares update its own copy of the buffers the forward writes (BatchNorm's
    statistics), and the copies are averaged at the end of each step call
    (:class:`ReplicaBuffers`, as :mod:`orgel.runtime.buffers` does on the ranks).
    ``16-mixed``: float16 autocast with ``torch.amp.GradScaler`` (defaults) around the loop.
    ``dtype=torch.float64``: the model and float data in float64, without autocast.
    """
    w = workloads(setup)
    model = w.model
    if setup.meta == "init":
        init_as_documented(model, 1000 + setup.seed)
    if dtype != torch.float32:
        model = model.to(dtype)
    opt = make_optimizer(setup, model.named_parameters())
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, warmup)
             if setup.schedule_lr == "scheduler" else None)
    cast = None if dtype != torch.float32 else autocast_dtype(setup.precision)
    scaler = torch.amp.GradScaler("cpu", enabled=cast == torch.float16)
    shares = setup.microbatches * setup.dp
    cut = (w.batch_dim, w.replicated)  # how the inputs are cut into shares
    replicas = ReplicaBuffers(model, setup.dp)
    # each share's weight: its rows' part of the batch (one more row for the first ones
    # where the batch does not divide, shape="uneven"; 1/shares where it does)
    weights = [share_weight(r, w.rows) for r in micro_sizes(w.rows, shares)]
    losses, lrs, norms = [], [], []
    steps = 0
    for call, (inputs, targets) in enumerate(w.batches):
        if setup.schedule_lr == "lr":
            for g in opt.param_groups:
                g["lr"] = rate(steps)
        total = 0.0
        for i, (x, y) in enumerate(zip(_pieces(_to(inputs, dtype), shares, *cut),
                                       _pieces(_to(targets, dtype), shares, w.batch_dim),
                                       strict=True)):
            with replicas.of(i % setup.dp), torch.autocast("cpu", dtype=cast or torch.bfloat16,
                                                           enabled=cast is not None):
                loss = w.loss_fn(zoo.call(model, x), y)
            if not setup.skips_backward(call):
                scaler.scale(weigh(loss, weights[i]) / setup.accumulate).backward()
            total += float(weigh(loss.detach(), weights[i]))
        replicas.average()
        losses.append(total)
        if (call + 1) % setup.accumulate:
            continue
        params = [p for p in model.parameters() if p.grad is not None]
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(params, setup.max_grad_norm or math.inf)
        norms.append(float(norm) if setup.max_grad_norm is not None else None)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        steps += 1
        # the rates in force for the next optimizer step, as pipe.lr reports them
        lrs.append([rate(steps) if setup.schedule_lr == "lr" else g["lr"]
                    for g in opt.param_groups])
    names = canonical(model)
    state = model.state_dict()
    model.eval()
    with torch.no_grad():
        inputs, targets = w.batches[0]
        evaluated = 0.0
        for i, (x, y) in enumerate(zip(_pieces(_to(inputs, dtype), shares, *cut),
                                       _pieces(_to(targets, dtype), shares, w.batch_dim),
                                       strict=True)):
            with torch.autocast("cpu", dtype=cast or torch.bfloat16, enabled=cast is not None):
                evaluated += float(weigh(w.loss_fn(zoo.call(model, x), y), weights[i]))
    result = Result(losses, lrs, norms, {}, {}, keys=list(state),
                    params={names[n] for n, _ in model.named_parameters()}, evaluated=evaluated)
    for n, t in state.items():
        result.copies.setdefault(names[n], [t.detach().clone()])
    by_id = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        result.optim[names[by_id[id(p)]]] = [{k: v.clone() if isinstance(v, torch.Tensor) else v
                                              for k, v in s.items()}]
    return result


class ReplicaBuffers:
    """One process's stand-in for ``dp`` replicas' own buffers: :meth:`of` runs a share with
    replica ``k``'s copy in the model; :meth:`average` sets every copy, and the model's,
    to their mean (floats), floor of the mean (integers) or any (bools), where they differ."""

    def __init__(self, model: torch.nn.Module, dp: int) -> None:
        self.buffers = dict(model.named_buffers())
        self.copies = [{n: b.clone() for n, b in self.buffers.items()} for _ in range(dp)]

    @contextlib.contextmanager
    def of(self, replica: int) -> Iterator[None]:
        if len(self.copies) < 2:
            yield
            return
        mine = self.copies[replica]
        with torch.no_grad():
            for n, b in self.buffers.items():
                b.copy_(mine[n])
        yield
        self.copies[replica] = {n: b.clone() for n, b in self.buffers.items()}

    def average(self) -> None:
        if len(self.copies) < 2:
            return
        with torch.no_grad():
            for n, b in self.buffers.items():
                values = torch.stack([c[n] for c in self.copies])
                if all(torch.equal(v, values[0]) for v in values[1:]):
                    b.copy_(values[0])
                elif b.dtype == torch.bool:
                    b.copy_(values.any(0))
                elif b.is_floating_point():
                    b.copy_(values.sum(0) / len(self.copies))
                else:
                    b.copy_(values.sum(0).div(len(self.copies), rounding_mode="floor"))
                for c in self.copies:
                    c[n] = b.clone()


def check(setup: Setup) -> Verdict:
    """Run ``setup`` both ways and compare (raises :class:`Refused` for a refused setup)."""
    got = run_orgel(setup)
    ref = run_reference(setup)
    return compare(setup.precision, got, ref, lambda: run_reference(setup, torch.float64),
                   by_kind=setup.tp > 1 and setup.precision != "32")
