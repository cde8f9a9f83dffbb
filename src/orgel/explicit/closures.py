"""``orgel.backend``'s compiled model with graph breaks: the closures run the Python between
its graphs (:class:`ClosurePipeline`), as the controller of :mod:`orgel.explicit.glued` does
for ``orgel.pipeline``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from orgel.batching import batch_placeholders
from orgel.explicit.glued import GluedPipeline
from orgel.explicit.slots import Slot
from orgel.graph.dynamo import dynamo_settings


def closure_tensors(args: list[Any]) -> dict[str, torch.Tensor]:
    """A closure's tensor arguments by the names the joined graphs of a forward with graph
    breaks give them (``arg<i>``, ``i`` the position), whose sizes those graphs read
    (:func:`orgel.graph.glue_sizes.size_roles`)."""
    return {f"arg{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}


class UntrainedWarning(UserWarning):
    """Gradients ``orgel.backend`` cannot apply: the Python between the compiled model's
    graphs also uses parameters that a graph reads (see :class:`ClosurePipeline`)."""


class ClosurePipeline(GluedPipeline):
    """The graphs of ``orgel.backend``'s compiled model, when it has graph breaks.

    The closures of :meth:`orgel.transparent.backend.Backend.step` replace ``model`` and
    ``loss_fn``: each runs in its own thread, calls the compiled model (whose
    graphs reach :meth:`_call` through the backend) and runs its own backward.
    A graph call the closure's loss does not reach gets zero gradients.
    """

    fallback = False  # the closure is the user's: it cannot run again in the controller

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._warm = True  # orgel.backend ran micro-batch 0's forward to find the graphs
        # the closures run the caller's module: the parameters its Python between graphs
        # uses (Glue.eager) are the caller's own. Each micro-batch's gradient of them is
        # kept as its backward reaches them (a hook, in the closure's thread), summed in
        # micro-batch order and stepped by their home rank, whose new values come back here
        self._eager = {name: self._model.get_parameter(name) for name in self.glue.eager}
        self._hooks = [p.register_hook(self._keeper(name)) for name, p in self._eager.items()]
        # the rest get no gradient here: the ranks compute theirs (see _check_stray)
        self._remote = [(n, p) for n, p in self._model.named_parameters()
                        if p.requires_grad and n not in self._eager]
        self._warned = False

    def _keeper(self, name: str) -> Callable[[torch.Tensor], None]:
        def keep(grad: torch.Tensor) -> None:
            slot = getattr(self._local, "slot", None)
            if slot is not None:  # a backward of the user's own, outside a step: not ours
                grad = grad.detach() / self.accumulate  # each call counts 1/accumulate
                got = slot.grads.get(name)
                slot.grads[name] = grad.clone() if got is None else got + grad
        return keep

    def _back(self, slot: Any, c: int, grads: list[Any], count: int) -> list[Any]:
        """Graph ``c``'s backward on the ranks, with ``accumulate`` > 1: the closure's own
        backward gives the step call's whole gradient, so each call counts ``1/accumulate``
        in what reaches the ranks; the gradients that come back into the closure's backward
        (of the graph's arguments) are its own again."""
        if self.scale is not None and not slot.scaled and any(g is not None for g in grads):
            from orgel.precision import UNSCALED_BACKWARD

            raise RuntimeError(UNSCALED_BACKWARD)
        k = self.accumulate
        if k == 1:
            return super()._back(slot, c, grads, count)
        got = super()._back(slot, c, [None if g is None else g / k for g in grads], count)
        return [None if g is None else g * k for g in got]

    def step_closures(self, closure: Callable[..., Any], pieces: list[list[Any]],
                      rows: int) -> list[Any]:
        """Run ``closure(*pieces[m])`` for every micro-batch ``m``; their return values."""
        def work(slot: Slot) -> None:
            slot.anchor = torch.zeros((), requires_grad=True)
            slot.sizes = sizes[slot.index]
            # where the graphs were found with symbolic sizes, Dynamo compiles any frame the
            # closure recompiles as it did then (Glue.settings; Dynamo's settings are per thread)
            with dynamo_settings(), self.glue.settings():
                slot.result = closure(*pieces[slot.index])
            self._check_calls(slot)
            self._back_unreached(slot, after=-1)  # no backward, or one that missed some

        # the closures' arguments, which the sizes the graphs took symbolic are read off
        # (orgel.transparent.start.closure_inputs): their shapes, and the ranks' stand-ins
        # (all of them: a step of other shapes exchanges its messages' shapes anew)
        named = [closure_tensors(args) for args in pieces]
        sizes = [{n: tuple(t.shape) for n, t in one.items()} for one in named]
        stand_ins = batch_placeholders(named[0], self.pieces, self.batch_dim, self.replicated)
        try:
            results = [s.result for s in self._run_threads(work, stand_ins, rows)]
        finally:  # (a dropped step too)
            for p in self._eager.values():  # summed from the hooks and stepped on a rank
                p.grad = None
        self._check_stray()
        return results

    def _check_stray(self) -> None:
        """Warn once where a parameter a graph reads got a gradient here: the Python between
        graphs used it too (a tied embedding looked up outside the graphs), and that part
        of its gradient reaches no rank."""
        stray = [n for n, p in self._remote if p.grad is not None]
        if stray and not self._warned:
            self._warned = True
            warnings.warn(UntrainedWarning(
                f"orgel.backend does not apply the gradients that the Python between the "
                f"compiled model's graphs gives {stray[:4]}{' and more' if len(stray) > 4 else ''}"
                ": a graph reads them too, and the ranks step them with the graphs' gradients "
                "alone (their .grad here holds the rest). Remove the graph break, or use "
                "orgel.pipeline"), stacklevel=3)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        super().close()
