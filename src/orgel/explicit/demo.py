"""``orgel demo``: plan, train and measure a small model on local ranks (CPU, or GPUs), end to end.

What it shows, in order: the plan the planner chose (stages, schedule,
predicted step time and memory per rank), training with a progress bar, the
first step's loss checked against a single-process run of the same model,
predicted versus measured step time, and the measured timeline written as a
PNG and as a Perfetto trace. Models are built from configs with random
weights; the GPT trains on the corpus that ships with orgel, the others on one
fixed synthetic batch.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from orgel.names import DEMO_MODELS as MODELS
from orgel.nesting import call

# Small enough for about a minute on two shared CPU cores, big enough to pipeline.
_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt": {"vocab_size": 512, "d_model": 96, "n_layers": 4, "n_heads": 4, "seq_len": 48},
    "vit": {"image_size": 32, "patch_size": 4, "d_model": 96, "n_layers": 4, "n_heads": 4},
    "clip": {"image_size": 16, "image_layers": 3, "text_layers": 2, "text_len": 16},
    "unet": {},
}


@dataclass
class DemoResult:
    """What the demo measured (times in milliseconds)."""

    losses: list[float]
    reference_loss: float
    first_loss_matches: bool
    predicted_step: float | None
    measured_step: float
    files: dict[str, str] = field(default_factory=dict)


def _batches(name: str, workload: Any, batch_size: int) -> Iterator[tuple[Any, Any]]:
    if name == "gpt":
        from orgel.data import text_batches

        cfg = workload.model.config
        for tokens, targets in text_batches(batch_size, cfg.seq_len, cfg.vocab_size, seed=1):
            yield (tokens,), targets
    while True:
        yield workload.inputs, workload.targets


def _reference_loss(workload: Any, model: torch.nn.Module, pieces: int,
                    precision: str = "32") -> float:
    """The first step's loss in one process on the CPU: the mean of the losses of the same
    ``pieces``.

    A step's loss is the mean over micro-batches and, inside a data-parallel
    stage, over each replica's share: losses such as CLIP's that depend on the
    batch composition must be cut the same way to compare.
    """
    from orgel.precision import autocast
    from orgel.workload import Workload
    from orgel.workload import microbatches as slice_batches

    w = Workload(model, workload.inputs, workload.targets, workload.loss_fn)
    with torch.no_grad(), autocast(precision, "cpu"):
        losses = [float(w.loss_fn(call(model, inp), tgt)) for inp, tgt in slice_batches(w, pieces)]
    return sum(losses) / len(losses)


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def describe_plan(plan: Any) -> str:
    """The plan as the demo prints it: stages, schedule, predicted step time and memory."""
    lines = []
    meta = plan.meta
    label = meta.get("schedule_label") or meta.get("schedule", "?")
    lines.append(f"plan: {plan.num_stages} stages on {plan.num_ranks} ranks, {plan.microbatches} "
                 f"micro-batches, schedule {label} (planner: {meta.get('planner', 'given')})")
    costs = plan.costs
    for s, stage in enumerate(plan.stage_graph.stages):
        what = f"{len(stage.blocks)} blocks" if stage.blocks else f"{len(stage.nodes)} ops"
        extra = ""
        if costs is not None:
            c = costs.stages[s]
            extra = f", fwd {c.fwd:.2f} ms, bwd {c.bwd:.2f} ms, params {_mib(c.params)}"
        lines.append(f"  stage {s}: ranks {list(plan.placement[s])}, {what}{extra}")
    lines.append("schedule:")
    for row in plan.schedule_text().splitlines():
        lines.append("  " + (row if len(row) <= 110 else row[:107] + "..."))
    pred = plan.prediction or {}
    if pred.get("step_time") is not None:
        mem = ", ".join(f"rank{row['rank']} {_mib(row['peak_memory'])}"
                        for row in pred.get("per_rank", []))
        lines.append(f"predicted step time {pred['step_time']:.1f} ms, bubble "
                     f"{pred.get('bubble_fraction', 0.0):.0%}; peak memory {mem}")
    else:
        lines.append("predicted step time: n/a (the plan carries no measured costs)")
    return "\n".join(lines)


def run_demo(*, model: str = "gpt", ranks: int = 2, steps: int = 20, microbatches: int = 4,
             batch_size: int = 16, out: str | Path = "orgel-demo", seed: int = 0,
             stream: TextIO | None = None, progress: bool = True,
             precision: str = "32", device: str = "cpu", compile: bool = False) -> DemoResult:
    """Run the demo and print to ``stream`` (stdout); files go to ``out``.

    ``compile``: the stages run compiled by Inductor (:mod:`orgel.runtime.compiled`).

    ``precision``: ``"32"`` or ``"bf16-mixed"`` (see :mod:`orgel.precision`).
    ``device``: ``"cpu"``, ``"cuda"`` or ``"auto"`` (:mod:`orgel.launch.devices`).
    """
    from orgel.launch.devices import backend_for, resolve_device

    device = resolve_device(device)
    import threading

    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing one; the forked ranks would inherit it
    # and leave "leaked semaphore" warnings at exit. One process draws the bar.
    tqdm.set_lock(threading.RLock())

    from orgel.explicit.api import pipeline
    from orgel.models import build
    from orgel.runtime.trace import save_views

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    stream = stream or sys.stdout
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)

    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    workload = build(model, batch_size=batch_size, seed=seed, **_CONFIGS[model])
    data = _batches(model, workload, batch_size)
    first_inputs, first_targets = next(data)
    workload = workload._replace(inputs=first_inputs, targets=first_targets)
    n_params = sum(p.numel() for p in workload.model.parameters())
    where = "CPU" if device == "cpu" else "CUDA"
    say(f"orgel demo: {model} with {n_params / 1e6:.2f} M parameters (random init), batch "
        f"{batch_size}, {ranks} local {where} ranks ({backend_for(device, ranks)})")
    initial = copy.deepcopy(workload.model)  # the single-process run starts from these weights

    started = time.perf_counter()
    pipe = pipeline(workload.model, first_inputs, first_targets, workload.loss_fn, ranks=ranks,
                    microbatches=microbatches, precision=precision, device=device,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    compile=compile)
    with pipe:
        say(f"captured, planned and started the ranks in {time.perf_counter() - started:.1f} s")
        say(describe_plan(pipe.plan))
        replicas = len(pipe.plan.placement[0])  # every stage has this many replicas
        # on the CPU: the caller of forked CUDA ranks never uses CUDA (they could not)
        reference = _reference_loss(workload, initial, microbatches * replicas, precision)
        losses: list[float] = []
        times: list[float] = []
        bar = tqdm(total=steps, unit="step", disable=not progress, file=sys.stderr,
                   dynamic_ncols=True)
        inputs, targets = first_inputs, first_targets
        for step in range(steps):
            t = time.perf_counter()
            losses.append(pipe.step(inputs, targets))
            times.append(time.perf_counter() - t)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", samples_s=f"{batch_size / times[-1]:.0f}")
            bar.update(1)
            if step + 1 < steps:
                inputs, targets = next(data)
        bar.close()
        if compile:
            seconds = ", ".join(f"{s:.1f}" for s in pipe.compile_s)
            say(f"compiling the stages took {seconds} s (by rank, in the first step)")
        events = pipe.timeline()
        plan = pipe.plan
    # another device's kernels (and its autocast) round otherwise
    tolerance = 1e-4 if device == "cpu" or precision == "32" else 2e-3
    matches = abs(losses[0] - reference) <= tolerance * max(1.0, abs(reference))
    say(f"first step loss {losses[0]:.5f} vs single-process {reference:.5f}: "
        + ("match" if matches else "MISMATCH"))
    say(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps")
    steady = times[1:] or times
    measured = statistics.median(steady) * 1e3
    predicted = (plan.prediction or {}).get("step_time")
    if predicted is not None:
        say(f"step time: predicted {predicted:.1f} ms, measured {measured:.1f} ms (median of "
            f"{len(steady)} steps, ratio {measured / predicted:.2f})")
    else:
        say(f"step time: measured {measured:.1f} ms (median of {len(steady)} steps)")
    files = {"plan": str(outdir / "plan.json"), "trace": str(outdir / "trace.json"),
             "png": str(outdir / "timeline.png")}
    plan.save(files["plan"])
    # the measured last step above the simulator's run of the same plan
    save_views(plan, events, trace=files["trace"], png=files["png"])
    say(f"wrote {files['png']} (timeline), {files['trace']} (open in https://ui.perfetto.dev), "
        f"{files['plan']}")
    return DemoResult(losses, reference, matches, predicted, measured, files)
