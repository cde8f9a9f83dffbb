"""orgel checkpoint info/export on a checkpoint written by the format functions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from orgel.cli import main
from orgel.runtime import checkpoint as ckpt
from orgel.schedule.families import build_schedule


def _write(root: Path) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    named = list(model.named_parameters())
    for rank, part in enumerate((named[:2], named[2:])):
        shard = ckpt.make_shard(rank=rank, step=7, params=part, buffers=[], optimizer=None)
        ckpt.write_shard(root, 7, rank, shard)
    ckpt.commit(root, 7, 2, build_schedule("1f1b", 2, 2).to_json())
    return model


def test_export_writes_a_loadable_state_dict(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = _write(tmp_path)
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "export", str(tmp_path), str(out)]) == 0
    assert "wrote 4 tensors of step 7" in capsys.readouterr().out
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fresh.load_state_dict(torch.load(out, weights_only=True))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_info_lists_ranks_and_missing_dirs_fail_cleanly(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path)
    assert main(["checkpoint", "info", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "step 7, 2 ranks, 4 tensors" in text and "rank 1: 2 tensors (1.bias, 1.weight)" in text
    assert main(["checkpoint", "export", str(tmp_path / "nope"), "x.pt"]) == 2
    assert "save one with pipe.save(DIR) first" in capsys.readouterr().err
