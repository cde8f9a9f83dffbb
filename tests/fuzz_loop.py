"""The fuzzer's training loop, written once for both sides (``tests/fuzzing.py``).

What orgel's run and the one-process run share: the optimizer and its groups, the
learning-rate shapes, freezing, a meta model's documented initialization, and each
setup's model and batches (:func:`workloads`). ``setup`` is a :class:`fuzzing.Setup`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import fuzz_models
import zoo
from orgel.models import ZooWorkload
from orgel.split.materialize import module_seed

if TYPE_CHECKING:  # fuzzing imports this module
    from fuzzing import Setup

STEPS = 2  # optimizer steps per run


def make_optimizer(setup: Setup, named: Iterable[tuple[str, torch.nn.Parameter]]
                   ) -> torch.optim.Optimizer:
    """SGD, momentum SGD or AdamW with weight decay; two groups by name (no decay on
    one-dimensional parameters) so groups reach the ranks by name too.

    AdamW's ``eps`` is 1e-4: a gradient that is zero in exact arithmetic (attention's key
    bias) is rounding noise of about 1e-9, which ``eps=1e-6`` turns into updates of about
    1e-5 whose size depends on the summation order; tensor parallelism's split matmuls sum
    in another order than one process, so such a draw failed even against float64."""
    matrices, vectors = [], []
    for _, p in named:
        (matrices if p.dim() >= 2 else vectors).append(p)
    if setup.optimizer == "adamw":
        return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                  {"params": vectors, "weight_decay": 0.0}], lr=1e-2, eps=1e-4)
    momentum = 0.9 if setup.optimizer == "momentum" else 0.0
    return torch.optim.SGD([{"params": matrices}, {"params": vectors}], lr=0.05,
                           momentum=momentum)


def warmup(step: int) -> float:
    """The LambdaLR factor (``scheduler``) and the rate's shape (``lr``): a warm-up."""
    return (step + 1) / 3


def rate(step: int) -> float:
    """``lr=``: the rate of every group for optimizer step ``step``."""
    return 0.02 * warmup(step)


def fuzz_init(module: torch.nn.Module) -> None:
    """``init=`` for a meta model: matrices N(0, 0.02); a module without
    ``reset_parameters`` gets N(0, 0.02) on its vectors too."""
    for p in module._parameters.values():
        if p is not None and (p.dim() >= 2 or not hasattr(module, "reset_parameters")):
            torch.nn.init.normal_(p, std=0.02)


def _apply_order(module: torch.nn.Module, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for name, child in module.named_children():
        yield from _apply_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


def init_as_documented(model: torch.nn.Module, seed: int) -> None:
    """Give ``model`` the values ``orgel.pipeline(init=fuzz_init)`` documents for a meta
    model: each module holding tensors reset, then ``init``, under ``module_seed``."""
    with torch.no_grad():
        for name, module in _apply_order(model):
            if not (module._parameters or module._buffers):
                continue
            torch.manual_seed(module_seed(seed, name))
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            fuzz_init(module)


def freeze(setup: Setup, model: torch.nn.Module) -> list[str]:
    """Set ``requires_grad=False`` on the setup's frozen parameters; their names."""
    names = [n for n, _ in model.named_parameters()]
    if setup.frozen == "module":  # every parameter of one module the forward uses
        owners = sorted({n.rsplit(".", 1)[0] for n in names if "." in n})
        owner = owners[setup.frozen_module % len(owners)]
        chosen = [n for n in names if n.rsplit(".", 1)[0] == owner]
    elif setup.frozen == "every3":
        chosen = names[setup.seed % 3::3]
    elif setup.frozen == "head":  # fine-tuning: only the last module's parameters train
        last = names[-1].rsplit(".", 1)[0]
        chosen = [n for n in names if n.rsplit(".", 1)[0] != last]
    else:
        chosen = []
    params = dict(model.named_parameters())
    for n in chosen:
        params[n].requires_grad_(False)
    return chosen


@dataclass
class Workloads:
    """The setup's model (with values), its batches and loss, and how its batch is cut:
    ``batch_dim`` (inputs and targets alike) and the inputs every share takes whole."""

    model: torch.nn.Module
    inputs: Any
    targets: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch_dim: int = 0
    replicated: tuple[str, ...] = ()
    batches: list[tuple[Any, Any]] = field(default_factory=list)
    rows: int = 0  # the rows of each batch in ``batches``


def build(model: str, *, batch_size: int, seed: int) -> ZooWorkload:
    """The named model of the zoo (``tests/zoo.py``) or of ``tests/fuzz_models.py``."""
    maker = fuzz_models.workload if model in fuzz_models.NAMES else zoo.workload
    return maker(model, batch_size=batch_size, seed=seed)


def workloads(setup: Setup) -> Workloads:
    """The model with values, its example batch, and one batch per step call (rows
    shuffled per call; with ``shape="rows"`` one more row per share than the example,
    with ``"uneven"`` one row more than the example (a DataLoader's batch that does not
    divide into the micro-batches or their replicas: the first pieces get a row more), with
    ``"seq"`` the first half of each sequence)."""
    w = build(setup.model, batch_size=setup.batch, seed=setup.seed)
    freeze(setup, w.model)
    dim = fuzz_models.BATCH_DIM.get(setup.model, 0)
    whole = fuzz_models.REPLICATED.get(setup.model, ())
    out = Workloads(w.model, w.inputs, w.targets, w.loss_fn, dim, whole)
    inputs, targets, rows = w.inputs, w.targets, setup.batch
    if setup.shape in ("rows", "uneven"):
        rows = ((setup.rows + 1) * setup.microbatches * setup.dp if setup.shape == "rows"
                else setup.batch + 1)
        other = build(setup.model, batch_size=rows, seed=setup.seed + 10)
        inputs, targets = other.inputs, other.targets
    elif setup.shape == "seq":
        inputs, targets = _half_sequence(inputs), _half_sequence(targets)
    out.rows = rows
    for call in range(STEPS * setup.accumulate):
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(call))
        out.batches.append((_rows(inputs, order, dim, whole), _rows(targets, order, dim)))
    return out


def _half_sequence(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:, : value.shape[1] // 2].contiguous()
    if isinstance(value, dict):
        return {k: _half_sequence(v) for k, v in value.items()}
    return tuple(_half_sequence(v) for v in value)


def _rows(value: Any, order: torch.Tensor, dim: int = 0, whole: tuple[str, ...] = ()) -> Any:
    """``value``'s rows (along ``dim``) in ``order``; a dict's inputs named in ``whole`` as
    they are."""
    if isinstance(value, torch.Tensor):
        return value.index_select(dim, order)
    if isinstance(value, dict):
        return {k: v if k in whole else _rows(v, order, dim) for k, v in value.items()}
    return tuple(_rows(v, order, dim) for v in value)


def share_weight(rows: int, total: int) -> tuple[int, int]:
    """A share of ``rows`` rows of a batch of ``total``: its weight, in lowest terms (the
    batch's mean loss is the sum of the shares' means so weighed)."""
    g = math.gcd(rows, total)
    return rows // g, total // g


def _pieces(value: Any, n: int, dim: int = 0, whole: tuple[str, ...] = ()) -> list[Any]:
    """``value`` cut into ``n`` contiguous parts along ``dim`` as ``torch.tensor_split`` cuts
    it (dicts, tuples alike); a dict's inputs named in ``whole`` go to every part as they
    are."""
    if isinstance(value, torch.Tensor):
        return list(value.tensor_split(n, dim))
    if isinstance(value, dict):
        parts = {k: [v] * n if k in whole else _pieces(v, n, dim) for k, v in value.items()}
        return [{k: parts[k][i] for k in parts} for i in range(n)]
    parts_t = [_pieces(v, n, dim) for v in value]
    return [tuple(p[i] for p in parts_t) for i in range(n)]


def _to(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _to(v, dtype) for k, v in value.items()}
    return tuple(_to(v, dtype) for v in value)
