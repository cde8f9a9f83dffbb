"""Capture time against depth: a Hugging Face Llama traced whole, and two layers traced and copied.

    python benchmarks/capture_depth.py --depths 4,8,16 --repeats 3

``orgel.pipeline`` captures the forward with symbolic sizes; a stack of alike layers is
traced two layers deep and copied to the model's depth where the copy computes what the
model does (:mod:`orgel.graph.repeat`). For each depth, a fresh Python process times one
``orgel.graph.capture`` of the model on one micro-batch (4 x 64 tokens) both ways (the
two take turns, so they see the same load), and prints each measurement as it is made,
then a table of medians with the ratio whole / copied and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from orgel.graph import capture
from orgel.workload import named_inputs

depth, shallow = int(sys.argv[1]), sys.argv[2] == "copied"
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=depth, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=128, use_cache=False)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
named = named_inputs(model, {"input_ids": ids, "labels": ids})
start = time.perf_counter()
graph = capture(model, named, shallow=shallow)
seconds = time.perf_counter() - start
copied = any(n.startswith("traced two of the") for n in graph.notes)
print(json.dumps({"seconds": seconds, "nodes": len(graph.nodes), "copied": copied}))
'''


def _measure(depth: int, way: str) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(depth), way], env=env,
                         capture_output=True, text=True, timeout=1800, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"depth {depth} {way}: {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="4,8,16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats):
        for depth in depths:
            for way in ("whole", "copied"):
                got = _measure(depth, way)
                if (way == "copied") != got["copied"]:
                    raise RuntimeError(f"depth {depth}: asked {way}, got copied={got['copied']}")
                times.setdefault((depth, way), []).append(got["seconds"])
                print(f"{depth:3d} layers {way:6s} {got['seconds']:7.2f} s  "
                      f"{int(got['nodes'])} nodes  (load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"\nmedians of {args.repeats}, load average now {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores")
    print(f"{'layers':>6s} {'whole':>8s} {'copied':>8s} {'whole/copied':>13s}")
    for depth in depths:
        whole = statistics.median(times[(depth, "whole")])
        copied = statistics.median(times[(depth, "copied")])
        print(f"{depth:6d} {whole:8.2f} {copied:8.2f} {whole / copied:13.2f}")


if __name__ == "__main__":
    main()
