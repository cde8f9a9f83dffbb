"""One cell of the composition matrix: a training script as people write it, and one process.

``python matrix_cell.py SPECS OUT`` (or the same under torchrun) trains a small Hugging Face
Qwen2 on padded batches (a data collator's ``BatchEncoding``s) through one entry point of orgel
with the features ``SPEC`` names,
then trains a copy the same way in this one process, and writes what it saw to
``OUT/NAME/result{rank}.json``: the losses of both, the largest weight difference, or the error
orgel raised (its type and message). ``tests/test_matrix.py`` runs the cells.

Entry points: ``local`` (``orgel.pipeline`` forking its ranks), ``torchrun`` (the same call
on every rank), ``backend`` (``torch.compile(model, backend=orgel.backend(...))`` and a
closure per micro-batch). Features: ``evaluate`` (``pipe.evaluate``, and ``outputs=True``
on the batch without its labels),
``accumulate`` (2, with clipping and a scheduler), ``dp`` (2), ``fsdp``, ``tp`` (2), ``sp``
(``tp`` 2 with ``sequence_parallel``),
``bf16`` (bf16-mixed), ``meta`` (the model built on the meta device, ``weights=``),
``break`` (a graph break in the middle of the forward), ``if_end`` (a Python ``if`` on a
tensor at the end of ``forward``), ``length`` (the second batch longer), ``last`` (the
second batch of 3 rows, a DataLoader's last: micro-batches of 2 and 1), ``resume`` (save
after the first step, ``orgel.load`` into a fresh pipeline), ``tied`` (tied embeddings).
The base cell of each entry point profiles and plans; every other cell runs a FLOP-balanced
1F1B chain (``schedule="1f1b"``), so the profiler's time is spent once per entry point. That
chain cuts Qwen2 inside an attention: the normed hidden state feeds q_proj on one stage and
k_proj and v_proj on the next, so a bf16 cell also checks that the second stage casts it as
one process does (``orgel.runtime.forward_actions.as_activation``; until 2026-12-06 its
gradient was summed in bfloat16 there and the weights were 0.034 apart).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

import orgel
from gaps import largest_gap, state_gap

VOCAB, ROWS, STEPS = 64, 8, 2


def build(features: set[str]) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings="tied" in features,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model: torch.nn.Module = Qwen2ForCausalLM(config)
    if "break" in features:  # a graph break between the two layers
        model.model.layers[0].register_forward_hook(lambda m, a, out: _graph_break(out))
    if "if_end" in features:
        model = CheckedLoss(model)
    return model


def _graph_break(out: Any) -> Any:
    torch._dynamo.graph_break()
    return out


class CheckedLoss(torch.nn.Module):
    """The model, and a Python ``if`` on its loss at the very end of ``forward``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor) -> Any:
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        if out.loss > 1e6:
            raise RuntimeError("the loss diverged")
        return out


def batch(step: int, length: int) -> Any:
    """Rows of 3 to ``length`` tokens as a Hugging Face data collator gives them: a
    ``BatchEncoding`` (not a dict), right-padded, labels -100 on the padding."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (ROWS, length), generator=g)
    lengths = torch.randint(3, length + 1, (ROWS,), generator=g)
    lengths[0] = length
    rows = [{"input_ids": row[:n].tolist()} for row, n in zip(ids, lengths, strict=True)]
    return collator()(rows)


def collator() -> Any:
    """``DataCollatorForLanguageModeling(mlm=False)`` of a word-level tokenizer made here
    (token 0 pads)."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[PAD]")),
        pad_token="[PAD]", padding_side="right")
    return DataCollatorForLanguageModeling(tokenizer, mlm=False, return_tensors="pt")


def batches(features: set[str]) -> list[Any]:
    steps = STEPS * (2 if "accumulate" in features else 1)
    data = [batch(i, 16 if "length" in features and i % 2 else 10) for i in range(steps)]
    if "compile" in features:  # a third length: the graphs symbolic in the second serve it
        data.append(batch(steps, 13))
    if "last" in features:  # a DataLoader's smaller last batch: micro-batches of 2 and 1 rows
        data[-1] = type(data[-1])({k: v[:3] for k, v in data[-1].items()})
    return data


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def scheduler(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def options(features: set[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {"ranks": 2, "microbatches": 2, "optimizer": optimizer}
    if features:  # FLOP-balanced 1F1B: what combines, not the profiler
        opts["schedule"] = "1f1b"
    if "accumulate" in features:
        opts.update(accumulate=2, max_grad_norm=0.5, scheduler=scheduler)
    if features & {"dp", "fsdp"}:
        opts.update(ranks=4, dp=2)
    if "fsdp" in features:
        opts["shard"] = "fsdp"
    if features & {"tp", "sp"}:  # sp: tensor parallelism with sequence parallelism
        opts.update(ranks=4, tp=2, sequence_parallel="sp" in features)
    if "bf16" in features:
        opts["precision"] = "bf16-mixed"
    if "compile" in features:  # Inductor's graphs on every rank
        opts["compile"] = True
    return opts


def counted(labels: torch.Tensor) -> int:
    """The tokens a causal LM's loss averages over: labels not -100 after the first."""
    return int((labels[:, 1:] != -100).sum())


def reference(features: set[str], data: list[dict[str, torch.Tensor]],
              float64: bool = False) -> dict[str, Any]:
    """One process: the same model, optimizer and loop, over the same pieces of each batch
    (the micro-batches, cut again for each data-parallel replica), each piece's loss
    weighed by its share of the batch's tokens. ``float64``: all of it in float64, no
    autocast (the judge of a cell that rounds differently by its nature)."""
    model = build(features)
    if float64:
        model = model.double()
        features = features - {"bf16"}
    opt = optimizer(model.parameters())
    sched = scheduler(opt) if "accumulate" in features else None
    k = 2 if "accumulate" in features else 1
    opts = options(features)
    pieces = opts["microbatches"] * opts.get("dp", 1)
    losses = []
    for i, b in enumerate(data):
        total, loss = counted(b["labels"]), 0.0
        for piece in zip(*(t.chunk(pieces) for t in b.values()), strict=True):
            part = dict(zip(b, piece, strict=True))
            with torch.autocast("cpu", torch.bfloat16, enabled="bf16" in features):
                out = model(**part)
            share = out.loss * counted(part["labels"]) / total
            (share / k).backward()
            loss += share.item()
        losses.append(loss)
        if (i + 1) % k == 0:
            if "accumulate" in features:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
    result: dict[str, Any] = {"losses": losses, "state": model.state_dict()}
    if "evaluate" in features:
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled="bf16" in features):
            out = model(**data[0])
        result["eval"] = out.loss.item()
        result["logits"] = out.logits.float()
    return result


def run_pipeline(features: set[str], data: list[dict[str, torch.Tensor]], out: Path,
                 ) -> dict[str, Any]:
    """``orgel.pipeline`` (locally or under torchrun): the losses, the weights, evaluation."""
    model = build(features)
    opts = options(features)
    if "meta" in features:  # the values, and the buffers the constructor computes
        weights = {**dict(model.named_buffers()), **model.state_dict()}
        with torch.device("meta"):
            model = build(features)
        opts["weights"] = weights
    pipe = orgel.pipeline(model, data[0], **opts)
    losses, off_path, compiled = [], [], []
    for i, b in enumerate(data):
        if "resume" in features and i == 1:
            pipe.save(out / "checkpoints")
            pipe.close()
            pipe = orgel.load(out / "checkpoints", build(features), data[0], **opts)
        losses.append(pipe.step(b))
        # micro-batches the calling process ran whole (a forward of several graphs that
        # left the captured ones): exact, but not the pipeline the cell tests
        off_path += [(i, m) for m in getattr(pipe, "off_path", [])]
        compiled.append(sum(pipe.compile_s or [0.0]))
    result: dict[str, Any] = {"losses": losses, "state": pipe.state_dict(),
                              "off_path": off_path}
    if "compile" in features:  # the compile seconds of all ranks after each step
        result["compiled"] = compiled
    if "evaluate" in features:
        result["eval"] = pipe.evaluate(data[0])
        # a batch for inference, without the labels: the model's outputs (its own capture)
        unlabelled = {k: v for k, v in data[0].items() if k != "labels"}
        result["logits"] = logits_of(pipe.evaluate(unlabelled, outputs=True))
    pipe.close()
    return result


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of what ``outputs=True`` gave back (a model output object or its dict)."""
    if isinstance(outputs, torch.Tensor):
        raise TypeError(f"outputs=True gave a tensor of shape {tuple(outputs.shape)}, not "
                        "the model's output (with .logits)")
    return (outputs["logits"] if isinstance(outputs, dict) else outputs.logits).float()


def run_backend(features: set[str], data: list[dict[str, torch.Tensor]], out: Path,
                ) -> dict[str, Any]:
    """``orgel.backend``: the model compiled with it, a closure per micro-batch."""
    opts = options(features)
    if "meta" in features:
        opts["weights"] = build(features).state_dict()
    # with graph breaks the Python between graphs is the closure's: it opens the autocast
    # around the model, as people write it (precision= opens one around one graph)
    around = {"bf16", "break"} <= features
    if around:
        del opts["precision"]

    def start() -> tuple[Any, Any]:
        pipe = orgel.backend(**opts)
        return pipe, torch.compile(build(features), backend=pipe)

    pipe, compiled = start()

    def closure(piece: Any, total: int) -> torch.Tensor:  # the batch's rows, as it came
        with torch.autocast("cpu", torch.bfloat16, enabled=around):
            out = compiled(**piece)
        loss = out.loss * counted(piece["labels"]) / total
        loss.backward()
        return loss.detach()

    losses = []
    for i, b in enumerate(data):
        if "resume" in features and i == 1:
            pipe.save(out / "checkpoints")
            pipe.close()
            pipe, compiled = start()
            pipe.load(out / "checkpoints")
        total = counted(b["labels"])
        parts = pipe.step(closure, b, total)
        losses.append(sum(float(x) for x in parts))
    result = {"losses": losses, "state": pipe.state_dict()}
    if "evaluate" in features:  # as people evaluate a compiled model: eval mode, no_grad
        compiled.eval()
        with torch.no_grad():
            out = compiled(**data[0])
        compiled.train()
        result["eval"], result["logits"] = out.loss.item(), out.logits.float()
    pipe.close()
    return result


def _distance(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference of any weight ``state`` and ``want`` both have (the missing
    ones are reported by name)."""
    return state_gap(state, {n: v for n, v in want.items() if n in state})


def compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    state = got["state"]
    missing = [n for n in sorted(want["state"]) if n not in state]
    diff = _distance(state, want["state"])
    report: dict[str, Any] = {"losses": got["losses"], "ref": want["losses"], "diff": diff,
                              "missing": missing[:5], "off_path": got.get("off_path", [])}
    if "compiled" in got:
        report["compiled"] = got["compiled"]
    if "eval" in want:
        report["eval"] = [got.get("eval"), want["eval"]]
        if "logits" in got:
            report["logits_diff"] = largest_gap(got["logits"], want["logits"])
    return report


def run_cell(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """Train one cell through orgel and in one process; what was seen, or orgel's error."""
    features = set(spec["features"])
    data = batches(features)
    if spec["entry"] == "backend":  # as a fresh script starts: no compiled code of the last cell
        torch._dynamo.reset()
    try:
        got = run_backend(features, data, out) if spec["entry"] == "backend" \
            else run_pipeline(features, data, out)
        want = reference(features, data)
        report = compare(got, want)
        if "bf16" in features and features & {"tp", "sp"}:
            # bfloat16 rounds each product, and tensor parallelism rounds each half of a
            # split matmul before the sum, which AdamW's normalised step turns into a full
            # step for a weight whose gradient is near zero: judge both against float64, as
            # the fuzzer does (the weights, and the logits evaluated with them)
            exact = reference(features, data, float64=True)
            report["diff64"] = _distance(got["state"], exact["state"])
            report["ref_diff64"] = _distance(want["state"], exact["state"])
            if "logits" in got and "logits" in exact:
                report["logits64"] = largest_gap(got["logits"], exact["logits"])
                report["ref_logits64"] = largest_gap(want["logits"], exact["logits"])
        return report
    except Exception as exc:  # noqa: BLE001 - the cell records what orgel raised
        return {"error": type(exc).__name__, "message": str(exc)[:2000],
                "trace": traceback.format_exc()[-3000:]}


def cell_name(spec: dict[str, Any]) -> str:
    return "+".join(spec["features"]) or "base"


def main(specs: list[dict[str, Any]], out: Path) -> None:
    """Run ``specs`` one after another in these processes (under torchrun: pipelines built,
    closed and built again in the same ranks); ``OUT/NAME/result{rank}.json`` each."""
    rank = int(os.environ.get("RANK", "0"))
    for spec in specs:
        folder = out / cell_name(spec)
        folder.mkdir(parents=True, exist_ok=True)
        report = run_cell(spec, folder)
        (folder / f"result{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
