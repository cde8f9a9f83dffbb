"""Start-up of ``orgel.pipeline``, this tree against an earlier one, side by side in one run.

    python benchmarks/startup.py --before 6541a6d --repeats 3

For each model (``examples/gpt.py``'s GPT-like workload, a small Hugging Face Llama from a
config) and each tree (``--before``: a git revision, checked out in a temporary worktree;
``after``: this checkout), a fresh Python process times ``orgel.pipeline(...)`` from the
call to the pipeline ready to step (capture, profiling, planning, splitting, the ranks
started), then one step. The trees take turns, so both see the same load. Each tree and
repeat has a profile cache (``$ORGEL_CACHE``) of its own, which the runs fill in turn:

* ``first``: the first model on an empty cache, as on a machine orgel never ran on;
* ``other``: the second model, on the cache the first left (links and host measured);
* ``again``: each model once more, as every later run of the same script.

``--cli`` times the command ``orgel run examples/gpt.py:workload --ranks 2 --steps 1``
instead, from its start to its exit (its ranks are fresh processes).

Prints one line per measurement as it is made and a table of medians with the ratio
before / after; the machine's load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[2])
import torch
import orgel

def gpt():
    from gpt import workload
    return workload()

def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, None, None

model, inputs, targets, loss_fn = {"gpt": gpt, "llama": llama}[sys.argv[1]]()
make = orgel.pipeline  # (imports orgel's API where import orgel did not: not start-up)
start = time.perf_counter()
pipe = make(model, inputs, targets, loss_fn, ranks=2, microbatches=4)
ready = time.perf_counter() - start
pipe.step(inputs, targets)
pipe.close()
print(json.dumps({"startup_s": ready}))
'''


def _measure(tree: Path, model: str, cache: Path, cli: bool = False) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "ORGEL_CACHE": str(cache),
           "OMP_NUM_THREADS": "1"}
    if cli:  # the whole command, as a user waits for it: start, plan, spawn, one step, exit
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "orgel.cli", "run",
                              str(ROOT / "examples" / "gpt.py:workload"), "--ranks", "2",
                              "--microbatches", "4", "--steps", "1"],
                             env=env, capture_output=True, text=True, timeout=900, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{tree} orgel run: {out.stderr[-2000:]}")
        return time.perf_counter() - start
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(ROOT / "examples")],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{tree} {model}: {out.stderr[-2000:]}")
    return float(json.loads(lines[-1])["startup_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="6541a6d", help="git revision to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--cli", action="store_true",
                        help="time `orgel run examples/gpt.py:workload --ranks 2 --steps 1` "
                             "(the whole command) instead of orgel.pipeline")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="orgel-startup-"))
    before = work / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before),
                    args.before], check=True, capture_output=True)
    trees = {"before": before, "after": ROOT}
    times: dict[tuple[str, str, str], list[float]] = {}
    models = ["gpt"] if args.cli else args.models.split(",")
    runs = [(m, "first" if i == 0 else "other") for i, m in enumerate(models)]
    runs += [(m, "again") for m in models]
    try:
        for r in range(args.repeats):
            for name, tree in trees.items():
                cache = work / f"cache-{name}-{r}"
                for model, case in runs:
                    s = _measure(tree, model, cache, args.cli)
                    times.setdefault((model, case, name), []).append(s)
                    print(f"{model:6s} {case:6s} {name:6s} {s:7.2f} s  "
                          f"(load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)],
                       check=False, capture_output=True)
    print(f"\nmedians of {args.repeats}, load average now {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores")
    print(f"{'model':6s} {'case':6s} {'before':>8s} {'after':>8s} {'before/after':>13s}")
    for model, case in runs:
        b = statistics.median(times[(model, case, "before")])
        a = statistics.median(times[(model, case, "after")])
        print(f"{model:6s} {case:6s} {b:8.2f} {a:8.2f} {b / a:13.2f}")


if __name__ == "__main__":
    main()
