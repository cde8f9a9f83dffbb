"""The pipeline's state under the model's own names: which keys, where each is held, checks.

One rule for "the original names of the state": :class:`StateNames` lists
``model.state_dict()``'s keys in order (tied aliases included; non-persistent
buffers and the constants capture lifts into the stages are no keys) and maps
each key to the name the ranks hold its tensor under (a tied tensor's first
name in the model, :func:`canonical_names`). ``Pipeline.state_dict``,
``load_state_dict``, ``copy_to``, ``save`` and the checkpoint export all read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.modules.module import _IncompatibleKeys


def canonical_names(model: torch.nn.Module) -> dict[int, str]:
    """By id, each parameter's and buffer's first name in ``model`` (a tied one's canonical)."""
    canonical: dict[int, str] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        canonical.setdefault(id(t), name)
    return canonical


def model_aliases(model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """The model's state_dict keys and, for tied tensors, key -> the canonical name."""
    canonical = canonical_names(model)
    keys: list[str] = []
    aliases: dict[str, str] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        keys.append(key)
        name = canonical.get(id(t), key)
        if name != key:
            aliases[key] = name
    return keys, aliases


class StateNames:
    """``model.state_dict()``'s keys in order, and the name the ranks hold each under."""

    def __init__(self, keys: Sequence[str], aliases: Mapping[str, str]) -> None:
        self.keys = list(keys)
        self.aliases = dict(aliases)

    def held(self, key: str) -> str:
        """The name the ranks (and checkpoints) hold ``key``'s tensor under."""
        return self.aliases.get(key, key)

    def held_names(self) -> list[str]:
        """Every held name once, in the model's order."""
        return list(dict.fromkeys(self.held(k) for k in self.keys))

    def in_model_order(self, by_name: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``model.state_dict()``'s keys (those ``by_name`` holds) from held names, in order.

        Names that are no key of the model (a non-persistent buffer, a lifted
        constant) are left out.
        """
        return {k: by_name[self.held(k)] for k in self.keys if self.held(k) in by_name}

    def check(self, state: Mapping[str, Any], shapes: Mapping[str, torch.Size], *,
              strict: bool, owner: str = "the pipeline") -> _IncompatibleKeys:
        """torch's ``load_state_dict`` verdict on ``state``: raise or ``(missing, unexpected)``.

        ``shapes``: each key's shape in the model. With ``strict``, missing and
        unexpected keys raise; a shape that differs always raises (as in torch).
        Raises RuntimeError in torch's words, listing the keys.
        """
        known = set(self.keys)
        missing = [k for k in self.keys if k not in state]
        unexpected = [k for k in state if k not in known]
        errors: list[str] = []
        if strict and unexpected:
            errors.append("Unexpected key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in unexpected) + ". ")
        if strict and missing:
            errors.append("Missing key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in missing) + ". ")
        for key in self.keys:
            value = state.get(key)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                errors.append(f'While copying the parameter named "{key}", expected a tensor '
                              f"but got {type(value).__name__}.")
            elif tuple(value.shape) != tuple(shapes[key]):
                errors.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(value.shape)} from checkpoint, the shape in current "
                              f"model is {tuple(shapes[key])}.")
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {owner}:\n\t"
                               + "\n\t".join(errors) + "\nNo rank's state changed; the "
                               "pipeline is as it was")
        return _IncompatibleKeys(missing, unexpected)

    def to_held(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model keys of ``state`` by held name (a tied tensor from its first key given)."""
        out: dict[str, torch.Tensor] = {}
        for key in self.keys:
            if key in state:
                out.setdefault(self.held(key), state[key])
        return out


def own_stage_copies(modules: Iterable[torch.nn.Module]) -> None:
    """Give ``modules`` their own copies of every parameter and buffer, in place.

    Under torchrun each rank splits the caller's model, and the stage modules
    would otherwise share its tensors: training would change the caller's model
    on each rank, for that rank's stages only. One object stays one object (a
    tied parameter two of these stages hold stays shared between them).
    """
    copies: dict[int, torch.Tensor] = {}
    made: set[int] = set()  # the copies themselves: a module met twice keeps them
    for module in modules:
        for sub in module.modules():
            params: dict[str, Any] = sub._parameters
            for key, p in params.items():
                if p is not None and not p.is_meta and id(p) not in made:
                    if id(p) not in copies:
                        copies[id(p)] = torch.nn.Parameter(p.detach().clone(),
                                                           requires_grad=p.requires_grad)
                        made.add(id(copies[id(p)]))
                    params[key] = copies[id(p)]
            buffers: dict[str, Any] = sub._buffers
            for key, b in buffers.items():
                if b is not None and not b.is_meta and id(b) not in made:
                    if id(b) not in copies:
                        copies[id(b)] = b.detach().clone()
                        made.add(id(copies[id(b)]))
                    buffers[key] = copies[id(b)]
