"""The workload convention: naming inputs, validation errors, micro-batches, loading from a file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from orgel.workload import (
    Workload,
    WorkloadError,
    load_workload,
    microbatches,
    named_inputs,
    validate_workload,
)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, image: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(image) * scale


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _workload(batch: int = 6) -> Workload:
    torch.manual_seed(0)
    return Workload(
        TwoInputs(), (torch.randn(batch, 4), torch.tensor(2.0)),
        torch.randint(0, 3, (batch,)), _loss,
    )


def test_positional_inputs_are_named_by_the_forward_signature() -> None:
    w = _workload()
    named = named_inputs(w.model, w.inputs)
    assert list(named) == ["image", "scale"]
    assert named["image"] is w.inputs[0]
    assert named_inputs(w.model, {"scale": 1, "image": 2}) == {"scale": 1, "image": 2}


def test_too_many_positional_inputs_is_an_error() -> None:
    w = _workload()
    with pytest.raises(WorkloadError, match="takes 2 positional inputs"):
        named_inputs(w.model, (1, 2, 3))


def test_microbatches_split_batched_tensors_and_share_the_rest() -> None:
    w = _workload()
    parts = microbatches(w, 3)
    assert len(parts) == 3
    for i, (inputs, targets) in enumerate(parts):
        assert torch.equal(inputs["image"], w.inputs[0][2 * i: 2 * i + 2])
        assert inputs["scale"] is w.inputs[1]  # no batch dim: passed whole
        assert torch.equal(targets, w.targets[2 * i: 2 * i + 2])


def test_microbatches_split_tuple_targets_and_other_batch_dims() -> None:
    w = _workload()
    w.targets = (w.targets, torch.arange(6))
    parts = microbatches(w, 2)
    assert torch.equal(parts[1][1][1], torch.arange(3, 6))
    seq = Workload(TwoInputs(), {"image": torch.randn(2, 6, 4)}, torch.zeros(2, 6), _loss, 1)
    assert microbatches(seq, 3)[0][0]["image"].shape == (2, 2, 4)


def test_validation_names_what_is_wrong() -> None:
    validate_workload(_workload(), 3)
    with pytest.raises(WorkloadError, match="not divisible into 4 micro-batches"):
        validate_workload(_workload(), 4)
    no_batch = Workload(TwoInputs(), (torch.tensor(1.0), torch.tensor(2.0)), torch.tensor(0), _loss)
    with pytest.raises(WorkloadError, match="no input or target has a batch dimension"):
        validate_workload(no_batch)
    bad_inputs = Workload(TwoInputs(), ("text", torch.tensor(2.0)), torch.zeros(2), _loss)
    with pytest.raises(WorkloadError, match="input 'image' is a str"):
        validate_workload(bad_inputs)
    w = _workload()
    w.loss_fn = lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")
    with pytest.raises(WorkloadError, match="must return a scalar"):
        validate_workload(w)
    w = _workload()
    w.targets = torch.zeros(5, dtype=torch.long)
    with pytest.raises(WorkloadError, match="disagree on the batch size"):
        validate_workload(w)
    with pytest.raises(WorkloadError, match="positive integer"):
        validate_workload(_workload(), 0)


def test_validation_leaves_batchnorm_statistics_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    w = Workload(model, (torch.randn(6, 4),), torch.randint(0, 3, (6,)), _loss)
    before = {n: b.clone() for n, b in model.named_buffers()}
    validate_workload(w, 2)
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())


def test_load_workload_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "wl.py"
    path.write_text(textwrap.dedent("""
        import torch
        def workload():
            model = torch.nn.Linear(3, 2)
            x = torch.randn(4, 3)
            y = torch.randint(0, 2, (4,))
            return model, (x,), y, torch.nn.functional.cross_entropy
        def wrong():
            return 1
    """))
    w = load_workload(f"{path}:workload")
    assert isinstance(w.model, nn.Linear) and w.inputs[0].shape == (4, 3)
    validate_workload(w, 2)
    with pytest.raises(WorkloadError, match="must return the 4-tuple"):
        load_workload(f"{path}:wrong")
    with pytest.raises(WorkloadError, match="no function 'nope'"):
        load_workload(f"{path}:nope")
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(f"{tmp_path}/missing.py:workload")
    with pytest.raises(WorkloadError, match="path/to/file.py:function"):
        load_workload(str(path))


def test_a_model_with_nothing_to_train_is_refused() -> None:
    """It used to train "3 steps" that changed nothing, silently."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).requires_grad_(False)
    w = Workload(model, (torch.randn(4, 4),), torch.randn(4, 2), nn.functional.mse_loss)
    with pytest.raises(WorkloadError, match="no trainable parameters"):
        validate_workload(w, 2)
    model[1].requires_grad_(True)  # partly frozen is fine
    validate_workload(w, 2)


class Seen(nn.Module):
    """Records the kind of tensor each forward gets; ``reads`` makes the forward read a
    value (a Python ``if`` on a tensor), which fake tensors cannot answer."""

    def __init__(self, reads: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.reads = reads
        self.kinds: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        self.kinds.append("fake" if isinstance(x, FakeTensor) else "real")
        if self.reads and bool(x.sum() > 1e9):
            return self.fc(x) * 2
        return self.fc(x)


def test_the_trial_forward_uses_fake_tensors_and_real_ones_only_where_it_must() -> None:
    """Whether the loss is a floating scalar needs shapes and dtypes only: the trial forward
    of the whole batch runs on fake tensors (a large model's costs no arithmetic); a forward
    that reads a value runs for real, and its own errors are still the user's."""
    y = torch.randint(0, 3, (6,))
    plain = Seen(reads=False)
    validate_workload(Workload(plain, (torch.randn(6, 4),), y, _loss))
    assert plain.kinds == ["fake"]
    reading = Seen(reads=True)
    validate_workload(Workload(reading, (torch.randn(6, 4),), y, _loss))
    assert reading.kinds == ["fake", "real"]
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        validate_workload(Workload(Seen(reads=False), (torch.randn(6, 5),), y, _loss))
