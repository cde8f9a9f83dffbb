"""orgel's runtime against torch.distributed.pipelining: same model, split and schedule.

A GPT-like model (8 layers, d_model 256, seq 128, vocab 1000; batch 32 in 8
micro-batches; SGD) is cut into the same stage modules for both. On 2 gloo
ranks with one thread each, in one process group, every schedule runs under
torch (manual ``PipelineStage`` + its schedule class) and under orgel (the same
actions as a Plan): GPipe, 1F1B, interleaved 1F1B (2 stages per rank) and
zero-bubble ZBV (torch's V-shaped order, converted action by action into an
orgel Plan). The model also runs in one process with 1 and with 2 threads.

The machine is shared: each measurement is repeated (frameworks alternate),
the median is reported, and the CPU time used by other processes during each
measurement (from /proc/stat minus our own) is recorded; a median with more
than ``--foreign-limit`` cores of foreign load is flagged as contaminated.

    python benchmarks/vs_torch_pipelining.py            # the full setting
    python benchmarks/vs_torch_pipelining.py --quick    # tiny, checks it runs end to end
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from orgel.launch.spawn import spawn
from orgel.models.gpt import GPT, GPTConfig, lm_loss
from orgel.runtime.executor import Executor
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import Action, Edge, Plan, Stage, StageGraph, Value
from orgel.split.types import SplitModel, StageModule

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")


class Embed(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(positions)


def stage_modules(config: GPTConfig, stages: int) -> list[nn.Sequential]:
    """The model cut into ``stages`` modules: blocks spread evenly, embedding first, head last."""
    torch.manual_seed(0)
    gpt = GPT(config)
    blocks = list(gpt.encoder.blocks)
    per, extra = divmod(len(blocks), stages)
    parts: list[list[nn.Module]] = []
    start = 0
    for s in range(stages):
        n = per + (1 if s < extra else 0)
        parts.append(list(blocks[start:start + n]))
        start += n
    parts[0].insert(0, Embed(gpt))
    parts[-1] += [gpt.encoder.ln_f, gpt.lm_head]
    return [nn.Sequential(*p) for p in parts]


def orgel_split(modules: list[nn.Sequential], hidden_bytes: int) -> SplitModel:
    n = len(modules)
    stages = [StageModule(s, m, ["tokens"] if s == 0 else [f"h{s - 1}"],
                          ["logits"] if s == n - 1 else [f"h{s}"],
                          model_inputs=["tokens"] if s == 0 else [])
              for s, m in enumerate(modules)]
    graph = StageGraph(tuple(Stage(name=f"stage{s}") for s in range(n)),
                       tuple(Edge(s, s + 1, (Value(f"h{s}", hidden_bytes),))
                             for s in range(n - 1)))
    return SplitModel(stages, graph, n - 1, ["logits"], lambda outs: outs[0], ["tokens"],
                      requires_grad={f"h{s}": True for s in range(n - 1)})


def torch_order_plan(order: dict[int, list[Any]], graph: StageGraph, microbatches: int) -> Plan:
    """torch's per-rank action order (``pipeline_order``) as an orgel Plan."""
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W", "FULL_BACKWARD": "B",
             "FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    schedule: list[list[Action]] = []
    placement: dict[int, int] = {}
    for rank in sorted(order):
        actions = []
        for a in order[rank]:
            if a is None:
                continue
            kind = kinds[str(a.computation_type).split(".")[-1]]
            actions.append(Action(kind, a.stage_index, a.microbatch_index))
            placement[a.stage_index] = rank
        schedule.append(actions)
    return Plan(graph, [(placement[s],) for s in range(graph.num_stages)], len(schedule),
                microbatches, schedule, meta={"schedule": "zbv (from torch)"})


def _cpu_busy() -> float:
    """Seconds all CPUs spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _measure(step: Any, steps: int, batch: int, world: int) -> tuple[float, float, float]:
    """samples/s of ``steps`` calls of ``step``, foreign cores, our CPU ms per sample.

    The CPU time (all ranks, comm threads included) is less sensitive to a busy
    machine than the wall time: it shows each framework's own overhead.
    """
    dist.barrier()
    busy0, own0, t0 = _cpu_busy(), _own_cpu(), time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    wall = time.perf_counter() - t0
    own = torch.tensor([_own_cpu() - own0])
    dist.all_reduce(own)
    foreign = max(0.0, (_cpu_busy() - busy0 - float(own)) / wall)
    return batch * steps / wall, foreign, float(own) * 1e3 / (batch * steps)


def trace_torch(stages: list[Any], schedule: Any, opt: torch.optim.Optimizer,
                loss: str = "loss") -> tuple[list[tuple[str, float, float]], Any]:
    """Time torch's stages as orgel's executor times its actions.

    Wraps each stage's ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or
    I in a zero-bubble schedule) and ``backward_weight_one_chunk`` (W), and the
    schedule's loss (kind ``loss``). Returns the list the spans go to, ``(kind,
    start, end)`` in seconds (clear it per step), and ``opt.step`` timed as
    ``optim``.
    """
    spans: list[tuple[str, float, float]] = []

    def timed(kind: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((kind, t0, time.perf_counter()))
        return run

    for st in stages:
        st.forward_one_chunk = timed("F", st.forward_one_chunk)
        st.backward_one_chunk = timed("B", st.backward_one_chunk)
        st.backward_weight_one_chunk = timed("W", st.backward_weight_one_chunk)
    schedule._maybe_compute_loss = timed(loss, schedule._maybe_compute_loss)
    return spans, timed("optim", opt.step)


def _torch_runner(name: str, modules: list[nn.Sequential], rank: int, world: int, m: int,
                  tokens: torch.Tensor, targets: torch.Tensor) -> tuple[Any, Any, list[int]]:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    n = len(modules)
    if name == "zbv":
        mine = [rank, n - 1 - rank]
    else:
        mine = [s for s in range(n) if s % world == rank]
    stages = [PipelineStage(modules[s], s, n, torch.device("cpu")) for s in mine]
    params = [p for s in mine for p in modules[s].parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "zbv": ScheduleZBVZeroBubble}[name]
    schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=m, loss_fn=lm_loss)
    spans, opt_step = trace_torch(stages, schedule, opt)

    def step() -> None:
        spans.clear()
        opt.zero_grad()
        kwargs: dict[str, Any] = {}
        if n - 1 in mine:
            kwargs = {"target": targets, "losses": []}
        if 0 in mine:
            schedule.step(tokens, **kwargs)
        else:
            schedule.step(**kwargs)
        opt_step()

    step.spans = spans  # type: ignore[attr-defined]
    return step, schedule, mine


def _breakdown(spans: list[tuple[str, float]], wall: float) -> dict[str, Any]:
    """ms per kind of a traced step (``(kind, seconds)`` spans) and what is left of ``wall``.

    orgel's actions include its loss (in the last stage's F) and, for a split
    backward, I as ``B``; torch's loss is apart (``loss``), so it is added to F.
    """
    out: dict[str, Any] = {"wall": wall * 1e3}
    for kind, sec in spans:
        key = "F" if kind == "loss" else kind
        out[key] = out.get(key, 0.0) + sec * 1e3
        out.setdefault("n" + key, 0)
        out["n" + key] += kind != "loss"
    out["rest"] = out["wall"] - sum(out.get(k, 0.0) for k in ("F", "B", "W", "optim"))
    return out


def _traced(fw: str, runner: Any, ex: Any) -> dict[str, Any]:
    """One barrier-to-barrier step of ``runner``, broken down by kind of action."""
    dist.barrier()
    t0 = time.perf_counter()
    runner()
    wall = time.perf_counter() - t0
    if fw == "torch":
        spans = [(k, e - s) for k, s, e in runner.spans]
    else:
        spans = [("B" if e.kind == "I" else e.kind, e.end - e.start) for e in ex.events
                 if e.kind in ("F", "B", "I", "W", "optim")]
    return _breakdown(spans, wall)


def rank_bench(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """On each rank: the one-process rows, then every schedule under torch and orgel,
    alternating, ``repeats`` times."""
    config = GPTConfig(**opts["config"])
    batch, m = opts["batch"], opts["microbatches"]
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=gen)
    tokens, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    hidden = batch // m * config.seq_len * config.d_model * 4
    runners: dict[tuple[str, str], Any] = {}
    executors: dict[str, Executor] = {}
    for name in opts["schedules"]:
        n = 4 if name in ("interleaved", "zbv") else 2
        step, schedule, _ = _torch_runner(name, stage_modules(config, n), rank, world, m,
                                          tokens, targets)
        runners[("torch", name)] = step
        split = orgel_split(stage_modules(config, n), hidden)
        if name == "zbv":
            plan = torch_order_plan(schedule.pipeline_order, split.stage_graph, m)
        elif name == "interleaved":
            plan = build_schedule(name, world, m, stage_graph=split.stage_graph,
                                  stages_per_rank=2)
        else:
            plan = build_schedule(name, world, m, stage_graph=split.stage_graph)
        ex = Executor(plan, split, loss_fn=lm_loss, timeout=120,
                      optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-3))
        runners[("orgel", name)] = (lambda ex=ex: ex.step({"tokens": tokens}, targets))
        executors[name] = ex
    single = single_runner(opts, rank)
    results: dict[str, list[tuple[float, float, float]]] = {}
    for step in [single, *runners.values()]:
        for _ in range(opts["warmup"]):
            step()
    for _ in range(opts["repeats"]):
        for threads in (1, 2):
            # the thread count changes only between measurements (pool resizing is slow)
            torch.set_num_threads(threads if rank == 0 else 1)
            single()
            results.setdefault(f"one process, {threads} thread{'s' * (threads > 1)}",
                               []).append(_measure(single, opts["steps"], batch, world))
            torch.set_num_threads(1)
        for name in opts["schedules"]:
            for fw in ("torch", "orgel"):
                results.setdefault(f"{fw} {name}", []).append(
                    _measure(runners[(fw, name)], opts["steps"], batch, world))
    # traced steps: where each rank's step goes, by kind of action (median of each)
    traces: dict[str, Any] = {}
    for name in opts["schedules"]:
        for fw in ("torch", "orgel"):
            got = [_traced(fw, runners[(fw, name)], executors[name])
                   for _ in range(opts["traced"])]
            traces[f"{fw} {name}"] = {k: statistics.median(g.get(k, 0.0) for g in got)
                                      for k in got[0]}
    return {"rates": results, "trace": traces}


def single_runner(opts: dict[str, Any], rank: int) -> Any:
    """The whole model in one process (rank 0); rank 1 idles.

    Run inside the 2-rank job so that it alternates with the pipelines: a busy
    spell of the machine then hits every row alike. The idle rank waits in a
    barrier (no CPU).
    """
    config = GPTConfig(**opts["config"])
    batch, m = opts["batch"], opts["microbatches"]
    torch.manual_seed(0)
    model = GPT(config)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=gen)
    tokens, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def step() -> None:
        if rank != 0:
            return
        opt.zero_grad()
        for x, y in zip(tokens.chunk(m), targets.chunk(m), strict=True):
            (lm_loss(model(x), y) / m).backward()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--foreign-limit", type=float, default=0.25,
                        help="cores of other processes' load that flag a measurement")
    args = parser.parse_args()
    config = dict(vocab_size=1000, d_model=256, n_layers=8, n_heads=8, seq_len=128)
    opts: dict[str, Any] = {"config": config, "batch": 32, "microbatches": 8,
                            "repeats": args.repeats, "steps": args.steps,
                            "warmup": args.warmup, "schedules": args.schedules.split(","),
                            "traced": 5}
    if args.quick:
        opts.update(config=dict(vocab_size=50, d_model=16, n_layers=4, n_heads=2, seq_len=8),
                    batch=8, microbatches=4, repeats=1, steps=1, warmup=1, traced=1)
    print(f"config {opts['config']}, batch {opts['batch']}, {opts['microbatches']} "
          f"micro-batches, {opts['repeats']} repeats x {opts['steps']} steps; "
          f"load average before {os.getloadavg()[0]:.2f}")
    out = spawn(rank_bench, 2, opts, threads=1, timeout=600)
    rows = out[0]["rates"]
    base = statistics.median(x[0] for x in rows["one process, 1 thread"])
    print(f"\n{'':28s} {'samples/s':>10s} {'x 1-thread':>10s} {'x torch':>8s} "
          f"{'CPU ms/sample':>13s} {'foreign cores':>13s}")
    for name, samples in rows.items():
        rate = statistics.median(x[0] for x in samples)
        foreign = statistics.median(x[1] for x in samples)
        cpu = statistics.median(x[2] for x in samples)
        vs_torch = ""
        if name.startswith("orgel "):
            other = statistics.median(x[0] for x in rows["torch " + name[6:]])
            vs_torch = f"{rate / other:8.2f}"
        flag = "  CONTAMINATED" if foreign > args.foreign_limit else ""
        print(f"{name:28s} {rate:10.2f} {rate / base:10.2f} {vs_torch:>8s} {cpu:13.1f} "
              f"{foreign:13.2f}{flag}")
    print(f"load average after {os.getloadavg()[0]:.2f}")
    print(f"\nwhere a step goes, per rank (median of {opts['traced']} traced steps after the "
          "runs, ms): F includes the loss, B the input half of a split backward; rest = the "
          "step less its actions: waiting for peers, communication, the framework's Python")
    print(f"{'':20s} {'rank':>4s} {'step':>7s} {'F (n)':>12s} {'B (n)':>12s} {'W (n)':>12s} "
          f"{'optim':>6s} {'rest':>7s}")
    for name in opts["schedules"]:
        for fw in ("torch", "orgel"):
            for r, rank_out in enumerate(out):
                t = rank_out["trace"][f"{fw} {name}"]
                cells = [f"{t.get(k, 0.0):7.1f} ({int(t.get('n' + k, 0)):2d})"
                         for k in ("F", "B", "W")]
                print(f"{fw + ' ' + name:20s} {r:4d} {t['wall']:7.1f} {cells[0]:>12s} "
                      f"{cells[1]:>12s} {cells[2]:>12s} {t.get('optim', 0.0):6.1f} "
                      f"{t['rest']:7.1f}")


if __name__ == "__main__":
    main()
