"""The model zoo: small configurable models with random weights, built as workloads.

``build(name, batch_size=..., seed=..., **config)`` returns a :class:`ZooWorkload`
``(model, inputs, targets, loss_fn)`` for every name in :data:`NAMES`. Builders
are imported on first use so that importing the registry stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from orgel.models.layers import ZooWorkload

# name -> (module under orgel.models, builder function, fixed keyword options)
_REGISTRY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt": ("gpt", "build_gpt", {}),
    "tied": ("gpt", "build_gpt", {"tie_embeddings": True}),
    "vit": ("vit", "build_vit", {}),
    "clip": ("clip", "build_clip", {}),
    "unet": ("unet", "build_unet", {}),
    "resnet": ("resnet", "build_resnet", {}),
    "dlrm": ("dlrm", "build_dlrm", {}),
    "mmt": ("mmt", "build_mmt", {}),
    "graphbreak": ("graphbreak", "build_graphbreak", {}),
}

NAMES: tuple[str, ...] = tuple(_REGISTRY)


def builder(name: str) -> Callable[..., ZooWorkload]:
    """The builder function behind ``name`` (keyword options: batch_size, seed, config)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(NAMES)}")
    module, func, _ = _REGISTRY[name]
    loaded = importlib.import_module(f"orgel.models.{module}")
    fn: Callable[..., ZooWorkload] = getattr(loaded, func)
    return fn


def build(name: str, *, batch_size: int | None = None, seed: int = 0, **config: Any) -> ZooWorkload:
    """Build the workload ``name`` with random weights seeded by ``seed``.

    ``batch_size`` defaults to the builder's own default; ``config`` is passed to
    the builder (e.g. ``d_model=128`` for gpt). Raises ValueError for unknown names.
    """
    fn = builder(name)
    fixed = _REGISTRY[name][2]
    clash = sorted(set(fixed) & set(config))
    if clash:
        raise ValueError(f"model {name!r} fixes {clash}; use 'gpt' to choose them yourself")
    options: dict[str, Any] = {**fixed, **config, "seed": seed}
    if batch_size is not None:
        options["batch_size"] = batch_size
    return fn(**options)


__all__ = ["NAMES", "ZooWorkload", "build", "builder"]
