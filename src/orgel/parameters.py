"""What an optimizer factory receives: a rank's parameters with their names in the model.

``orgel.pipeline``'s ``optimizer`` factory is called on every rank with that rank's
parameters as :class:`NamedParameters` (:mod:`orgel.runtime.optimizer`); the profiler
tries the factory on :func:`probe_parameters` to count its state.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class NamedParameters(list[torch.nn.Parameter]):
    """A list of Parameters that also knows each one's name in the original model.

    What an optimizer factory receives: use it as a list, or group by
    :attr:`names` / :meth:`named` as one would group ``model.named_parameters()``.
    """

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]] = ()) -> None:
        pairs = list(named)
        super().__init__(p for _, p in pairs)
        #: each parameter's original name, in the list's order
        self.names: list[str] = [n for n, _ in pairs]

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(original name, parameter)`` pairs, like ``model.named_parameters()``."""
        return list(zip(self.names, self, strict=True))


def probe_parameters() -> NamedParameters:
    """Two small parameters (a matrix ``weight``, a vector ``bias``) to try a factory on.

    Their values draw nothing from torch's random generator: trying the caller's
    factories leaves the caller's random stream as it was.
    """
    return NamedParameters([
        ("weight", torch.nn.Parameter(torch.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64))),
        ("bias", torch.nn.Parameter(torch.linspace(-1.0, 1.0, 64)))])


def trainable(model: torch.nn.Module) -> dict[str, bool]:
    """Each of ``model``'s parameters' ``requires_grad``, by name."""
    return {name: p.requires_grad for name, p in model.named_parameters()}


def check_trainable(model: torch.nn.Module, built: dict[str, bool]) -> None:
    """Raise ValueError where the caller froze or unfroze a parameter of ``model`` since a
    pipeline was built with :func:`trainable` ``built``: its ranks train the set they were
    built with, where one process would train the new one."""
    now = trainable(model)
    if now == built:
        return
    changed = [name for name, was in built.items() if now.get(name) != was]
    raise ValueError(
        f"the model's parameters {changed[:4]}{' ...' if len(changed) > 4 else ''} were "
        "frozen or unfrozen (requires_grad) after the pipeline was built, and its ranks "
        "train the parameters they were built with: to train the new set, carry the "
        "weights into the model (pipe.copy_to(model)), close this pipeline and build a "
        "new one from the model as it is now")
