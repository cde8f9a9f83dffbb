"""orgel's automatic plan against a hand split with torch.distributed.pipelining.

For each workload (GPT-like with a large vocabulary head, a Hugging Face Llama,
ViT-like, U-Net-like with long skips, CLIP-like two towers) and each rank count:

* **torch, by hand**, as its documentation teaches: the model cut into stages
  with an equal number of layers (embedding on the first stage, head and loss on
  the last; a model that is not a chain is cut in order and what crosses a cut
  rides through, see ``hand_split.py``), one ``PipelineStage`` per piece, and
  torch's own schedule classes: GPipe, 1F1B, interleaved 1F1B (2 stages per
  rank) and ZBV (2 stages per rank in a V), each where it applies. torch's best
  schedule (the highest median over the timed rounds) is the one compared:
  picking the best of four noisy medians favours torch a little.
* **orgel**: ``orgel.pipeline(model, inputs, targets, loss_fn, ranks=N,
  microbatches=m)`` with every other option at its default (it profiles and
  plans itself), the same model, weights, batch, micro-batch count and optimizer
  (AdamW, lr 1e-3: orgel's default).

Both run on local gloo ranks with ``cores // ranks`` threads each (at least 1:
4 ranks share the 2 cores), the torch ranks and orgel's workers alive side by
side, each idle (blocked on a pipe) while the other runs. A torch step is timed
on its ranks between two barriers; an orgel step is ``pipe.step`` timed in the
calling process (it includes sending the batch to the workers and the loss
back). After a warm-up, each of ``--rounds`` rounds runs ``--steps`` steps of
orgel and of every torch schedule, in an order that rotates from round to
round, so that a busy spell of the shared machine hits every system alike; the
medians of all timed steps are compared. The first-step loss of every torch
schedule and of orgel are checked against each other (same weights, same
micro-batches). The CPU time of every rank (from /proc) and the other
processes' load during the rounds (from /proc/stat, in cores) are printed too:
when other processes take cores, a rank's "compute" spans stretch with them,
while the CPU time does not.

Each row is explained from both timelines: per rank, the compute time (forward,
backward, loss, optimizer; for torch, spans recorded around its stages'
``forward_one_chunk``/``backward_*`` calls), hence the imbalance (slowest rank's
compute minus the mean) and what is left of the step on the slowest rank
(bubble, communication waits, runtime overhead); for orgel also the
simulator's prediction and, from the controller, the dispatch overhead.

    python benchmarks/auto_vs_hand.py                 # the full table (about 10 minutes)
    python benchmarks/auto_vs_hand.py --quick         # GPT-like and CLIP-like on 2 ranks
    python benchmarks/auto_vs_hand.py --tiny --workloads gpt --ranks 2   # seconds: checks it runs
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import re
import signal
import statistics
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hand_predict import predicted_steps  # noqa: E402
from hand_split import WORKLOADS, Workload, cut  # noqa: E402
from vs_torch_pipelining import _cpu_busy, _own_cpu, trace_torch  # noqa: E402

import orgel  # noqa: E402
from orgel.launch.processes import free_port  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
#: batch per workload (the micro-batch count is 2 per rank)
BATCH = {"gpt": 8, "llama": 8, "vit": 16, "unet": 16, "clip": 32}
LR = 1e-3


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` (threads included) so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _threads(ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks)


# -- the torch side: one process per rank, driven over a pipe ---------------------------------


def _torch_schedule(work: Workload, name: str, rank: int, world: int, m: int) -> Any:
    """torch's stages and schedule ``name`` for this rank; a step function, or None if it
    does not apply (fewer layers than stages)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    n = world * (2 if name in ("interleaved", "zbv") else 1)
    try:
        modules = cut(copy.deepcopy(work.pieces), n)  # every schedule starts from the same weights
    except ValueError:
        return None
    mine = [rank, n - 1 - rank] if name == "zbv" else [s for s in range(n) if s % world == rank]
    stages = [PipelineStage(modules[s], s, n, torch.device("cpu")) for s in mine]
    opt = torch.optim.AdamW([p for s in mine for p in modules[s].parameters()], lr=LR)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "zbv": ScheduleZBVZeroBubble}[name]
    schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=m,
                   loss_fn=work.stage_loss)
    spans, opt_step = trace_torch(stages, schedule, opt, loss="L")

    def step() -> tuple[float, float | None, float, dict[str, float]]:
        """One barrier-to-barrier step: wall seconds, the loss (on its rank), compute seconds."""
        spans.clear()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": work.targets, "losses": losses} if n - 1 in mine else {}
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        if 0 in mine:
            schedule.step(*work.args, **kwargs)
        else:
            schedule.step(**kwargs)
        opt_step()
        dist.barrier()
        wall = time.perf_counter() - t0
        loss = float(torch.stack([x.detach() for x in losses]).mean()) if losses else None
        kinds: dict[str, float] = {}
        for kind, s, e in spans:
            kinds[kind] = kinds.get(kind, 0.0) + e - s
        return wall, loss, sum(kinds.values()), kinds

    return step


def _torch_rank(rank: int, world: int, port: int, work: Workload, m: int,
                schedules: list[str], conn: Connection) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # die with the benchmark
    except OSError:
        pass
    torch.set_num_threads(_threads(world))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        steps = {name: _torch_schedule(work, name, rank, world, m) for name in schedules}
        conn.send([name for name, s in steps.items() if s is not None])
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            name, count = cmd
            conn.send([steps[name]() for _ in range(count)])
    except BaseException:  # noqa: BLE001 - reported to the driver
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exception_line(text: str) -> str:
    """The ``SomeError: message`` line of a traceback (the first one, up to 160 characters)."""
    lines = [ln for ln in text.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (lines[0] if lines else text.strip().splitlines()[-1])[:160]


class TorchFailure(RuntimeError):
    """A torch schedule raised on some rank; the group is closed."""


class TorchGroup:
    """``world`` forked ranks that run torch's schedules on command."""

    def __init__(self, work: Workload, world: int, m: int, schedules: list[str]) -> None:
        ctx = mp.get_context("fork")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_torch_rank, args=(rank, world, port, work, m, schedules, child),
                            daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.schedules: list[str] = self._gather()[0]

    def _gather(self) -> list[Any]:
        replies = [c.recv() for c in self.conns]
        errors = [f"rank {k}: {_exception_line(r[1])}" for k, r in enumerate(replies)
                  if isinstance(r, tuple) and r and r[0] == "error"]
        if errors:
            self.close()
            # the rank that failed first is the one whose error is not a broken connection
            errors.sort(key=lambda e: ("peer" in e or "timeout" in e.lower(), e))
            raise TorchFailure("; ".join(errors))
        return replies

    def run(self, name: str, steps: int) -> list[dict[str, Any]]:
        """``steps`` steps of ``name``: per step the wall time, loss and per-rank compute."""
        cpu0 = cpu_seconds([p.pid for p in self.procs if p.pid is not None])
        for c in self.conns:
            c.send((name, steps))
        per_rank = self._gather()
        cpu = cpu_seconds([p.pid for p in self.procs if p.pid is not None]) - cpu0
        out = []
        for i in range(steps):
            loss = next((r[i][1] for r in per_rank if r[i][1] is not None), None)
            kinds: dict[str, float] = {}
            for r in per_rank:
                for k, v in r[i][3].items():
                    kinds[k] = kinds.get(k, 0.0) + v
            out.append({"wall": max(r[i][0] for r in per_rank), "loss": loss,
                        "busy": [r[i][2] for r in per_rank], "kinds": kinds,
                        "cpu": cpu / steps})
        return out

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# -- the orgel side ---------------------------------------------------------------------------

COMPUTE = ("F", "B", "I", "W", "optim")


def orgel_steps(pipe: Any, work: Workload, steps: int) -> list[dict[str, Any]]:
    """``steps`` calls of ``pipe.step``, timed here; the last one's measured timeline."""
    out = []
    cpu0 = cpu_seconds(pipe.worker_pids)
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = pipe.step(work.inputs, work.targets)
        out.append({"wall": time.perf_counter() - t0, "loss": loss})
    cpu = (cpu_seconds(pipe.worker_pids) - cpu0) / steps
    for r in out:
        r["cpu"] = cpu
    events = pipe.timeline()
    busy = [0.0] * pipe.num_ranks
    kinds: dict[str, float] = {}
    for e in events:
        if e.kind in COMPUTE:
            busy[e.rank] += e.end - e.start
            kinds[e.kind] = kinds.get(e.kind, 0.0) + e.end - e.start
    out[-1]["busy"] = busy
    out[-1]["kinds"] = kinds
    out[-1]["trace"] = max(e.end for e in events) - min(e.start for e in events)
    return out


def plan_summary(plan: Any) -> str:
    """Stages per rank, schedule family, micro-batches, recomputed stages, planner."""
    per_rank = plan.num_stages if hasattr(plan, "num_stages") else plan.stage_graph.num_stages
    label = plan.meta.get("schedule_label") or plan.meta.get("schedule", "?")
    recompute = sum(bool(r) for r in plan.recompute)
    replicas = len(plan.placement[0])
    text = (f"{per_rank // plan.num_ranks * replicas} st/rank, {label}, "
            f"{plan.microbatches} mb, recompute {recompute}/{per_rank}")
    if replicas > 1:
        text += f", dp {replicas}"
    return text


def stage_shares(plan: Any) -> str:
    """Each stage's predicted forward+backward (ms per micro-batch) from the plan's costs."""
    if plan.costs is None:
        return "?"
    return "/".join(f"{c.fwd + c.bwd:.0f}" for c in plan.costs.stages)


# -- one row ----------------------------------------------------------------------------------


def _split_busy(busy: list[float], wall: float) -> str:
    """'step S = mean compute + imbalance + rest' in ms."""
    mean, top = statistics.mean(busy), max(busy)
    return (f"{wall * 1e3:.0f} ms = compute {mean * 1e3:.0f} (mean/rank) + imbalance "
            f"{(top - mean) * 1e3:.0f} + bubble/comm/overhead {(wall - top) * 1e3:.0f}")


def _kinds(runs: list[dict[str, Any]]) -> str:
    """Compute time of all ranks per step by kind (mean over ``runs``), in ms."""
    names = sorted({k for r in runs for k in r["kinds"]}, key="FBIWLoptim".find)
    return ", ".join(f"{k} {statistics.mean(r['kinds'].get(k, 0.0) for r in runs) * 1e3:.0f}"
                     for k in names)


def bench_row(key: str, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    m = 2 * ranks
    batch = 4 * ranks if args.tiny else BATCH[key]
    work = WORKLOADS[key](batch, args.tiny)
    row: dict[str, Any] = {"workload": work.name, "ranks": ranks, "m": m, "batch": batch}
    group = TorchGroup(work, ranks, m, list(args.schedules))
    t0 = time.perf_counter()
    pipe = orgel.pipeline(work.model, work.inputs, work.targets, work.loss_fn, ranks=ranks,
                          microbatches=m)
    row["setup"] = time.perf_counter() - t0
    try:
        first_orgel = orgel_steps(pipe, work, 1)[0]["loss"]
        first_torch: dict[str, float] = {}
        failed: dict[str, str] = {}
        applicable = list(group.schedules)
        for name in applicable:  # warm-up, and the sanity check's first-step losses
            try:
                first_torch[name] = group.run(name, args.warmup)[0]["loss"]
            except TorchFailure as err:  # the group is closed: start one without it
                failed[name] = str(err)
                group = TorchGroup(work, ranks, m, [s for s in applicable if s not in failed])
        row["failed"] = failed
        row["not_applicable"] = [s for s in args.schedules if s not in applicable]
        if args.warmup > 1:
            orgel_steps(pipe, work, args.warmup - 1)
        # every round runs orgel and each torch schedule, in an order that rotates
        systems = ["orgel", *first_torch]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        busy0, own0, t1 = _cpu_busy(), _own_cpu(), time.perf_counter()
        for i in range(args.rounds):
            for name in systems[i % len(systems):] + systems[:i % len(systems)]:
                runs[name] += (orgel_steps(pipe, work, args.steps) if name == "orgel"
                               else group.run(name, args.steps))
        # other processes' CPU during the timed rounds, in cores (the machine is shared)
        own = _own_cpu() - own0 + sum(r["cpu"] for rs in runs.values() for r in rs)
        row["foreign"] = max(0.0, (_cpu_busy() - busy0 - own) / (time.perf_counter() - t1))
        rates = {name: batch / statistics.median(r["wall"] for r in rs)
                 for name, rs in runs.items()}
        orgel_runs = runs.pop("orgel")
        best = max(runs, key=lambda k: rates[k])
        torch_runs = runs[best]
        row.update(
            rates=rates, best=best, first_torch=first_torch, first_orgel=first_orgel,
            torch=rates[best], orgel=rates["orgel"],
            plan=plan_summary(pipe.plan), shares=stage_shares(pipe.plan),
            predicted=pipe.predicted().step_time,
            baselines=pipe.plan.meta.get("baselines", {}))
        torch_busy = [statistics.mean(r["busy"][k] for r in torch_runs) for k in range(ranks)]
        with_trace = [r for r in orgel_runs if "busy" in r]
        orgel_busy = [statistics.mean(r["busy"][k] for r in with_trace) for k in range(ranks)]
        row["torch_line"] = _split_busy(torch_busy,
                                        statistics.median(r["wall"] for r in torch_runs))
        trace = statistics.median(r["trace"] for r in with_trace)
        dispatch = statistics.median(r["wall"] - r["trace"] for r in with_trace)
        row["orgel_line"] = (_split_busy(orgel_busy, trace) + f"; + dispatch "
                             f"{dispatch * 1e3:.0f} (controller)")
        row["torch_busy"], row["orgel_busy"] = torch_busy, orgel_busy
        row["torch_cpu"] = statistics.median(r["cpu"] for r in torch_runs) * 1e3
        row["orgel_cpu"] = statistics.median(r["cpu"] for r in orgel_runs) * 1e3
        row["torch_kinds"] = _kinds(torch_runs)
        row["orgel_kinds"] = _kinds(with_trace)
        # the same hand split and schedules priced by orgel's model, from orgel's table
        row["hand_predicted"] = predicted_steps(work, ranks, m, list(first_torch), pipe.plan)
    finally:
        pipe.close()
        group.close()
    return row


def _predicted_ratio(row: dict[str, Any]) -> float:
    """orgel / torch as orgel's model predicts it: its predicted step of torch's hand split
    under the schedule measured fastest, over that of its own plan."""
    predicted = row["hand_predicted"]
    return predicted[row["best"]] / predicted["orgel"]


def _measured_ms(row: dict[str, Any], name: str) -> float:
    return row["batch"] / row["rates"][name] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="GPT-like and CLIP-like on 2 ranks, fewer steps")
    parser.add_argument("--tiny", action="store_true", help="tiny models (checks it runs)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per system and round")
    args = parser.parse_args()
    if args.quick:
        if args.workloads == ",".join(WORKLOADS):
            args.workloads = "gpt,clip"
        args.ranks = "2"
        args.warmup, args.rounds, args.steps = 1, 2, 2
    if args.tiny:
        args.warmup, args.rounds, args.steps = 1, 2, 1
    keys = args.workloads.split(",")
    args.schedules = args.schedules.split(",")
    ranks = [int(r) for r in args.ranks.split(",")]
    start = time.time()
    print(f"auto_vs_hand: {time.strftime('%Y-%m-%d %H:%M %Z')}, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; "
          f"warm-up {args.warmup} steps; {args.rounds} rounds of {args.steps} steps of orgel "
          "and of every torch schedule, alternating", flush=True)
    rows = []
    for key in keys:
        for n in ranks:
            row = bench_row(key, n, args)
            rows.append(row)
            losses = [row["first_orgel"], *row["first_torch"].values()]
            spread = max(losses) - min(losses)
            print(f"\n{row['workload']} on {n} ranks (batch {row['batch']}, {row['m']} "
                  f"micro-batches; orgel set up in {row['setup']:.0f} s); load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
            print(f"  sanity: first-step loss orgel {row['first_orgel']:.6f}, torch "
                  + ", ".join(f"{k} {v:.6f}" for k, v in row["first_torch"].items())
                  + f" -> {'same' if spread < 1e-4 * max(1.0, abs(losses[0])) else 'DIFFERENT'}"
                  f" (spread {spread:.1e})")
            print("  torch, every schedule (samples/s): " + ", ".join(
                f"{k} {v:.2f}" for k, v in row["rates"].items() if k != "orgel")
                + "".join(f"; {k} n/a (fewer layers than stages)"
                          for k in row["not_applicable"])
                + "".join(f"; {k} FAILS ({v})" for k, v in row["failed"].items()))
            print(f"  orgel plan: {row['plan']}; predicted {row['predicted']:.0f} ms; stage "
                  f"F+B ms/mb {row['shares']}; its predicted baselines: " + ", ".join(
                      f"{k} {v:.0f} ms" for k, v in row["baselines"].items()))
            print(f"  torch {row['best']}: {row['torch_line']}")
            print(f"  orgel: {row['orgel_line']}")
            print(f"  compute of all ranks by kind (ms/step): torch {row['torch_kinds']}; "
                  f"orgel {row['orgel_kinds']}; CPU time of all ranks (ms/step): torch "
                  f"{row['torch_cpu']:.0f}, orgel {row['orgel_cpu']:.0f}")
            print("  step ms, predicted / measured: " + ", ".join(
                f"{k} {v:.0f} / {_measured_ms(row, k):.0f}"
                for k, v in row["hand_predicted"].items()))
            print(f"  -> torch {row['torch']:.2f} samples/s, orgel {row['orgel']:.2f}, "
                  f"ratio {row['orgel'] / row['torch']:.2f} (predicted "
                  f"{_predicted_ratio(row):.2f}); other processes' load "
                  f"{row['foreign']:.2f} cores", flush=True)
    print("\n| workload | ranks | torch best | torch samples/s | orgel plan | orgel samples/s "
          "| orgel / torch | predicted | foreign load |\n|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['workload']} | {row['ranks']} | {row['best']} | {row['torch']:.2f} | "
              f"{row['plan']} | {row['orgel']:.2f} | {row['orgel'] / row['torch']:.2f} | "
              f"{_predicted_ratio(row):.2f} | {row['foreign']:.2f} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; "
          f"{(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
