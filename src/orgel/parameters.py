"""What an optimizer factory receives: a rank's parameters with their names in the model.

``orgel.pipeline``'s ``optimizer`` factory is called on every rank with that rank's
parameters as :class:`NamedParameters` (:mod:`orgel.runtime.optimizer`); the profiler
tries the factory on :func:`probe_parameters` to count its state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

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


class Trains(NamedTuple):
    """What trains as a pipeline was built: each parameter's ``requires_grad`` and each
    module's mode (``training``), by name."""

    grads: dict[str, bool]
    modes: dict[str, bool]


def trainable(model: torch.nn.Module) -> Trains:
    """Which of ``model``'s parameters train, and in which mode each module runs."""
    return Trains({name: p.requires_grad for name, p in model.named_parameters()},
                  {name: m.training for name, m in model.named_modules()})


#: what to do, by front end: build anew (for a changed set or mode), and how evaluation goes
AFTER_CHANGE = {
    "pipeline": ("carry the weights into the model (pipe.copy_to(model)), close this pipeline "
                 "and build a new one from the model as it is now",
                 "pipe.evaluate runs in eval mode by itself, whatever the model's mode"),
    "backend": ("save the state (pipe.save), close the pipeline, and compile the model with a "
                "new orgel.backend that loads it (pipe.load)",
                "after evaluating the compiled model in eval mode, call model.train() before "
                "the next step")}


def check_trainable(model: torch.nn.Module, built: Trains, front: str = "pipeline") -> None:
    """Raise ValueError where the caller froze or unfroze a parameter of ``model``, or
    switched a module between training and eval mode, since a pipeline was built with
    :func:`trainable` ``built``: its ranks train as they were built, where one process
    would train as the model is now. ``front``: the words for ``orgel.pipeline`` or
    ``orgel.backend`` (:data:`AFTER_CHANGE`)."""
    now = trainable(model)
    if now == built:
        return
    rebuild, evaluation = AFTER_CHANGE[front]
    changed = [name for name, was in built.grads.items() if now.grads.get(name) != was]
    if changed:
        raise ValueError(
            f"the model's parameters {changed[:4]}{' ...' if len(changed) > 4 else ''} were "
            "frozen or unfrozen (requires_grad) after the pipeline was built, and its ranks "
            f"train the parameters they were built with: to train the new set, {rebuild}")
    moved = [name or type(model).__name__ for name, was in built.modes.items()
             if now.modes.get(name) != was]
    mode = "training" if built.modes.get("", True) else "eval"
    if mode == "eval":  # from_pretrained's eval mode, then model.train() as people write it
        rebuild = (f"call model.train() before building the pipeline (or {rebuild}); the "
                   "pipeline was built from a model in eval mode, as from_pretrained leaves it")
    raise ValueError(
        f"the model's modules {moved[:4]}{' ...' if len(moved) > 4 else ''} were switched "
        "between training and eval mode (model.train()/model.eval()) after the pipeline was "
        "built, and its ranks train in the mode they were built with, where one process "
        f"would train in the mode set now: set it back (the model was built in {mode} "
        f"mode) before pipe.step ({evaluation}). To train in the new mode, {rebuild}")
