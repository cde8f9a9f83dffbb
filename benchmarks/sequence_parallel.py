"""Sequence parallelism on the CPU: what a member's forward keeps, predicted against measured.

    python benchmarks/sequence_parallel.py --layers 4 --length 512 --repeats 3

A small Hugging Face Llama (random weights, from a config) is captured and split into one
stage, run by one pipeline rank of two processes (gloo on 127.0.0.1) three ways: whole
(``tp=1``, one process's forward), ``tp=2``, and ``tp=2`` with ``sequence_parallel``. Each
process runs the stage's forward and backward as the runtime's stage does
(:func:`orgel.runtime.tensor_parallel.shard_stages`,
:func:`orgel.runtime.sequence_parallel.split_stages`) and counts the bytes autograd saves
for the backward (each saved tensor's storage once, a DTensor's local part, the weights
left out). Printed per way: those bytes per member; what the cost model predicts for
them (the roofline table's activations, :func:`orgel.costs.mesh.tp_costs`); and the median
time of a forward and backward (on the CPU DTensor's dispatch costs time that a GPU run
hides, so the times say what the CPU pays, not what a GPU would). The ways take turns, so
each sees the same load; the machine's load is printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAYS = ("whole", "tp", "tp+sp")


def _stage(args: argparse.Namespace) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from orgel.graph import capture
    from orgel.plan.balanced import balanced_plan

    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=8,
                         num_key_value_heads=4, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (args.rows, args.length),
                        generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    graph = capture(model, batch)
    plan = balanced_plan(graph, ranks=1, microbatches=1)
    return graph, plan, batch


def _saved_bytes(module: torch.nn.Module, args: list[Any]) -> tuple[int, Any]:
    """Bytes autograd saves in ``module(*args)`` (each storage once, weights left out)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    weights = {local(p).untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args)
    return sum(seen.values()), out


def _member(process: int, args: argparse.Namespace, port: int, out: str) -> None:
    from orgel.runtime.sequence_parallel import split_stages
    from orgel.runtime.stage import StageInfo
    from orgel.runtime.tensor_parallel import implicit_replication, shard_stages
    from orgel.split import split_plan

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=process, world_size=2)
    graph, base, batch = _stage(args)
    results: dict[str, Any] = {way: {"bytes": 0, "seconds": []} for way in WAYS}
    runs = {}
    for way in WAYS:
        plan = base if way == "whole" else dataclasses.replace(
            base, tp=2, sequence_parallel=way == "tp+sp")
        split = split_plan(graph, plan)
        stages = {0: StageInfo.build(plan, split, 0, 0)}
        if way != "whole":
            meshes, _ = shard_stages(plan, split, stages, torch.device("cpu"))
            if way == "tp+sp":
                split_stages(stages, meshes)
        stage = split.stages[0]
        runs[way] = (stages[0].stage.module, [
            int(batch[stage.sizes[n][0]].shape[stage.sizes[n][1]]) if n in stage.sizes
            else batch[n] for n in stage.inputs])
    with implicit_replication():
        for _ in range(args.repeats):  # the ways take turns
            for way in WAYS:
                module, inputs = runs[way]
                dist.barrier()
                start = time.perf_counter()
                kept, outs = _saved_bytes(module, inputs)
                loss = outs[0] if isinstance(outs, (tuple, list)) else outs
                loss.float().sum().backward()
                results[way]["seconds"].append(time.perf_counter() - start)
                results[way]["bytes"] = kept
                module.zero_grad(set_to_none=True)
    Path(out, f"member{process}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _predicted(graph: Any) -> dict[str, int]:
    """Activations per member the cost model gives each way (the roofline table of the
    graph as one block per layer, h100-80gb: only the bytes are read)."""
    from orgel.costs.devices import DEVICES
    from orgel.costs.mesh import tp_costs
    from orgel.profile.roofline import estimate_costs

    costs = estimate_costs(graph, DEVICES["h100-80gb"])
    return {"whole": int(sum(costs.activations)),
            "tp": int(sum(tp_costs(costs, 2).activations)),
            "tp+sp": int(sum(tp_costs(costs, 2, sequence_parallel=True).activations))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29631)
    args = parser.parse_args()
    print(f"Llama, {args.layers} layers, hidden {args.hidden}, batch {args.rows}x{args.length}, "
          f"one stage on one pipeline rank of 2 processes; load {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores", flush=True)
    graph, _, _ = _stage(args)
    predicted = _predicted(graph)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_member, args=(args, args.port, out), nprocs=2, start_method="fork")
        members = [json.loads(Path(out, f"member{p}.json").read_text()) for p in range(2)]
    print(f"{'way':>6} {'saved MB/member':>15} {'/whole':>7} {'predicted MB':>12} {'/whole':>7} "
          f"{'fwd+bwd ms':>10}")
    for way in WAYS:
        kept = members[0][way]["bytes"]
        seconds = statistics.median(members[0][way]["seconds"] + members[1][way]["seconds"])
        print(f"{way:>6} {kept / 2**20:15.1f} {kept / members[0]['whole']['bytes']:7.2f} "
              f"{predicted[way] / 2**20:12.1f} {predicted[way] / predicted['whole']:7.2f} "
              f"{seconds * 1e3:10.0f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
