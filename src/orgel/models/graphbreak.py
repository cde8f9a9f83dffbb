"""A model whose forward deliberately breaks the graph, to test capture errors.

``forward`` reads a tensor value into Python with ``.item()`` and branches on
it, so ``torch.compile(fullgraph=True)`` must fail and a non-fullgraph capture
yields more than one graph.
"""

from __future__ import annotations

import torch
from torch import nn

from orgel.models.layers import ZooWorkload, check_positive, classification_loss


class GraphBreakMLP(nn.Module):
    """Two linear layers with a Python branch on a tensor value between them."""

    def __init__(self, d_in: int, hidden: int, n_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        # Deliberate: a data-dependent Python branch cannot live in one graph.
        if h.mean().item() > 0.0:
            h = torch.relu(h)
        else:
            h = torch.tanh(h)
        return self.fc2(h)


def build_graphbreak(
    *, batch_size: int = 4, seed: int = 0, d_in: int = 16, hidden: int = 32, n_classes: int = 4
) -> ZooWorkload:
    """Workload around :class:`GraphBreakMLP` with random features and labels."""
    check_positive(batch_size=batch_size, d_in=d_in, hidden=hidden, n_classes=n_classes)
    torch.manual_seed(seed)
    model = GraphBreakMLP(d_in, hidden, n_classes)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, d_in, generator=gen)
    y = torch.randint(0, n_classes, (batch_size,), generator=gen)
    return ZooWorkload(model, (x,), y, classification_loss)
