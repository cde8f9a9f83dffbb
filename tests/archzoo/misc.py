"""Small hand-written models that exercise the failure classes of an automatic pipeline tool.

Each builder returns a :class:`orgel.models.ZooWorkload` with random weights
(``torch.manual_seed(0)``), a batch of 4 from a seeded generator, no dropout,
and a loss averaged over the batch. The models are tiny but have at least four
sequential layers so they can be cut into two stages. This module covers recurrent
modules, graph breaks (data-dependent branches, ``.item()``), shared and tied
parameters, in-place ops on stage inputs, ``torch.vmap`` and buffers mutated in
forward, and holds what :mod:`archzoo.misc_regions` shares with it (the data, the
cross-entropy loss, ``_mlp``, ``_workload`` and ``ResidualMLP``). That module has
autocast and no-grad regions, dict and tuple outputs, mixture of experts routing,
``nn.EmbeddingBag``, frozen parameters, an MLP-Mixer and a siamese BatchNorm encoder.

:data:`GRAPH_BREAKS` names the models that ``torch.compile(fullgraph=True)``
cannot capture as one graph (torch 2.13), with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models import ZooWorkload

BATCH = 4
VOCAB = 64
SEQ = 8
DIM = 32
CLASSES = 4
Inputs = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(input_ids, next_ids)`` of shape ``(BATCH, SEQ)``."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _features(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard-normal features of shape ``(BATCH, *shape)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((BATCH, *shape), generator=gen)


def _labels(seed: int, classes: int = CLASSES) -> torch.Tensor:
    """Random class labels of shape ``(BATCH,)``."""
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, classes, (BATCH,), generator=gen)


def _ce_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim of ``(B, C)`` or ``(B, T, C)`` logits."""
    return F.cross_entropy(outputs.flatten(0, -2), targets.flatten())


def _mlp(sizes: list[int]) -> nn.Sequential:
    """Linear layers of the given sizes with a GELU between consecutive ones."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        if i:
            layers.append(nn.GELU())
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
    return nn.Sequential(*layers)


def _workload(make: Callable[[], nn.Module], inputs: Inputs, targets: torch.Tensor,
              loss_fn: Callable[..., torch.Tensor]) -> ZooWorkload:
    """Seed torch with 0, build the model in train mode and pack the workload."""
    torch.manual_seed(0)
    model = make().train()
    return ZooWorkload(model, inputs, targets, loss_fn)


class RecurrentNet(nn.Module):
    """Embedding, then a 2-layer LSTM LM head on every step or a bidirectional GRU classifier."""

    def __init__(self, lstm: bool) -> None:
        super().__init__()
        self.last = not lstm
        self.embed = nn.Embedding(VOCAB, DIM)
        self.rnn: nn.Module
        if lstm:
            self.rnn = nn.LSTM(DIM, DIM, num_layers=2, batch_first=True)
        else:
            self.rnn = nn.GRU(DIM, DIM // 2, batch_first=True, bidirectional=True)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB if lstm else CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(ids))
        if self.last:
            h = h[:, -1]
        return self.head(torch.tanh(self.hidden(h)))


class RnnCellLoop(nn.Module):
    """An LSTMCell unrolled in a Python loop over the sequence, between Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.cell = nn.LSTMCell(DIM, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = torch.tanh(self.inp(x))
        h = xs.new_zeros(xs.shape[0], DIM)
        c = xs.new_zeros(xs.shape[0], DIM)
        for t in range(xs.shape[1]):
            h, c = self.cell(xs[:, t], (h, c))
        return self.head(F.relu(self.hidden(h)))


class Sandwich(nn.Module):
    """Two Linear layers, a ``middle`` step that subclasses define, two more Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.before = _mlp([16, DIM, DIM])
        self.after = _mlp([DIM, DIM, CLASSES])

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(F.gelu(self.middle(self.before(x))))


class DataDependentBranch(Sandwich):
    """A Python ``if`` on ``h.mean() > 0`` in the middle."""

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        if h.mean() > 0:
            return h * 2
        return h - 1


class ItemScale(Sandwich):
    """Scales the activation by Python float math on a value taken with ``.item()``."""

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return h * (1.0 / (1.0 + math.log1p(h.detach().abs().mean().item())))


class BufferCounter(Sandwich):
    """A step counter and a running mean updated in place in the middle of forward."""

    steps: torch.Tensor
    running_mean: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("running_mean", torch.zeros(DIM))

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            self.running_mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return h - self.running_mean


class SharedLayer(nn.Module):
    """One Linear block applied 4 times in a row (ALBERT-style), with input and output layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.block = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(4):
            h = h + torch.tanh(self.block(h))
        return self.head(h)


class ResidualMLP(nn.Module):
    """Pre-norm residual block: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, dim: int = DIM, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TiedLM(nn.Module):
    """A tiny LM whose head weight is the embedding weight, with 4 residual MLP blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        nn.init.normal_(self.embed.weight, std=0.1)
        self.blocks = nn.Sequential(*(ResidualMLP() for _ in range(4)))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids))))


class FarSharedEncoder(nn.Module):
    """Six residual MLP layers where layer 5 reuses layer 0's first Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.layers = nn.ModuleList(ResidualMLP() for _ in range(6))
        self.layers[5].fc1 = self.layers[0].fc1
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class InplaceBlock(nn.Module):
    """An in-place ReLU on the block input, a Linear, then an in-place residual add."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "functional":
            x = F.relu(x, inplace=True)
        elif self.kind == "method":
            x = x.relu_()
        else:
            x = self.act(x)
        h = self.fc(x)
        h.add_(x)
        return h


class InplaceMLP(nn.Module):
    """Input layer, three blocks mutating their inputs in place, output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        kinds = ("functional", "method", "module")
        self.blocks = nn.Sequential(*(InplaceBlock(k) for k in kinds))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def _sample_mask(sample: torch.Tensor) -> torch.Tensor:
    """Causal ``(T, T)`` mask of one sample, also hiding all-zero positions."""
    positions = torch.arange(sample.shape[0], device=sample.device)
    causal = positions[None, :] <= positions[:, None]
    valid = sample.abs().sum(-1) > 0
    return causal & valid[None, :]


class VmapMaskAttention(nn.Module):
    """Builds an attention mask with ``torch.vmap``, then single-head attention and MLPs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = ResidualMLP()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.vmap(_sample_mask)(x)
        h = self.inp(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) / DIM**0.5
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + self.proj(attn @ v)
        return self.head(self.mlp(h).mean(1))


def lstm_lm() -> ZooWorkload:
    """Embedding, 2-layer LSTM, vocabulary head; next-token cross-entropy."""
    ids, targets = _tokens(0)
    return _workload(lambda: RecurrentNet(lstm=True), (ids,), targets, _ce_loss)


def gru_classifier() -> ZooWorkload:
    """Embedding, bidirectional GRU, last step, classifier."""
    ids, _ = _tokens(1)
    return _workload(lambda: RecurrentNet(lstm=False), (ids,), _labels(1), _ce_loss)


def rnn_cell_loop() -> ZooWorkload:
    """LSTMCell unrolled over 8 steps in a Python loop."""
    return _workload(RnnCellLoop, (_features(2, (SEQ, 16)),), _labels(2), _ce_loss)


def data_dependent_branch() -> ZooWorkload:
    """MLP with ``if h.mean() > 0`` in the middle."""
    return _workload(DataDependentBranch, (_features(3, (16,)),), _labels(3), _ce_loss)


def item_print() -> ZooWorkload:
    """MLP scaled by a Python float from ``.item()``."""
    return _workload(ItemScale, (_features(4, (16,)),), _labels(4), _ce_loss)


def shared_layer() -> ZooWorkload:
    """One Linear block reused 4 times in a row."""
    return _workload(SharedLayer, (_features(5, (16,)),), _labels(5), _ce_loss)


def tied_embedding() -> ZooWorkload:
    """LM whose output projection is the input embedding."""
    ids, targets = _tokens(6)
    return _workload(TiedLM, (ids,), targets, _ce_loss)


def shared_across_far_layers() -> ZooWorkload:
    """Encoder whose layer 5 reuses layer 0's Linear."""
    return _workload(FarSharedEncoder, (_features(7, (16,)),), _labels(7), _ce_loss)


def inplace_input() -> ZooWorkload:
    """Blocks that ReLU their input in place and add the residual in place."""
    return _workload(InplaceMLP, (_features(8, (16,)),), _labels(8), _ce_loss)


def vmap_mask() -> ZooWorkload:
    """Attention mask built with ``torch.vmap``, then attention and an MLP."""
    return _workload(VmapMaskAttention, (_features(9, (SEQ, 16)),), _labels(9), _ce_loss)


def buffer_counter() -> ZooWorkload:
    """A step counter and running mean updated in place in forward."""
    return _workload(BufferCounter, (_features(10, (16,)),), _labels(10), _ce_loss)


BUILDERS: dict[str, Callable[[], ZooWorkload]] = {
    build.__name__: build
    for build in (
        lstm_lm, gru_classifier, rnn_cell_loop, data_dependent_branch, item_print,
        shared_layer, tied_embedding, shared_across_far_layers, inplace_input, vmap_mask,
        buffer_counter,
    )
}

#: Models that ``torch.compile(fullgraph=True)`` with Dynamo's default settings cannot capture
#: as one graph, and why (orgel's capture sets ``allow_rnn``, so the RNNs capture there).
GRAPH_BREAKS: dict[str, str] = {
    "lstm_lm": "Dynamo does not trace nn.LSTM (torch._dynamo.config.allow_rnn is False)",
    "gru_classifier": "Dynamo does not trace nn.GRU (torch._dynamo.config.allow_rnn is False)",
    "data_dependent_branch": "Python `if` on a tensor value (h.mean() > 0)",
    "item_print": "math.log1p on a float from .item() needs the data-dependent value",
}
