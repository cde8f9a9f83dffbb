"""Errors in the user's words (issue 33, item 3), each from the user's side.

Which input, which dimension, which sizes and what to change, never a size symbol or an input
the user did not pass; a refusal the model's structure decides (a tied embedding on sharded
stages) before any capture; no torch warning on every FSDP run; torchrun ranks that save into
different folders are told so; a forward that writes its own parameters is told so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sympy
import torch

from orgel.batching import close
from orgel.graph.sizes import ShapeError, Shapes
from orgel.models import build
from orgel.runtime.checkpoint import CheckpointError, check_same_folder

SRC = Path(__file__).resolve().parent.parent / "src"  # this checkout's orgel, first


def _shapes() -> Shapes:
    """What capture records for ``(input_ids, labels)`` whose loss flattens both: a guard on
    the products of their sizes, each dimension its own symbol."""
    s = {n: sympy.Symbol(n, integer=True, positive=True) for n in ("s0", "s1", "s2", "s3")}
    guard = sympy.Eq(s["s0"] * s["s1"], s["s2"] * s["s3"])
    return Shapes({"input_ids": ("s0", "s1"), "labels": ("s2", "s3")}, [guard], {},
                  {str(k): v for k, v in s.items()}, {"s0": 4, "s1": 16, "s2": 4, "s3": 16})


def test_a_size_the_graph_relies_on_is_named_by_input_and_dimension() -> None:
    ids = torch.zeros(2, 16, dtype=torch.long)
    _shapes().check({"input_ids": ids, "labels": ids})  # equal lengths: fine
    with pytest.raises(ShapeError) as caught:
        _shapes().check({"input_ids": ids, "labels": ids[:, :12]})
    message = str(caught.value)
    assert message.startswith("input 'labels' has size 12 along dim 1 but 'input_ids' has 16 "
                              "along dim 1"), message
    assert "give 'labels' size 16 along dim 1" in message, message
    assert "s1" not in message and "Eq(" not in message, message


def test_a_relation_no_pair_of_sizes_explains_is_written_in_the_inputs_names() -> None:
    s0, s1 = (sympy.Symbol(n, integer=True, positive=True) for n in ("s0", "s1"))
    shapes = Shapes({"x": ("s0", "s1")}, [sympy.Eq(sympy.Mod(s1, 4), 0)], {},
                    {"s0": s0, "s1": s1}, {"s0": 2, "s1": 16})
    with pytest.raises(ShapeError) as caught:
        shapes.check({"x": torch.zeros(2, 15)})
    message = str(caught.value)
    assert "Mod(x.shape[1], 4) == 0" in message and "x.shape[1] = 15" in message, message
    assert "s1" not in message, message


def _tied() -> tuple[Any, ...]:
    return build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32, vocab_size=64,
                 seq_len=16, tie_embeddings=True)


def test_a_tied_embedding_on_stages_sharded_unlike_is_refused_before_capture(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A given plan that shards the stage of the input embedding and not that of the head
    tied to it is refused before any capture; the planner's plans (every stage sharded
    alike, with ``tp`` too) are not."""
    import dataclasses

    import orgel.flow.capture
    from orgel.graph.capture import capture
    from orgel.plan.balanced import balanced_plan
    from orgel.workload import Workload, microbatches

    model, inputs, targets, loss_fn = _tied()
    first = microbatches(Workload(model, inputs, targets, loss_fn), 4)[0][0]
    plan = balanced_plan(capture(model, first), ranks=4, microbatches=2, dp=2)
    half = dataclasses.replace(plan, shard=["fsdp", "none"])

    def no_capture(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("captured")

    monkeypatch.setattr(orgel.flow.capture, "capture_microbatch", no_capture)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"stage 0 is FSDP-sharded but holds the tied parameter "
                                         r"'tok_emb.weight' .*'lm_head.weight'.* Shard every "
                                         r"stage that holds it alike"):
        orgel.pipeline(model, inputs, targets, loss_fn, ranks=4, dp=2, plan=half)
    assert time.perf_counter() - started < 1.0
    # the planner's plans shard both ends alike: sharded ties train (tests/test_fsdp.py)
    for options in ({"ranks": 4, "dp": 2}, {"ranks": 8, "tp": 2, "dp": 2}, {"ranks": 2, "dp": 2}):
        with pytest.raises(AssertionError, match="captured"):
            orgel.pipeline(model, inputs, targets, loss_fn, shard="fsdp", **options)


def test_outputs_holding_nan_compare_without_a_torch_error() -> None:
    """The start-up trials compare outputs (the loss rule, the batch dimension): a NaN in
    them used to give `atol must be greater than or equal to zero, but got -nan`."""
    full = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    assert close(full.clone(), full)
    assert not close(full + 1, full)


def test_ranks_saving_into_different_folders_are_told_which() -> None:
    check_same_folder(["/ckpt", "/ckpt"])
    with pytest.raises(CheckpointError, match=r"different folders to pipe.save \(rank 0: "
                                              r"/tmp/a; rank 1: /tmp/b\).*nothing was written"):
        check_same_folder(["/tmp/a", "/tmp/b"])


SAVE_SCRIPT = '''
import json, sys, tempfile
import torch
import orgel
from orgel.runtime.checkpoint import CheckpointError

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
x, y = torch.randn(8, 8), torch.randn(8, 4)
pipe = orgel.pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=2, microbatches=2,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
pipe.step((x,), y)
mine = tempfile.mkdtemp()  # each rank its own folder
try:
    pipe.save(mine)
    error = ""
except CheckpointError as exc:
    error = str(exc)
pipe.step((x,), y)  # trains on
saved = pipe.save(sys.argv[1])  # one folder: fine
rank = torch.distributed.get_rank()
with open(f"{sys.argv[1]}/result{rank}.json", "w") as f:
    json.dump({"error": error, "mine": mine, "saved": str(saved)}, f)
pipe.close()
'''


@pytest.mark.slow
def test_torchrun_ranks_saving_into_different_folders_are_told_which(tmp_path: Path) -> None:
    from test_api_torchrun import _torchrun

    code, out = _torchrun(tmp_path, SAVE_SCRIPT, str(tmp_path / "ckpt"))
    assert code == 0, out[-3000:]
    results = [json.loads((tmp_path / "ckpt" / f"result{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert "the ranks passed different folders to pipe.save" in result["error"]
        assert all(f"rank {r}: {results[r]['mine']}" in result["error"] for r in (0, 1))
        assert result["saved"].endswith("step-00000002")


HF_SCRIPT = '''
import json, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
import orgel
from orgel.graph.capture import capture
from orgel.plan.balanced import balanced_plan
from orgel.plan.transforms import mark_sharded
from orgel.workload import Workload, microbatches, model_loss

config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                     use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
torch.manual_seed(0)
model = Qwen2ForCausalLM(config)
ids = torch.randint(2, 96, (4, 16))
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
# 2 stages of 2 FSDP replicas; this plan's cut crosses a view (attention's heads reshaped)
first = microbatches(Workload(model, batch, None, model_loss), 4)[0][0]
plan = mark_sharded(balanced_plan(capture(model, first), ranks=4, microbatches=2, dp=2), "fsdp")
errors = {}
with orgel.pipeline(model, batch, ranks=4, dp=2, plan=plan, microbatches=2, threads=1,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as pipe:
    losses = [pipe.step(batch)]
    for name, bad in [("short", {**batch, "labels": batch["labels"][:, :12]}),
                      ("no_mask", {k: v for k, v in batch.items() if k != "attention_mask"})]:
        try:
            pipe.step(bad)
        except orgel.WorkloadError as exc:
            errors[name] = [type(exc).__name__, str(exc)]
    losses.append(pipe.step(batch))
with open(sys.argv[1], "w") as f:
    json.dump({"errors": errors, "losses": losses}, f)
'''


@pytest.mark.slow
@pytest.mark.hf
def test_a_hugging_face_batch_gone_wrong_is_told_in_the_users_words(tmp_path: Path) -> None:
    """A user's script (Qwen2 on 2 stages of 2 FSDP replicas): labels shorter than the
    inputs, a batch without its attention_mask, each told in the user's words; no rank prints
    torch's FSDP2 "returned a view tensor" warning; training goes on."""
    script, result = tmp_path / "train.py", tmp_path / "result.json"
    script.write_text(HF_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script), str(result)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "returned a view tensor" not in output, output[-4000:]
    got = json.loads(result.read_text())
    kind, message = got["errors"]["short"]
    assert kind == "ShapeError" and message.startswith(
        "input 'labels' has size 12 along dim 1 but 'input_ids' has 16 along dim 1"), message
    assert "give 'labels' size 16 along dim 1" in message, message
    kind, message = got["errors"]["no_mask"]
    assert "missing: ['attention_mask']" in message and "use_cache" not in message, message
    assert got["losses"][1] < got["losses"][0]  # trains on


def test_a_forward_that_writes_its_own_parameters_is_told_so_not_called_a_bug() -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes the rows it looks up, in place, in every
    forward; orgel runs the forward several times before the first step, so it refuses,
    naming the parameter and the cause (it said "a bug in orgel")."""
    import orgel

    class Renormed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8, max_norm=1.0)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x).mean(1))

    torch.manual_seed(0)
    model = Renormed()
    with torch.no_grad():
        model.emb.weight.mul_(3)  # rows longer than max_norm
    x, y = torch.randint(0, 20, (8, 5)), torch.randint(0, 3, (8,))
    with pytest.raises(RuntimeError) as info:
        orgel.pipeline(model, (x,), y, torch.nn.functional.cross_entropy, ranks=2,
                       microbatches=2, schedule="1f1b")
    message = str(info.value)
    assert message.startswith("parameter(s) emb.weight changed in place while orgel ran the "
                              "model's forward"), message
    assert "nn.Embedding(max_norm=...)" in message and "without max_norm" in message, message


class _OneRowBranch(torch.nn.Module):
    """Other operations for a batch of one row (as Hugging Face Llama without an attention
    mask broadcasts its position ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.shape[0] == 1:
            h = h * 1.5
        return self.b(h)


@pytest.mark.slow
def test_a_replica_share_that_captures_other_operations_than_the_planner_saw() -> None:
    """Found by the fuzzer (seed 151): the planner plans on one micro-batch (2 rows); with
    dp=2 each replica takes 1 row, which the model's code treats apart, so the replicas'
    capture has other operations than the plan names. That was refused as "the plan was made
    for another model"; now the error says which sizes and what to change."""
    import orgel

    torch.manual_seed(0)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"planned on one micro-batch \(2 rows\), but 1 row of "
                                         r"it, a replica's share with dp=2.*schedule="):
        orgel.pipeline(_OneRowBranch(), (x,), y, torch.nn.functional.mse_loss, ranks=2, dp=2,
                       microbatches=2)
