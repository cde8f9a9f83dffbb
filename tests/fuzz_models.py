"""Models the fuzzer draws besides the zoo's, for the batch options (``tests/fuzzing.py``).

* ``seqfirst``: a causal transformer on sequence-first ``[T, B]`` tokens, so the batch is
  dimension 1 of the inputs and the targets (``batch_dim=1``);
* ``memory``: rows that attend to a ``memory`` table every row reads whole (an input named
  in ``replicated``: every micro-batch gets all of it);
* ``breaks``: an MLP whose forward breaks the graph twice, a Python branch on a tensor's
  value in the middle and one at the very end (Dynamo captures three graphs; every
  micro-batch takes the same branches, so each runs the captured graphs);
* ``aux``: an MLP that also returns an auxiliary head's output, read off its first layer,
  which the loss ignores: that head keeps no gradient, as in one process.

:func:`workload` builds one as the zoo does (random weights from a seed, no downloads);
:data:`BATCH_DIM` and :data:`REPLICATED` say how its batch is cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models import ZooWorkload

#: the batch dimension of a model's inputs and targets, where it is not 0
BATCH_DIM: dict[str, int] = {"seqfirst": 1}
#: the inputs of a model that every micro-batch takes whole
REPLICATED: dict[str, tuple[str, ...]] = {"memory": ("memory",)}
NAMES: tuple[str, ...] = ("seqfirst", "memory", "breaks", "aux")
#: models whose forward has graph breaks (no meta model: the Python between graphs reads
#: values); ``graphbreak`` (tests/zoo.py) branches on a value: micro-batches take either arm
GRAPH_BREAKS: tuple[str, ...] = ("breaks", "graphbreak")

_VOCAB, _SEQ, _WIDTH, _HEADS, _SLOTS = 64, 8, 32, 4, 6


class SeqFirstBlock(nn.Module):
    """Pre-norm causal self-attention and an MLP on ``[T, B, width]``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(_WIDTH), nn.LayerNorm(_WIDTH)
        self.qkv, self.out = nn.Linear(_WIDTH, 3 * _WIDTH), nn.Linear(_WIDTH, _WIDTH)
        self.fc1, self.fc2 = nn.Linear(_WIDTH, 2 * _WIDTH), nn.Linear(2 * _WIDTH, _WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t, b, _ = h.shape
        heads = [part.reshape(t, b, _HEADS, _WIDTH // _HEADS).permute(1, 2, 0, 3)
                 for part in self.qkv(self.norm1(h)).chunk(3, dim=-1)]
        attended = F.scaled_dot_product_attention(*heads, is_causal=True)
        h = h + self.out(attended.permute(2, 0, 1, 3).reshape(t, b, _WIDTH))
        return h + self.fc2(F.gelu(self.fc1(self.norm2(h))))


class SeqFirst(nn.Module):
    """Tokens ``[T, B]`` to next-token logits ``[T, B, vocab]``."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _WIDTH)
        self.pos = nn.Parameter(torch.randn(_SEQ, 1, _WIDTH) * 0.02)
        self.blocks = nn.ModuleList(SeqFirstBlock() for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(_WIDTH), nn.Linear(_WIDTH, _VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[0]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class MemoryBlock(nn.Module):
    """Each row reads the memory table by attention, then an MLP; residual both."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key = nn.Linear(_WIDTH, _WIDTH), nn.Linear(_WIDTH, _WIDTH)
        self.fc1, self.fc2 = nn.Linear(_WIDTH, 2 * _WIDTH), nn.Linear(2 * _WIDTH, _WIDTH)

    def forward(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        scores = self.query(h) @ self.key(memory).T / _WIDTH ** 0.5  # [B, slots]
        h = h + torch.softmax(scores, dim=-1) @ memory
        return h + self.fc2(torch.tanh(self.fc1(h)))


class Memory(nn.Module):
    """Features ``[B, 16]`` and a memory ``[slots, width]`` to class logits ``[B, 5]``."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(16, _WIDTH)
        self.blocks = nn.ModuleList(MemoryBlock() for _ in range(layers))
        self.head = nn.Linear(_WIDTH, 5)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        for block in self.blocks:
            h = block(h, memory)
        return self.head(h)


class Breaks(nn.Module):
    """Features ``[B, 16]`` to class logits ``[B, 5]`` through residual MLP blocks, with a
    branch on a value after the second block and another after the head."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(16, _WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(_WIDTH, 2 * _WIDTH), nn.Tanh(),
                                                  nn.Linear(2 * _WIDTH, _WIDTH))
                                    for _ in range(layers))
        self.head = nn.Linear(_WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        first, second, *rest = self.blocks  # (Dynamo runs a loop that breaks eagerly)
        h = h + first(h)
        h = h + second(h)
        if h.abs().amax().item() >= 0.0:  # a graph break; always taken
            h = h + 0.5 * torch.tanh(h)
        for block in rest:
            h = h + block(h)
        logits = self.head(h)
        if logits.isfinite().all().item():  # a Python branch at the very end of forward
            return logits * 0.5
        return logits


class Aux(nn.Module):
    """Features ``[B, 16]`` to class logits ``[B, 5]`` and an auxiliary output ``[B, 3]``
    from the first layer, which the loss ignores."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(16, _WIDTH)
        self.aux = nn.Linear(_WIDTH, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(_WIDTH, 2 * _WIDTH), nn.Tanh(),
                                                  nn.Linear(2 * _WIDTH, _WIDTH))
                                    for _ in range(layers))
        self.head = nn.Linear(_WIDTH, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.proj(x))
        aux = self.aux(h)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h), aux


def _first_loss(out: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0], labels)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, _VOCAB), targets.reshape(-1))


def workload(name: str, *, batch_size: int = 4, seed: int = 0) -> ZooWorkload:
    """``name``'s model with weights from ``seed`` and a batch of ``batch_size`` rows."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "seqfirst":
        tokens = torch.randint(0, _VOCAB, (_SEQ + 1, batch_size), generator=g)
        return ZooWorkload(SeqFirst(), {"tokens": tokens[:-1]}, tokens[1:], _lm_loss)
    if name == "memory":
        inputs = {"x": torch.randn(batch_size, 16, generator=g),
                  "memory": torch.randn(_SLOTS, _WIDTH, generator=g)}
        labels = torch.randint(0, 5, (batch_size,), generator=g)
        return ZooWorkload(Memory(), inputs, labels, F.cross_entropy)
    if name == "breaks":
        x = torch.randn(batch_size, 16, generator=g)
        return ZooWorkload(Breaks(), {"x": x}, torch.randint(0, 5, (batch_size,), generator=g),
                           F.cross_entropy)
    if name == "aux":
        x = torch.randn(batch_size, 16, generator=g)
        return ZooWorkload(Aux(), {"x": x}, torch.randint(0, 5, (batch_size,), generator=g),
                           _first_loss)
    raise KeyError(f"no fuzzer model {name!r}; one of {NAMES}")
