"""Sequence parallelism (``tp=2, sequence_parallel=True``) against one process.

Between the regions tensor parallelism splits, each member holds its slice of the
sequence (:mod:`orgel.runtime.sequence_parallel`): the norms, the residual adds and the
casts run on the slices, a region's input is gathered as it enters and its output
reduce-scattered as it leaves. The sums run in another order than one process's (as with
``tp`` alone), so the tolerances are :mod:`test_tensor_parallel`'s. Each test also checks
that the members did run the norms on their slices (``tp_sequence``): a rewrite that
left every value whole would train exactly too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from orgel.cli import main
from orgel.explicit.api import pipeline
from orgel.models import build
from orgel.plan.transforms import TensorParallelError
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import Plan, PlanError
from test_tensor_parallel import GPT, _assert_same_state, _batches, _lm_loss, _train_both


def _sliced(report: dict[str, object], words: tuple[str, ...]) -> None:
    """Every process ran an op named with one of ``words`` on its slice, none on whole
    tensors for want of a rule."""
    by_process = report["tp_sequence"]
    assert isinstance(by_process, list) and len(by_process) == 4
    for process, stages in enumerate(by_process):
        ran = [name for sliced, _ in stages.values() for name in sliced]
        fallbacks = [name for _, whole in stages.values() for name in whole]
        assert any(w in name for name in ran for w in words), (process, stages)
        assert not fallbacks, (process, fallbacks)


@pytest.mark.slow
@pytest.mark.hf
def test_llama_with_sequence_parallelism_trains_as_one_process() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    batches = _batches(3, 64, 4, 8)
    report: dict[str, object] = {}
    losses, ref_losses, state, reference, shards, norms, ref_norms = _train_both(
        model, {"input_ids": batches[0]}, _lm_loss, batches, "input_ids", max_grad_norm=0.5,
        report=report, sequence_parallel=True, schedule="1f1b")  # two layers per stage
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    _assert_same_state(state, reference)
    assert shards[0] and shards[2]
    # RMSNorm on each member's tokens (two layers per stage: each stage has a norm between
    # two regions; what leads to no region, the last layer's tail, runs whole)
    _sliced(report, ("pow", "rsqrt", "variance"))


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"schedule": "zb-h1", "recompute": "layer"},
                                     {"dp": 2, "shard": "fsdp"}],
                         ids=["zb-h1-layer", "fsdp"])
def test_gpt_with_sequence_parallelism_trains_as_one_process(options: dict[str, object]) -> None:
    model, inputs, _, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32,
                                      seq_len=8, vocab_size=64)
    report: dict[str, object] = {}
    losses, ref_losses, state, reference, _, norms, ref_norms = _train_both(
        model, {"tokens": inputs[0]}, loss_fn, _batches(3, 64, 8, 8), "tokens",
        max_grad_norm=0.5, report=report, sequence_parallel=True, **options)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    _assert_same_state(state, reference)
    _sliced(report, ("layer_norm",))  # each stage (a FLOP-balanced cut) splits regions


@pytest.mark.slow
def test_orgel_run_sequence_parallel_checks_against_one_process() -> None:
    assert main(["run", GPT, "--ranks", "4", "--tp", "2", "--sequence-parallel",
                 "--microbatches", "2", "--steps", "2", "--check"]) == 0


def test_sequence_parallelism_errors_say_what_to_change(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs, targets, loss_fn = build("gpt", batch_size=4, seed=0, n_layers=1,
                                            d_model=16, seq_len=8, vocab_size=32)
    with pytest.raises(TensorParallelError, match="give tp > 1"):
        pipeline(model, inputs, targets, loss_fn, ranks=2, sequence_parallel=True,
                 schedule="1f1b", microbatches=2)
    assert main(["run", GPT, "--ranks", "2", "--sequence-parallel"]) == 2
    assert "pass --tp 2 or more" in capsys.readouterr().err


def test_a_plan_keeps_sequence_parallelism_in_its_json() -> None:
    plan = build_schedule("1f1b", 2, 2)
    sp = dataclasses.replace(plan, tp=2, sequence_parallel=True)
    assert Plan.from_json(sp.to_json()).sequence_parallel
    assert "sequence_parallel" not in dataclasses.replace(plan, tp=2).to_dict()
    with pytest.raises(PlanError, match="needs tp > 1"):
        dataclasses.replace(plan, sequence_parallel=True)
