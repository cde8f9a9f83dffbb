"""Checkpoint format: atomic commit, weights-only shards, export and re-sharding by name."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from orgel import guard
from orgel.runtime import checkpoint as ckpt

Shard = tuple[ckpt.NamedTensors, torch.optim.Optimizer]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _train_step(model: nn.Module, opts: list[torch.optim.Optimizer], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
    for o in opts:
        o.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    for o in opts:
        o.step()


def _shards(model: nn.Module, groups: list[list[str]]) -> list[Shard]:
    named = dict(model.named_parameters())
    out = []
    for names in groups:
        params = [(n, named[n]) for n in names]
        out.append((params, torch.optim.AdamW([p for _, p in params], lr=0.01)))
    return out


def _save(root: Path, model: nn.Module, shards: list[Shard], step: int,
          keep: int | None = None) -> None:
    buffers = list(model.named_buffers())
    for rank, (params, opt) in enumerate(shards):
        shard = ckpt.make_shard(
            rank=rank, step=step, params=params,
            buffers=buffers if rank == 0 else [],
            optimizer=ckpt.named_optimizer_state(opt, params), rng=guard.rng_state(),
        )
        ckpt.write_shard(root, step, rank, shard)
    ckpt.commit(root, step, len(shards), json.dumps({"plan": "x"}), keep=keep)


GROUPS2 = [["0.weight", "0.bias", "1.weight"], ["1.bias", "2.weight", "2.bias"]]
GROUPS3 = [["0.weight"], ["0.bias", "1.weight", "1.bias"], ["2.weight", "2.bias"]]


def test_export_is_the_original_state_dict(tmp_path: Path) -> None:
    model = _model()
    shards = _shards(model, GROUPS2)
    _train_step(model, [o for _, o in shards], 1)
    _save(tmp_path, model, shards, 1)
    out = tmp_path / "model.pt"
    assert ckpt.export(tmp_path, out) == len(model.state_dict())
    loaded = torch.load(out, weights_only=True)
    fresh = _model()
    fresh.load_state_dict(loaded)
    for (n, a), (m, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b)


def test_reshard_2_to_3_resumes_bit_identically(tmp_path: Path) -> None:
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for s in range(3):
        _train_step(reference, [ref_opt], s)

    model = _model()
    shards = _shards(model, GROUPS2)
    _train_step(model, [o for _, o in shards], 0)
    _save(tmp_path, model, shards, 1)

    resumed = _model()  # different weights are overwritten from the checkpoint
    torch.nn.init.zeros_(resumed[0].weight)
    new_shards = _shards(resumed, GROUPS3)
    for params, opt in new_shards:
        part = ckpt.read_names(tmp_path, [n for n, _ in params])
        assert part["step"] == 1
        with torch.no_grad():
            for n, p in params:
                p.copy_(part["params"][n])
        ckpt.load_named_optimizer_state(opt, params, part["optimizer"])
    bufs = ckpt.read_names(tmp_path, [n for n, _ in resumed.named_buffers()])["buffers"]
    for n, b in resumed.named_buffers():
        b.copy_(bufs[n])
    for s in (1, 2):
        _train_step(resumed, [o for _, o in new_shards], s)
    pairs = zip(reference.state_dict().items(), resumed.state_dict().values(), strict=True)
    for (n, a), b in pairs:
        assert torch.equal(a, b), n


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    model = _model()
    shards = _shards(model, GROUPS2)
    _save(tmp_path, model, shards, 1)
    before = ckpt.state_dict(tmp_path)
    _train_step(model, [o for _, o in shards], 5)
    # rank 0 wrote its shard for step 2, then the job died before rank 1 and the commit
    params, opt = shards[0]
    shard = ckpt.make_shard(rank=0, step=2, params=params, buffers=[],
                            optimizer=ckpt.named_optimizer_state(opt, params))
    ckpt.write_shard(tmp_path, 2, 0, shard)
    (ckpt.staging_dir(tmp_path, 2) / ".rank1.pt.partial").write_bytes(b"\x00garbage")
    assert ckpt.resolve(tmp_path).name == "step-00000001"
    after = ckpt.state_dict(tmp_path)
    assert all(torch.equal(before[n], after[n]) for n in before)
    with pytest.raises(ckpt.CheckpointError, match="not written"):
        ckpt.commit(tmp_path, 2, 2, "{}")
    # a later complete save replaces it; the older folder stays unless keep= says otherwise
    _save(tmp_path, model, shards, 3)
    assert ckpt.resolve(tmp_path).name == "step-00000003"
    assert ckpt.step_dir(tmp_path, 1).exists()
    _save(tmp_path, model, shards, 4, keep=1)
    assert ckpt.resolve(tmp_path).name == "step-00000004"
    assert not ckpt.step_dir(tmp_path, 1).exists()
    assert not ckpt.step_dir(tmp_path, 3).exists()
    assert ckpt.read_meta(tmp_path)["owners"]["2.bias"] == [1]


def test_shards_are_plain_data_and_rng_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    state = guard.rng_state()
    expected = (torch.rand(2), random.random(), np.random.rand())
    model = _model()
    _save(tmp_path, model, _shards(model, GROUPS2), 4)
    shard = ckpt.read_shard(tmp_path, 1)  # weights_only=True inside: no objects
    assert shard["step"] == 4 and set(shard["params"]) == set(GROUPS2[1])
    assert json.loads(ckpt.read_plan_json(tmp_path)) == {"plan": "x"}
    guard.set_rng_state(state)
    again = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


def test_missing_checkpoint_and_foreign_names_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ckpt.CheckpointError, match="pipe.save"):
        ckpt.resolve(tmp_path)
    model = _model()
    _save(tmp_path, model, _shards(model, GROUPS2), 1)
    with pytest.raises(ckpt.CheckpointError, match="different model"):
        ckpt.read_names(tmp_path, ["encoder.weight"])


@pytest.mark.parametrize("crash_at", range(1, 9))
def test_resaving_a_step_leaves_a_complete_checkpoint_at_every_instant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: int) -> None:
    """A crash anywhere while step 1 is saved again: LATEST still names a whole checkpoint.

    The old code deleted the step folder while LATEST named it, then renamed the new one.
    """
    model = _model()
    _save(tmp_path, model, _shards(model, GROUPS2), 1)
    calls = {"n": 0}
    real = {"replace": os.replace, "rmtree": shutil.rmtree}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == crash_at:
                raise OSError("simulated crash")
            return real[name](*args, **kwargs)
        return call

    for rank, (params, opt) in enumerate(_shards(model, GROUPS2)):
        shard = ckpt.make_shard(rank=rank, step=1, params=params, buffers=[],
                                optimizer=ckpt.named_optimizer_state(opt, params))
        ckpt.write_shard(tmp_path, 1, rank, shard)
    monkeypatch.setattr(ckpt.os, "replace", counted("replace"))
    monkeypatch.setattr(ckpt.shutil, "rmtree", counted("rmtree"))
    try:
        ckpt.commit(tmp_path, 1, 2, json.dumps({"plan": "x"}))
    except OSError:
        pass
    monkeypatch.undo()
    folder = ckpt.resolve(tmp_path)
    assert (folder / "meta.json").exists() and (folder / "rank1.pt").exists()
    assert ckpt.read_meta(tmp_path)["step"] == 1


def test_a_truncated_or_replaced_shard_names_the_file_and_the_last_good_checkpoint(
        tmp_path: Path) -> None:
    model = _model()
    shards = _shards(model, GROUPS2)
    _save(tmp_path, model, shards, 1)
    shutil.copytree(tmp_path / "step-00000001", tmp_path / "kept" / "step-00000001")
    _save(tmp_path, model, shards, 2, keep=1)  # removes step 1
    with pytest.raises(ckpt.CheckpointError, match="no other complete checkpoint"):
        (ckpt.resolve(tmp_path) / "rank1.pt").write_bytes(b"PK\x03\x04")
        ckpt.read_shard(tmp_path, 1)
    shutil.move(tmp_path / "kept" / "step-00000001", tmp_path / "step-00000001")
    newest = ckpt.resolve(tmp_path) / "rank1.pt"
    _save(tmp_path / "fresh", model, shards, 2)
    shutil.copy(tmp_path / "fresh" / "step-00000002" / "rank1.pt", newest)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a copy that stopped half-way
    with pytest.raises(ckpt.CheckpointError, match=r"rank1\.pt is incomplete or corrupt .*"
                       r"newest other complete checkpoint is .*step-00000001"):
        ckpt.read_shard(tmp_path, 1)

    class Payload:  # what a pickle with code in it would rebuild
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("pwned",))

    torch.save({"params": Payload()}, newest)
    with pytest.raises(ckpt.CheckpointError, match="weights_only loading refuses"):
        ckpt.read_shard(tmp_path, 1)
    newest.unlink()
    with pytest.raises(ckpt.CheckpointError, match="rank1.pt is missing"):
        ckpt.read_shard(tmp_path, 1)
    assert set(ckpt.read_shard(tmp_path / "step-00000001", 1)["params"]) == set(GROUPS2[1])


def test_a_shard_writes_a_ranks_own_tensors_and_a_view_at_its_own_size(tmp_path: Path) -> None:
    """A save holds no second copy of a rank's parameters and optimizer state: a CPU tensor
    that fills its storage is written as it is; a view of a flat buffer (a replicated
    stage's) is copied at its own size, not written with the whole buffer."""
    flat = torch.arange(1 << 16, dtype=torch.float32)
    whole, view = torch.randn(64, 64), flat[:16].view(4, 4)
    opt = torch.optim.AdamW([whole], lr=0.01)
    whole.grad = torch.ones_like(whole)
    opt.step()
    shard = ckpt.make_shard(rank=0, step=1, params=[("w", whole), ("v", view)], buffers=[],
                            optimizer=ckpt.named_optimizer_state(opt, [("w", whole)]))
    assert shard["params"]["w"].data_ptr() == whole.data_ptr()  # not copied
    assert shard["optimizer"]["state"]["w"]["exp_avg"].data_ptr() == \
        opt.state[whole]["exp_avg"].data_ptr()
    path = ckpt.write_shard(tmp_path, 1, 0, shard)
    assert path.stat().st_size < flat.nbytes // 2  # the view alone, not its buffer
    read = torch.load(path, weights_only=True)
    assert torch.equal(read["params"]["v"], view) and torch.equal(read["params"]["w"], whole)
