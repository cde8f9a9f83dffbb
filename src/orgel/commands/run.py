"""``orgel run``: train a workload for a few steps on local ranks, optionally checked exactly.

The workload (``file.py:function``) is captured and split by a balanced chain
scheduled with ``--schedule`` (or by ``--plan PLAN.json``); ``--ranks``
processes run ``--steps`` steps on the workload's batch and the loss of each
step is printed. ``--device`` says where they compute (:mod:`orgel.launch.devices`:
CUDA ranks that outnumber the GPUs share them over gloo, else NCCL; CPU ranks gloo).
``--tp T`` runs each pipeline rank as ``T`` processes that split its attention and MLP
layers (tensor parallelism, :mod:`orgel.runtime.tensor_parallel`): ``--ranks`` counts
every process, so ``T`` divides it.
``--check`` also trains the unmodified model in this process with gradient
accumulation over the same micro-batches, each micro-batch's loss weighed by the loss rule
found at start-up as ``orgel.pipeline`` finds it (:mod:`orgel.lossweights`: the whole
batch's loss, a padded batch's token mean included), and prints the largest loss and
parameter differences (exit 1 beyond ``--tolerance``).

The processes are fresh (so ``--threads`` holds): on the CPU forked from orgel's fork
server, which imported torch, orgel and Dynamo once and ran nothing
(:mod:`orgel.launch.forkserver`), on a GPU spawned interpreters; or torchrun's. Each runs
the flow every front end runs, by the plan this process decided: :func:`orgel.flow.prepare.
prepare`, then :func:`orgel.flow.start.start_torchrun`, the rank ``orgel.pipeline`` makes
under torchrun.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

NAME = "run"
HELP = ("train a workload for a few steps on local ranks, optionally checked against one "
        "process")
EXAMPLES = (
    "orgel run examples/gpt.py:workload --ranks 2 --schedule 1f1b --microbatches 4 --steps 3 "
    "--check",
    "orgel run examples/gpt.py:workload --ranks 4 --microbatches 8 --plan plan.json --check",
    "orgel run examples/gpt.py:workload --ranks 2 --device cuda --check",
    "orgel run examples/gpt.py:workload --ranks 4 --tp 2 --check",
    "orgel run examples/gpt.py:workload --ranks 4 --dp 2 --shard fsdp --check",
)

OPTIMIZERS = ("sgd", "adamw")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line of ``orgel run``."""
    parser.add_argument("workload", help="the workload, as path/to/file.py:function")
    parser.add_argument("--ranks", type=int, default=None,
                        help="processes to run (default 2; with --plan, the plan's)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas of the whole pipeline (divides --ranks)")
    parser.add_argument("--shard", choices=("none", "fsdp"), default="none",
                        help="how a stage's --dp replicas hold its state: none (default: a "
                             "whole copy each, gradients all-reduced) or fsdp (torch FSDP2 "
                             "over the replicas: parameters, gradients and optimizer state "
                             "sharded; needs --dp 2 or more; a --plan keeps its own)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--schedule", default="1f1b",
                     help="schedule family over a balanced chain (default 1f1b): gpipe, 1f1b, "
                          "interleaved, looped-bfs, looped, zb-h1, dag-1f1b, dualpipev")
    how.add_argument("--plan", help="a Plan JSON file to run instead (see orgel plan)")
    parser.add_argument("--tp", type=int, default=1,
                        help="processes per pipeline rank, splitting its attention and MLP "
                             "layers (tensor parallel; must divide --ranks; default 1)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: cut what the split layers leave whole (the residual "
                             "stream, the norms) along the sequence over the members")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--stages-per-rank", type=int, default=2,
                        help="stages per rank for interleaved/looped schedules (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="clip gradients to this global norm (all ranks together)")
    parser.add_argument("--recompute", nargs="?", const="stage", default=None,
                        choices=("stage", "layer", "selective"),
                        help="recompute activations in backward: every stage whole (stage, "
                             "the default when given alone), each layer checkpointed (layer), "
                             "or all but matmul and attention outputs (selective)")
    parser.add_argument("--compile", action="store_true",
                        help="compile every stage's forward and backward with Inductor (the "
                             "backward in input and weight halves for zero-bubble schedules)")
    parser.add_argument("--check-finite", action="store_true",
                        help="stop at the first NaN/inf loss (one sync per micro-batch)")
    parser.add_argument("--loss-rule", default="auto",
                        choices=("auto", "items", "shifted", "rows", "sum", "weighted"),
                        help="how the micro-batches' losses weigh in the batch's (as "
                             "orgel.pipeline's loss_rule; default auto: found on a trial "
                             "forward; weighted: the loss_fn's class weights, or the "
                             "function it carries as loss_fn.loss_rule)")
    parser.add_argument("--check", action="store_true",
                        help="compare with one process: gradient accumulation over the same "
                             "micro-batches, each weighed by the loss rule")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest loss/parameter difference --check accepts (default 1e-4)")
    parser.add_argument("--trace", help="write the last step's Chrome/Perfetto trace here")
    parser.add_argument("--png", help="write the last step's timeline (and prediction) here")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds any rank waits for a message before failing (default 60)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (default 1)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the ranks compute (default auto: CUDA when present; "
                             "ranks that outnumber the GPUs share them over gloo)")
    from orgel.commands.text import precision_argument

    precision_argument(parser)


def optimizer_factory(name: str, lr: float) -> Any:
    """``lambda params: torch.optim.X(params, lr=lr)`` for ``name``."""
    import torch

    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    return lambda params: torch.optim.AdamW(params, lr=lr)


def _fail(message: str) -> int:
    print(f"orgel run: {message}", file=sys.stderr)
    return 2


def _default_ranks(args: argparse.Namespace) -> int:
    """``--ranks`` as given; else the processes ``--plan``'s plan runs on; else 2."""
    if args.ranks is not None:
        return int(args.ranks)
    if args.plan:
        from orgel.schedule.ir import Plan

        try:
            plan = Plan.load(args.plan)
        except (OSError, ValueError):
            return 2  # loading it again reports what is wrong
        return plan.num_ranks * (args.tp if args.tp != 1 else plan.tp)
    return 2


def _check_args(args: argparse.Namespace) -> str | None:
    for name in ("ranks", "dp", "tp", "microbatches", "steps", "threads", "stages_per_rank"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.ranks % args.dp:
        return f"--dp {args.dp} must divide --ranks {args.ranks}"
    if args.ranks % args.tp:
        return (f"--tp {args.tp} must divide --ranks {args.ranks} (--ranks counts every "
                f"process, --tp of them per pipeline rank)")
    if (args.ranks // args.tp) % args.dp:
        return (f"--dp {args.dp} must divide the {args.ranks // args.tp} pipeline ranks "
                f"(--ranks {args.ranks} / --tp {args.tp}): each replica is a pipeline rank "
                f"of --tp processes")
    if args.sequence_parallel and args.tp < 2 and not args.plan:
        return "--sequence-parallel cuts what --tp splits over its members: pass --tp 2 or more"
    if args.shard == "fsdp" and args.dp < 2 and not args.plan:
        return "--shard fsdp shards a stage over its data-parallel replicas: pass --dp 2 or more"
    if args.timeout <= 0:
        return "--timeout must be a positive number of seconds"
    return None


def run(args: argparse.Namespace) -> int:
    """Plan (or load), validate, spawn, train, print; optionally check against one process."""
    from orgel.graph.opgraph import CaptureError
    from orgel.launch import forkserver
    from orgel.launch.errors import WorkerError
    from orgel.launch.spawn import spawn
    from orgel.schedule.ir import PlanError
    from orgel.split.split import SplitError
    from orgel.usercode import user_code
    from orgel.workload import WorkloadError

    args.ranks = _default_ranks(args)
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    from orgel.launch.devices import backend_for, resolve_device

    try:
        args.device = resolve_device(args.device)
    except ValueError as exc:
        return _fail(str(exc))
    from orgel.launch.processes import under_torchrun

    context = ("forkserver" if args.device == "cpu" and forkserver.available() and
               not under_torchrun() else "spawn")
    try:
        # the workload's model and loss run here first (a trial step, the capture): what
        # they raise is the user's error, shown by orgel.cli under the workload's name
        with user_code(args.workload,
                       diagnoses=(WorkloadError, PlanError, SplitError, CaptureError)):
            # the fork server imports torch, orgel and Dynamo while this process plans
            plan = _prepare(args, forkserver.start if context == "forkserver" else None)
    except (WorkloadError, PlanError, SplitError, OSError, ValueError) as exc:
        return _fail(str(exc))
    if os.environ.get("RANK", "0") == "0":
        tp = f" of {plan.tp} processes each (tensor parallel)" if plan.tp > 1 else ""
        print(f"plan: {plan.num_stages} stages on {plan.num_ranks} ranks{tp}, "
              f"{plan.microbatches} micro-batches, {plan.meta.get('schedule', 'custom')} "
              f"schedule; stage ranks {[list(r) for r in plan.placement]}; device "
              f"{args.device} ({backend_for(args.device, args.ranks)})")
    start = time.perf_counter()
    if under_torchrun():
        results = _torchrun_rank(args, plan.to_json())
        if results is None:
            return 1
        if not results:
            return 0  # not rank 0: rank 0 reports
    else:
        try:
            results = spawn(rank_main, args.ranks, args.workload, plan.to_json(), vars(args),
                            timeout=args.timeout, threads=args.threads,
                            backend=backend_for(args.device, args.ranks),
                            context=context)
        except WorkerError as exc:
            print(f"orgel run: the workload {args.workload} failed\n{exc}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - start
    return _report(results, plan, args, elapsed)


def _prepare(args: argparse.Namespace, ready: Callable[[], None] | None = None) -> Any:
    """Load and check the workload, make (or load) the plan and validate it; the plan.
    ``ready`` is called once the workload and the arguments passed their checks.

    The flow every front end runs (:func:`orgel.flow.prepare.prepare`): capture, plan (a
    FLOP-balanced chain of ``--schedule``, or ``--plan``), split; the ranks prepare again
    by this plan (:func:`rank_main`), as the processes of a torchrun job do."""
    from orgel.lossweights import rule_name
    from orgel.schedule.ir import Plan
    from orgel.schedule.validate import validate
    from orgel.workload import load_workload, validate_workload, with_precision

    workload = with_precision(load_workload(args.workload), args.precision)
    validate_workload(workload, args.microbatches * args.dp)
    given = None
    if args.plan:
        given = Plan.load(args.plan)
        if args.tp == 1:  # a plan of the mesh planner (orgel plan --tp) says its own tp
            args.tp = given.tp
        if given.num_ranks != args.ranks // args.tp:
            raise ValueError(f"the plan is for {given.num_ranks} pipeline ranks of {args.tp} "
                             f"process(es): pass --ranks {given.num_ranks * args.tp}")
        replicas(given)
        validate(given)  # an invalid plan never starts a process
    if ready is not None:
        ready()
    prepared = _prepare_flow(workload, given, args.ranks // args.tp, vars(args),
                             schedule=None if given else args.schedule)
    # how the pieces' losses weigh, found here once (orgel.lossweights): the ranks and the
    # check take it from the options, by name (a weighted mean's function is each one's own)
    args.loss_rule = rule_name(prepared.loss_rule)
    validate(prepared.plan)
    return prepared.plan


def _prepare_flow(workload: Any, plan: Any, ranks: int, options: dict[str, Any],
                  schedule: str | None = None) -> Any:
    """:func:`orgel.flow.prepare.prepare` with ``orgel run``'s options (one graph only)."""
    from orgel.flow.prepare import prepare
    from orgel.graph.opgraph import GraphBreakError
    from orgel.runtime.checkpointing import check_policy

    def one_graph(graph: Any) -> None:
        if graph.glue is not None:  # the controller that runs Python between graphs is
            raise GraphBreakError(graph.glue.reason)  # orgel.pipeline's

    return prepare(workload, plan=plan, ranks=ranks, tp=options["tp"],
                   sequence_parallel=bool(options.get("sequence_parallel")),
                   microbatches=plan.microbatches if plan else options["microbatches"],
                   memory=None, dp=replicas(plan) if plan else options["dp"],
                   shard=options["shard"], loss_rule=options.get("loss_rule", "auto"),
                   optimizer=optimizer_factory(options["optimizer"], options["lr"]),
                   recompute=check_policy(options["recompute"] or False),
                   schedule=schedule, stages_per_rank=options["stages_per_rank"],
                   compiled=bool(options.get("compile")), check_graph=one_graph)


def _torchrun_rank(args: argparse.Namespace, plan_json: str) -> list[dict[str, Any]] | None:
    """Run this rank under torchrun; rank 0 gets every rank's results, others ``[]``."""
    import torch
    import torch.distributed as dist

    from orgel.launch.errors import report_failure
    from orgel.launch.processes import init_from_env

    rank, world = init_from_env(timeout=args.timeout, device=args.device)
    torch.set_num_threads(args.threads)
    if world != args.ranks:
        print(f"orgel run: torchrun started {world} ranks but --ranks is {args.ranks}",
              file=sys.stderr)
        return None
    try:
        result = rank_main(rank, world, args.workload, plan_json, vars(args))
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
    except Exception as exc:  # noqa: BLE001 - one message per rank, root cause marked
        report_failure(rank, exc)
        return None
    return [g for g in gathered or []]


def _report(results: list[dict[str, Any]], plan: Any, args: argparse.Namespace,
            elapsed: float) -> int:
    """Print losses, the timeline summary and views; run the check if asked."""
    from orgel.runtime.trace import format_summary, save_views
    from orgel.workload import load_workload
    losses = results[0]["losses"]
    for step, loss in enumerate(losses):
        print(f"step {step + 1}: loss {loss:.6f}")
    events = [e for r in results for e in r["events"]]
    print(format_summary(events))
    print(f"{args.steps} steps on {args.ranks} ranks in {elapsed:.1f} s (including start-up)")
    if args.compile:
        seconds = ", ".join(f"{r.get('compile_s', 0.0):.1f}" for r in results)
        print(f"compiling the stages took {seconds} s (by rank)")
    if args.trace or args.png:
        save_views(plan, events, trace=args.trace, png=args.png)
        for path in (args.trace, args.png):
            if path:
                print(f"wrote {path}")
    if not args.check:
        return 0
    params = {name: t for r in results for name, t in r["params"]}
    from orgel.usercode import user_code
    from orgel.workload import with_precision

    with user_code(args.workload):  # the unmodified model, in this process
        ref_losses, ref_params = reference(with_precision(load_workload(args.workload),
                                                          args.precision), args)
    diverged = _diverged(losses, ref_losses)
    if diverged:
        print(diverged, file=sys.stderr)
        return 1
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    missing = sorted(set(ref_params) - set(params))
    if missing:
        print(f"check: parameters missing from the ranks: {missing[:5]}", file=sys.stderr)
        return 1
    param_diff = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    ok = loss_diff <= args.tolerance and param_diff <= args.tolerance
    print(f"check vs one process (gradient accumulation): largest loss difference "
          f"{loss_diff:.3g}, largest parameter difference {param_diff:.3g} "
          f"-> {'OK' if ok else 'FAILED'} (tolerance {args.tolerance:g})")
    return 0 if ok else 1


def _diverged(losses: list[float], ref_losses: list[float]) -> str | None:
    """One line for a check that has nothing to compare: a loss that is NaN or infinite."""
    def first(values: list[float]) -> int | None:
        return next((i for i, v in enumerate(values) if not math.isfinite(v)), None)

    mine, ref = first(losses), first(ref_losses)
    if mine is None and ref is None:
        return None
    if mine is not None and ref is not None:
        why = ("the data or the initial weights hold a NaN or an infinity" if mine == 0 else
               "the run diverged: lower --lr, or clip with --max-grad-norm")
        return (f"check: the loss is {losses[mine]} from step {mine + 1} on (one process's "
                f"too, from step {ref + 1}), so there is nothing to compare; {why} "
                "(--check-finite stops at the first such micro-batch) -> FAILED")
    which, step = ("the pipelined", mine) if mine is not None else ("one process's", ref)
    assert step is not None
    return (f"check: {which} loss is not finite from step {step + 1} on (pipelined "
            f"{losses[step]}, one process {ref_losses[step]}) -> FAILED")


def reference(workload: Any, args: argparse.Namespace) -> tuple[list[float], dict[str, Any]]:
    """Losses and final parameters of the unmodified model, one process, same steps: the
    micro-batches' losses weighed by the run's loss rule (:mod:`orgel.lossweights`), so the
    loss is the whole batch's."""
    import torch

    from orgel.launch.devices import move
    from orgel.lossweights import batch_weights, rule_for, weigh
    from orgel.nesting import call
    from orgel.precision import autocast, scales_loss
    from orgel.workload import microbatches

    torch.manual_seed(0)
    device = torch.device(getattr(args, "device", "cpu"))
    model = copy.deepcopy(workload.model).to(device)
    optimizer = optimizer_factory(args.optimizer, args.lr)(list(model.parameters()))
    # float16: torch.amp.GradScaler, as one process would train it
    scaler = torch.amp.GradScaler(device.type, enabled=scales_loss(workload.precision))
    batches = move(microbatches(workload, args.microbatches), device)
    weights = batch_weights(rule_for(workload, args.loss_rule), [x for x, _ in batches],
                            [y for _, y in batches], 1, workload.batch_dim,
                            workload.replicated)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        total = 0.0
        for m, (inputs, targets) in enumerate(batches):
            with autocast(workload.precision, device.type):
                out = call(model, inputs)
                loss = weigh(workload.loss_fn(out, targets), weights[(m, 0)], out)
            scaler.scale(loss).backward()
            total += loss.item()
        if args.max_grad_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        losses.append(total)
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def replicas(plan: Any) -> int:
    """The replicas every stage has; the captured graph has fixed shapes, so all the same."""
    counts = {len(ranks) for ranks in plan.placement}
    if len(counts) != 1:
        raise ValueError("stages with different replica counts need shape-generic stage "
                         f"modules; this plan has {sorted(counts)}: give every stage the same "
                         "number of ranks")
    return counts.pop()


def rank_main(rank: int, world: int, spec: str, plan_json: str,
              options: dict[str, Any]) -> dict[str, Any]:
    """One process of ``orgel run``: prepare by the plan, start as a rank of the job (the
    process group is made), train, report (the events from process 0)."""
    import torch

    from orgel.flow.start import executor_options, start_torchrun
    from orgel.launch.devices import host
    from orgel.launch.errors import PeerStepFailed, Reported, StepError
    from orgel.precision import scales_loss
    from orgel.schedule.ir import Plan
    from orgel.worker.state import model_aliases
    from orgel.workload import load_workload, with_precision

    workload = with_precision(load_workload(spec), options.get("precision", "32"))
    plan = Plan.from_json(plan_json)
    # the plan's own tp, shard and recompute fields rule
    prepared = _prepare_flow(workload, plan, plan.num_ranks,
                             {**options, "tp": plan.tp, "recompute": None})
    prepared.keys, prepared.aliases = model_aliases(workload.model)
    factory = optimizer_factory(options["optimizer"], options["lr"])
    ranks_options = executor_options(workload, loss_scaling=scales_loss(workload.precision),
                                     check_finite=options.get("check_finite", False),
                                     compile=options.get("compile", False),
                                     max_grad_norm=options["max_grad_norm"])
    pipe = start_torchrun(prepared, options.get("device", "cpu"), optimizer=factory,
                          timeout_s=options["timeout"], executor_options=ranks_options,
                          owns_group=False)
    try:
        torch.manual_seed(0)
        losses = [pipe.step(workload.inputs, workload.targets) for _ in range(options["steps"])]
        events = pipe.timeline()  # every process's, gathered
        params = list(pipe.state_dict().items()) if options["check"] else []
        compile_s = pipe.compile_s[0]
    except StepError as exc:  # the run ends: the rank that failed reports it, once
        if exc.rank == rank:
            raise Reported(exc.report) from None
        raise PeerStepFailed(f"stopped: rank {exc.rank} failed") from None
    finally:
        pipe.close()
    return host({"losses": losses, "events": events if rank == 0 else [],
                 "compile_s": compile_s, "params": params if rank == 0 else []})
