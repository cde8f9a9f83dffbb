"""``orgel graph``: capture a workload; print its op graph, blocks, block DAG, a balanced split."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from orgel.commands.text import human_bytes

NAME = "graph"
HELP = "capture a workload and print its op graph, blocks, block DAG and a balanced split"
EXAMPLES = (
    "orgel graph examples/gpt.py:workload --blocks 10 --stages 3 --microbatches 4",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help="workload as FILE.py:FUNCTION returning "
                        "(model, inputs, targets, loss_fn)")
    parser.add_argument("--blocks", type=int, default=16, metavar="N",
                        help="target number of blocks (default 16)")
    parser.add_argument("--stages", type=int, metavar="K",
                        help="also split into K stages balanced by FLOPs and print each "
                        "stage's inputs, outputs and bytes")
    parser.add_argument("--microbatches", type=int, default=1, metavar="M",
                        help="capture one of M micro-batches, so sizes are per micro-batch "
                        "(default 1: the whole batch)")
    parser.add_argument("--method", default="auto", choices=("auto", "dynamo", "export"),
                        help="capture route (default auto: TorchDynamo, else torch.export)")
    parser.add_argument("--png", metavar="FILE", help="draw the block DAG (coloured by stage "
                        "with --stages) into this PNG file")


def _fail(message: str) -> int:
    print(f"orgel graph: {message}", file=sys.stderr)
    return 2


def flops(count: float) -> str:
    """FLOPs with a metric prefix: ``12.3 MFLOP``."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(count) < 1000 or unit == "T":
            return f"{count:.0f} FLOP" if unit == "" else f"{count:.1f} {unit}FLOP"
        count /= 1000
    return f"{count:.1f} TFLOP"


def run(args: argparse.Namespace) -> int:
    from orgel.graph import CaptureError, capture, coarsen
    from orgel.split import SplitError, split_model
    from orgel.split.assign import balanced_assignment
    from orgel.workload import WorkloadError, load_workload, microbatches, validate_workload

    if args.blocks < 1:
        return _fail(f"--blocks must be a positive integer, got {args.blocks}")
    if args.stages is not None and not 1 <= args.stages <= args.blocks:
        return _fail(f"--stages must be between 1 and --blocks ({args.blocks}), got {args.stages}")
    try:
        w = load_workload(args.workload)
        validate_workload(w, args.microbatches)
        inputs = microbatches(w, args.microbatches)[0][0]
        graph = capture(w.model, inputs, method=args.method)
        blocks = coarsen(graph, args.blocks)
        split = None
        if args.stages is not None:
            split = split_model(blocks, balanced_assignment(blocks, min(args.stages,
                                                                        len(blocks.blocks))))
    except (WorkloadError, CaptureError, SplitError, ValueError) as exc:
        return _fail(str(exc))
    print(_graph_text(graph, args.microbatches))
    print()
    print(_blocks_text(blocks, split))
    if split is not None:
        print()
        print(_stages_text(split, blocks))
    if args.png:
        try:
            draw_blocks(blocks, args.png, split)
        except OSError as exc:
            return _fail(f"cannot write {args.png}: {exc}")
        print(f"\nwrote {args.png}")
    return 0


def _graph_text(graph: Any, m: int) -> str:
    s = graph.summary()
    ops = Counter(n.op for n in graph.nodes.values()).most_common(8)
    per = "the whole batch" if m == 1 else f"one of {m} micro-batches"
    lines = [
        f"op graph ({graph.method}, sizes for {per}): {s['nodes']} nodes, "
        f"{s['params']} parameters ({human_bytes(s['param_bytes'])}), "
        f"buffers {human_bytes(s['buffer_bytes'])}, "
        f"saved for backward {human_bytes(s['saved_bytes'])}, forward {flops(s['flops'])}",
        f"  inputs: {', '.join(graph.model_inputs)}; outputs: {', '.join(graph.outputs)}",
        "  most used ops: " + ", ".join(f"{op} x{count}" for op, count in ops),
    ]
    if graph.aliases:
        lines.append("  tied parameters: " + "; ".join(
            f"{name} = {' = '.join(names)}" for name, names in graph.aliases.items()))
    lines += [f"  note: {note}" for note in graph.notes]
    return "\n".join(lines)


def _blocks_text(blocks: Any, split: Any) -> str:
    stage_of: dict[int, int] = {}
    if split is not None:
        stage_of = {b: i for i, s in enumerate(split.stage_graph.stages) for b in s.blocks}
    head = f"{'#':>3}  {'block':<34} {'nodes':>5} {'params':>10} {'saved':>10} {'out':>10} " \
           f"{'forward':>12}" + ("  stage" if stage_of else "")
    lines = [f"blocks: {len(blocks.blocks)}", head]
    for b in blocks.blocks:
        name = b.name if len(b.name) <= 34 else b.name[:15] + "…" + b.name[-18:]
        line = (f"{b.index:>3}  {name:<34} {len(b.nodes):>5} {human_bytes(b.param_bytes):>10} "
                f"{human_bytes(b.saved_bytes):>10} {human_bytes(b.output_bytes):>10} "
                f"{flops(b.flops):>12}")
        if stage_of:
            line += f"  {stage_of[b.index]:>5}"
        lines.append(line)
    lines.append(f"block DAG: {len(blocks.edges)} edges, "
                 f"{sum(e.nbytes for e in blocks.edges)} bytes cross block boundaries")
    starts = [b for b in blocks.order() if not blocks.predecessors(b)]
    if len(starts) > 1:
        lines.append(f"  entry blocks (independent starts): {', '.join(map(str, starts))}")
    fan = blocks.fan_outs()
    joins = blocks.joins()
    skips = blocks.skips()
    lines.append("  branches: " + ("; ".join(f"{b} -> {', '.join(map(str, s))}" for b, s in fan)
                                   or "none"))
    lines.append("  joins: " + ("; ".join(f"{b} <- {', '.join(map(str, p))}" for b, p in joins)
                                or "none"))
    lines.append("  long skips: " + ("; ".join(f"{e.src} -> {e.dst} ({human_bytes(e.nbytes)})"
                                               for e in skips) or "none"))
    return "\n".join(lines)


def _stages_text(split: Any, blocks: Any) -> str:
    g = split.stage_graph
    lines = [f"split into {g.num_stages} stages (balanced by FLOPs, loss on stage "
             f"{split.loss_stage}):"]
    for i, stage in enumerate(split.stages):
        st = g.stages[i]
        params = sum(t.numel() * t.element_size() for t in stage.module.parameters())
        work = sum(blocks.blocks[b].flops for b in st.blocks)
        lines.append(f"  stage {i}: blocks {_ranges(list(st.blocks))}, "
                     f"params {human_bytes(params)}, forward {flops(work)}")
        if stage.model_inputs:
            lines.append(f"    model inputs: {', '.join(stage.model_inputs)}")
        for e in g.edges:
            if e.dst == i:
                vals = ", ".join(f"{v.name} ({human_bytes(v.nbytes)})" for v in e.values)
                lines.append(f"    from stage {e.src}: {vals}")
        for e in g.edges:
            if e.src == i:
                vals = ", ".join(f"{v.name} ({human_bytes(v.nbytes)})" for v in e.values)
                lines.append(f"    to stage {e.dst}: {vals}")
        if i == split.loss_stage:
            lines.append(f"    model outputs: {', '.join(split.output_names)}")
    if split.tied:
        lines.append(f"  tied across stages (gradients summed): {', '.join(split.tied)}")
    return "\n".join(lines)


def _ranges(items: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2, 5'."""
    runs: list[list[int]] = []
    for x in sorted(items):
        if runs and runs[-1][1] == x - 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def draw_blocks(blocks: Any, path: str, split: Any = None) -> None:
    """Draw the block DAG left to right by depth, coloured by stage, into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    level: dict[int, int] = {}
    for b in blocks.order():
        level[b] = max((level[p] + 1 for p in blocks.predecessors(b)), default=0)
    rows: dict[int, int] = {}
    per_level: Counter[int] = Counter()
    for b in blocks.order():
        rows[b] = per_level[level[b]]
        per_level[level[b]] += 1
    stage_of: dict[int, int] = {}
    if split is not None:
        stage_of = {b: i for i, s in enumerate(split.stage_graph.stages) for b in s.blocks}
    cmap = plt.get_cmap("tab10")
    width = max(level.values()) + 1
    height = max(per_level.values())
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * width), max(3, 1.2 * height + 1.5)))
    pos = {b: (level[b], -rows[b] + (per_level[level[b]] - 1) / 2) for b in level}
    skip_side = {(e.src, e.dst): (-1) ** k for k, e in enumerate(blocks.skips())}
    for e in blocks.edges:
        (x0, y0), (x1, y1) = pos[e.src], pos[e.dst]
        # A skip over several levels bends (alternately down and up, about one
        # row high whatever its length) so that it does not hide behind the chain.
        span = x1 - x0
        bend = skip_side.get((e.src, e.dst), 1) * min(0.4, 1.6 / span) if span > 1 else 0.0
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops={"arrowstyle": "->", "color": "0.4", "lw": 0.8,
                                "shrinkA": 11, "shrinkB": 11,
                                "connectionstyle": f"arc3,rad={bend}"})
    for b in blocks.blocks:
        x, y = pos[b.index]
        color = cmap(stage_of[b.index] % 10) if stage_of else "tab:blue"
        ax.scatter([x], [y], s=500, color=color, zorder=3, edgecolors="black", linewidths=0.5)
        ax.text(x, y, str(b.index), ha="center", va="center", fontsize=8, zorder=4)
        label = b.name if len(b.name) <= 22 else "…" + b.name[-21:]
        ax.text(x, y - 0.32, label, ha="center", va="top", fontsize=6, zorder=4)
    if stage_of:
        for s in sorted(set(stage_of.values())):
            ax.scatter([], [], color=cmap(s % 10), label=f"stage {s}")
        ax.legend(loc="upper left", fontsize=7, frameon=False)
    ax.set_title(f"block DAG: {len(blocks.blocks)} blocks, {len(blocks.edges)} edges")
    ax.axis("off")
    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(-(height + 1) / 2 - 0.3, (height + 1) / 2 + 0.4)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.9, bottom=0.02)
    fig.savefig(path, dpi=120)
    plt.close(fig)
