"""One rank holding the whole model: orgel eager and compiled against plain PyTorch eager and
``torch.compile``, on the same device, side by side.

What it measures: the runtime's own overhead (orgel eager / plain eager) and what compiling
buys (orgel compiled / orgel eager), and whether orgel's compiled stages keep up with
``torch.compile`` of the whole model (orgel compiled / torch.compile). Every variant runs
in a fresh process of its own (clean GPU memory, its own compile caches), trains a GPT with
AdamW for ``--warmup`` steps (compiling, for the compiled ones) and then ``--steps`` timed
steps; the step time is the median. Each result is printed, and appended to ``--out`` as a
JSON line, as soon as it is known: a run cut short still reports.

    python benchmarks/compiled_throughput.py --device cuda             # ~190 M parameters
    python benchmarks/compiled_throughput.py --device cuda --precision bf16-mixed
    python benchmarks/compiled_throughput.py --device cpu --small      # the CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("plain-eager", "plain-compile", "orgel-eager", "orgel-compile")
LARGE = {"vocab_size": 16384, "d_model": 1024, "n_layers": 12, "n_heads": 16, "seq_len": 512}
SMALL = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32}


def _model_and_batch(small: bool, batch: int) -> tuple[Any, Any, Any, Any]:
    import torch

    from orgel.models.gpt import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    cfg = GPTConfig(**(SMALL if small else LARGE))
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    return model, tokens, torch.roll(tokens, -1, dims=1), lm_loss


def run_variant(variant: str, device: str, small: bool, batch: int, warmup: int,
                steps: int, precision: str = "32") -> dict[str, Any]:
    """Train ``variant`` and return its timings (this process only). ``precision``:
    ``"32"`` or ``"bf16-mixed"`` (the forward and the loss under bfloat16 autocast, as
    orgel's ``precision="bf16-mixed"`` runs them)."""
    import contextlib

    import torch

    torch.set_float32_matmul_precision("high")  # TF32 on the GPU, for every variant alike
    model, x, y, loss_fn = _model_and_batch(small, batch)
    params = sum(p.numel() for p in model.parameters())
    times: list[float] = []
    start = time.perf_counter()
    if variant.startswith("plain"):
        model = model.to(device)
        x, y = x.to(device), y.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        run = torch.compile(model) if variant == "plain-compile" else model

        def autocast() -> Any:
            return (torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
                    if precision == "bf16-mixed" else contextlib.nullcontext())

        def step() -> float:
            with autocast():
                loss = loss_fn(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
        start_up = time.perf_counter() - start
        closer = None
    else:
        import orgel

        # one stage: a schedule's plan needs no profiling, and nothing in this process
        # captures before the rank forks (orgel.launch.devices.check_fork)
        # the loss rule given (a token mean): finding it takes trial forwards of the batch on
        # the CPU in the rank, with one thread; on an H200 (2026-11-28) the large GPT's rank
        # had not started after 70 s
        pipe = orgel.pipeline(model, (x,), y, loss_fn, ranks=1, microbatches=1,
                              schedule="gpipe", loss_rule="items",
                              device=device, compile=variant == "orgel-compile",
                              precision=precision,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
        start_up = time.perf_counter() - start

        def step() -> float:
            return float(pipe.step(x, y))
        closer = pipe
    first = time.perf_counter()
    losses = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        losses.append(step())  # float(): waits for the device
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    warm_s = time.perf_counter() - first - sum(times)
    compile_s = None
    if closer is not None:
        compile_s = max(closer.compile_s)
        closer.close()
    median = statistics.median(times)
    return {"variant": variant, "device": device, "precision": precision,
            "params_m": round(params / 1e6, 1),
            "batch": batch, "step_ms": round(median * 1e3, 2),
            "tokens_per_s": round(x.numel() / median), "start_up_s": round(start_up, 1),
            "warmup_s": round(warm_s, 1), "compile_s": compile_s,
            "first_loss": losses[0], "last_loss": losses[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny GPT (the CPU smoke run)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--precision", default="32", choices=("32", "bf16-mixed"))
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per variant")
    parser.add_argument("--out", default=None, help="append each result here (JSON lines)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this variant
    args = parser.parse_args(argv)
    if args.one:
        result = run_variant(args.one, args.device, args.small, args.batch, args.warmup,
                             args.steps, args.precision)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    results: dict[str, dict[str, Any]] = {}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src")
               + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--one", variant, "--device", args.device,
               "--batch", str(args.batch), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--precision", args.precision]
        cmd += ["--small"] if args.small else []
        try:
            # the child's stderr goes straight to ours: where a variant that timed out was
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout,
                                  env=env)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            result = (json.loads(lines[-1][7:]) if lines else
                      {"variant": variant, "error": f"exit {done.returncode} (see stderr)",
                       "stdout": done.stdout[-1500:]})
        except subprocess.TimeoutExpired:
            result = {"variant": variant, "error": f"did not finish in {args.timeout:.0f} s"}
        results[variant] = result
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    ms = {k: v["step_ms"] for k, v in results.items() if "step_ms" in v}
    ratios = {
        "orgel eager / plain eager (throughput)": ("plain-eager", "orgel-eager"),
        "orgel compiled / torch.compile": ("plain-compile", "orgel-compile"),
        "orgel compiled / orgel eager": ("orgel-eager", "orgel-compile"),
        "torch.compile / plain eager": ("plain-eager", "plain-compile"),
    }
    for label, (base, new) in ratios.items():
        if base in ms and new in ms:
            line = f"{label}: {ms[base] / ms[new]:.3f}x"
            print(line)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({"ratio": label, "precision": args.precision,
                                        "value": round(ms[base] / ms[new], 3)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
