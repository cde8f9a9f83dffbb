"""A Hugging Face causal LM as transformers builds it (``use_cache=True``): planned and trained.

``LlamaForCausalLM`` with its default flags builds a generation (KV) cache in
its forward and returns it beside the logits. No training loss reads it, and
neither Dynamo on a meta model nor torch.export can capture it, so orgel
calls the forward with ``use_cache=False`` (:func:`orgel.workload.cache_off`):
these tests plan such a model for a device model through the CLI, built on the
meta device, and train one built on meta through ``orgel.pipeline``, exactly as
one process trains it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from orgel.cli import main
from orgel.graph import capture
from orgel.plan.balanced import balanced_plan
from orgel.workload import Workload, microbatches

pytestmark = pytest.mark.hf

#: A workload file: Llama-3-70B's structure (grouped-query attention 8:1, SwiGLU MLP,
#: rope theta 5e5, untied head), scaled down to 2 layers of width 64; every other flag as
#: transformers sets it by default (use_cache=True among them). Built on the meta device.
WORKLOAD = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def config():
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=224,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                       max_position_embeddings=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                       bos_token_id=0, eos_token_id=1)


def loss(out, targets):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def workload():
    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}, torch.roll(ids, -1, 1), loss
'''


def _load(tmp_path: Path) -> Any:
    import importlib.util

    path = tmp_path / "llama70b_like.py"
    path.write_text(WORKLOAD)
    spec = importlib.util.spec_from_file_location("llama70b_like", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_plan_on_a_device_model_for_a_meta_llama_with_its_default_cache(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, module = _load(tmp_path)
    model = module.workload()[0]
    assert model.config.use_cache and model.device.type == "meta"  # as transformers builds it
    code = main(["plan", f"{path}:workload", "--device", "h100-80gb", "--ranks", "2",
                 "--microbatches", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["num_ranks"] == 2 and summary["step_time"] > 0
    assert {r for s in summary["stages"] for r in s["ranks"]} == {0, 1}


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=0.1, momentum=0.9)


@pytest.mark.slow
def test_a_meta_llama_with_its_default_cache_trains_like_one_process(tmp_path: Path) -> None:
    """The workload's model, built on meta, given the values of one built on the CPU
    (``weights=``: its state and the rotary table its constructor computes), on 2
    ranks; one process trains the CPU one, as transformers builds it (it also builds
    the cache, which the loss never reads)."""
    import orgel

    _, module = _load(tmp_path)
    meta, inputs, targets, loss_fn = module.workload()
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM(module.config())
    values = {**reference.state_dict(), **dict(reference.named_buffers())}
    first, _ = microbatches(Workload(copy.deepcopy(reference), inputs, targets, loss_fn), 2)[0]
    plan = balanced_plan(capture(copy.deepcopy(reference), first), ranks=2, microbatches=2)
    opt = _sgd(list(reference.parameters()))
    with orgel.pipeline(meta, inputs, targets, loss_fn, ranks=2, microbatches=2, plan=plan,
                        optimizer=_sgd, threads=1, weights=values) as pipe:
        for s in range(2):
            ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(s))
            y = torch.roll(ids, -1, 1)
            loss, out = pipe.step({"input_ids": ids}, y, outputs=True)
            ref = sum(loss_fn(reference(input_ids=part), t)
                      for part, t in zip(ids.chunk(2), y.chunk(2), strict=True)) / 2
            ref.backward()
            opt.step()
            opt.zero_grad()
            assert loss == pytest.approx(ref.item(), rel=1e-5)
            assert out.past_key_values is None  # the pipeline builds no cache
        state = pipe.state_dict()
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
