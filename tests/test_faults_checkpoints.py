"""Faults in checkpoints: a disk that fills during ``save``, a damaged shard at ``load``.

A save that fails on a rank commits nothing and training goes on; a shard cut short or
replaced by a pickle with code is refused by ``load`` and by ``orgel checkpoint export``,
and no rank's state changes. The pipeline and the bound come from ``test_faults.py``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from test_faults import PROPAGATION_S, _batch, start

pytestmark = pytest.mark.slow  # starts rank processes


def test_a_disk_that_fills_during_save_commits_nothing_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save on a rank fails with ENOSPC: save raises naming the rank and the cause, the
    previous checkpoint stays the latest, no partial file stays, and the pipeline trains and
    saves again once there is room."""
    import errno

    from orgel.runtime import checkpoint as ckpt

    flag = tmp_path / "disk-full"
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if flag.exists() and getattr(f, "name", "").endswith(".partial"):
            f.write(b"PK\x03\x04 half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)  # before the ranks fork: they inherit it
    root = tmp_path / "ckpt"
    x, y = _batch()
    with start(flag, "none") as pipe:
        pipe.step((x,), y)
        first = pipe.save(root)
        pipe.step((x,), y)
        flag.touch()
        start_s = time.monotonic()
        with pytest.raises(ckpt.CheckpointError, match=r"saving the checkpoint of step 2 .* "
                           r"failed on rank \d \(OSError: \[Errno 28\] No space left on device\); "
                           r"nothing was committed and .*step-00000001 is still the latest"):
            pipe.save(root)
        assert time.monotonic() - start_s < PROPAGATION_S
        assert ckpt.resolve(root) == first
        assert not list(root.rglob("*.partial")) and not (root / "step-00000002.tmp").exists()
        pipe.step((x,), y)  # the ranks are alive and train on
        flag.unlink()
        assert pipe.save(root).name == "step-00000003"


class Payload:
    """What a pickle with code in it would rebuild."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("damage", ["truncated", "code"])
def test_a_damaged_shard_is_refused_by_load_and_by_the_cli_and_changes_nothing(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A shard cut short, or replaced by a pickle with code in it: ``load`` raises naming the
    file, what is wrong and the last complete checkpoint; no rank's state changed and the
    pipeline trains on; ``orgel checkpoint export`` says the same and exits 2."""
    from orgel.cli import main
    from orgel.runtime import checkpoint as ckpt

    root = tmp_path / "ckpt"
    x, y = _batch()
    with start(tmp_path / "no-fault", "none") as pipe:
        pipe.step((x,), y)
        pipe.step((x,), y)
        shard = pipe.save(root) / "rank1.pt"
        if damage == "truncated":
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        else:
            torch.save({"params": Payload()}, shard)
        before = pipe.state_dict()
        start_s = time.monotonic()
        why = ("is incomplete or corrupt" if damage == "truncated"
               else "holds Python objects that weights_only loading refuses")
        with pytest.raises(ckpt.CheckpointError, match=rf"rank 1 cannot resume: .*rank1\.pt "
                           rf"{why}(.|\n)*No rank's state changed; the pipeline is still at "
                           r"step 2"):
            pipe.load(root)
        assert time.monotonic() - start_s < PROPAGATION_S
        after = pipe.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert torch.isfinite(torch.tensor(pipe.step((x,), y)))
    assert main(["checkpoint", "export", str(root), str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err
    assert "rank1.pt" in err and why in err, err
    assert "Traceback" not in err
