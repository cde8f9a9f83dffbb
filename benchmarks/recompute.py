"""Recompute policies on the CPU: what a stage's forward keeps, predicted against measured,
and what the recompute costs in time, side by side in one run.

    python benchmarks/recompute.py --layers 8 --repeats 5

A small Hugging Face Llama (random weights, from a config) is captured and split into one
stage; for each policy of :data:`orgel.schedule.ir.RECOMPUTE` the stage runs its forward
under :func:`orgel.runtime.checkpointing.checkpointed` (``True``: under ``no_grad``, as the
runtime's forward of a recomputed stage) and its backward (``True``: the forward again
first). Printed per policy: the bytes alive after the forward (``LiveBytes``, less the
output), what :func:`orgel.graph.kept.kept_bytes` predicted, the most bytes alive during the
backward on top of them (``rebuilt``: what the recompute rebuilds, the gradients and the
backward's temporaries) against what the planner's model rebuilds
(:func:`orgel.costs.recompute.policy_effects` over the stage's block facts), and the median
time of a forward and backward against keeping every activation, with the forward the model
runs again over the forward's time. The machine's load is printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from orgel.graph import capture
from orgel.graph.kept import kept_bytes
from orgel.plan.balanced import balanced_plan
from orgel.profile.memory import LiveBytes
from orgel.runtime.checkpointing import checkpointed
from orgel.split import split_plan


def _stage(layers: int, rows: int, length: int) -> tuple[object, object, list[object], object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (rows, length))
    batch = {"input_ids": ids, "labels": ids}
    graph = capture(model, batch)
    stage = split_plan(graph, balanced_plan(graph, ranks=1, microbatches=1)).stages[0]
    args = [int(batch[stage.sizes[n][0]].shape[stage.sizes[n][1]]) if n in stage.sizes
            else batch[n] for n in stage.inputs]
    return graph, stage, args, model


def _once(stage: object, policy: bool | str, args: list[object]) -> tuple[int, int, float]:
    """Bytes kept after the forward, the most alive during the backward beyond them, time."""
    run = checkpointed(stage.module, policy, stage.layers)  # type: ignore[attr-defined]
    start = time.perf_counter()
    with LiveBytes() as live:
        with torch.set_grad_enabled(policy is not True):
            out = run(*args)
        kept = live.now - sum(t.numel() * t.element_size() for t in out)
        live.peak = live.now
        if policy is True:  # the runtime's recomputed stage: its forward again, then backward
            out = run(*args)
        out[0].sum().backward()
        extra = live.peak - kept - sum(t.numel() * t.element_size() for t in out)
    return kept, extra, time.perf_counter() - start


def _model(graph: object, stage: object, fwd_ms: float) -> dict[object, tuple[int, float]]:
    """Per policy, what the planner's model says the backward rebuilds and the forward it
    runs again over ``fwd_ms`` (the stage as one block, its facts from the capture)."""
    import numpy as np

    from orgel.costs.devices import DEVICES
    from orgel.costs.recompute import policy_effects, stage_policies
    from orgel.profile.recompute import block_facts
    from orgel.profile.roofline import Roofline

    names = [n for _, run in stage.layers for n in run]  # type: ignore[attr-defined]
    facts = block_facts(graph, [names], [fwd_ms], Roofline(graph, DEVICES["h100-80gb"]))
    known = [stage_policies(facts, [0])]
    acts = np.array([sum(graph.nodes[n].saved_bytes for n in names)])  # type: ignore[attr-defined]
    out: dict[object, tuple[int, float]] = {}
    for policy in (False, True, "layer", "selective"):
        again, _, rebuilt = policy_effects([policy], np.array([fwd_ms]), acts, np.zeros(1), known)
        out[policy] = (int(rebuilt[0]), float(again[0]) / fwd_ms)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    graph, stage, inputs, _ = _stage(args.layers, args.rows, args.length)
    names = [n for _, run in stage.layers for n in run]  # type: ignore[attr-defined]
    policies: list[bool | str] = [False, True, "layer", "selective"]
    print(f"Llama, {args.layers} layers, hidden 256, batch {args.rows}x{args.length}; "
          f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    times: dict[object, list[float]] = {p: [] for p in policies}
    kept: dict[object, int] = {}
    extra: dict[object, int] = {}
    for _ in range(args.repeats):  # the policies take turns: each sees the same load
        for policy in policies:
            kept[policy], extra[policy], seconds = _once(stage, policy, inputs)
            times[policy].append(seconds)
    base = statistics.median(times[False])
    fwd = base / 3 * 1e3  # a forward is about a third of a forward and backward
    model = _model(graph, stage, fwd)
    print(f"{'policy':>10} {'kept MB':>9} {'predicted':>9} {'pred/meas':>9} "
          f"{'kept/none':>9} {'bwd+ MB':>8} {'rebuilt':>8} {'time ms':>8} {'time/none':>9} "
          f"{'again':>6}")
    for policy in policies:
        predicted, _ = kept_bytes(graph, names, policy)
        median = statistics.median(times[policy])
        # True keeps only the inputs, made before the forward: LiveBytes sees none of them
        ratio = "inputs" if policy is True else f"{predicted / max(kept[policy], 1):.2f}"
        rebuilt, again = model[policy]
        print(f"{policy!s:>10} {kept[policy] / 1e6:9.2f} {predicted / 1e6:9.2f} "
              f"{ratio:>9} {kept[policy] / kept[False]:9.2f} {extra[policy] / 1e6:8.2f} "
              f"{rebuilt / 1e6:8.2f} {median * 1e3:8.1f} {median / base:9.2f} "
              f"{1 + again / 3:6.2f}")
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
