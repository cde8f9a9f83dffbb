"""The loss weight rule: how the losses of the pieces of a batch make the whole batch's loss.

orgel runs a batch as pieces: micro-batch ``m``, and within it each data-parallel
replica's rows (:func:`orgel.batching.split_microbatches`, :func:`orgel.batching.share`).
Each piece's loss is multiplied by its **weight** and the weighted losses are summed;
that sum is the loss whose gradients train the model, the loss ``step`` and
``evaluate`` report, and it equals ``loss_fn`` on the whole batch in one process.

One rule, every caller (the training step, ``evaluate``, every replica; the executor
and the controller's batch check): a piece's weight is its share of the whole batch's
loss-bearing items, ``items(piece) / items(batch)``, counted by one of:

* ``"items"``: the entries of the label tensor that are not ``ignore_index`` (-100):
  a token mean such as ``F.cross_entropy(..., ignore_index=-100)`` on padded batches;
* ``"shifted"``: the same, leaving out each row's first position along the last
  dimension: a causal LM's own loss (Hugging Face's ``outputs.loss`` shifts the labels
  by one, so ``labels[..., 1:]`` are the tokens it averages over);
* ``"rows"``: every row counts one (a mean over rows, or over a fixed number of
  elements per row): every piece weighs ``1 / pieces``;
* ``"sum"``: weight 1 for every piece: the loss is a sum over items;
* a **weighted** mean (``nn.CrossEntropyLoss(weight=w)``: the weighted losses summed and
  divided by the weights of the piece's labels): a function of a piece's ``(inputs,
  targets)`` that returns what the piece's mean divides by (:class:`ClassWeights` for a
  class-weighted loss, found by itself; ``loss_rule=`` for any other, such as per-row
  weights the batch carries). Its name is ``"weighted"``.

The label tensor (:func:`labels_of`) is the first integer tensor of the targets, or,
with no integer targets, a model input named ``labels`` (the model computes its own loss).

Which count a workload's loss uses is decided once, at start-up (:func:`calibrate`):
a trial forward in eval mode of the example batch, with some labels set to
``ignore_index`` so that the pieces hold uneven counts, compares the whole batch's
loss with each rule's combination of the pieces' losses; the rule that reproduces it
wins (a function given as ``loss_rule`` is checked the same way). A loss that none
reproduces raises :class:`LossRuleError`, which says what
the trial saw: orgel does not train to other weights than one process would. A model
whose own outputs depend on how the batch is cut (a branch on a statistic of the batch,
in-batch similarities) cannot equal one process on the whole batch by any weighting;
its rule is the labels' default (:func:`default_rule`), as before. (Labels
of one class per row are not masked: the trial then runs on the example as it is.)

With ``accumulate=k`` each step call is one whole batch, weighted by this rule, and
counts ``1/k`` (:mod:`orgel.runtime.optimizer`): as one process that runs
``(loss_fn(model(batch), targets) / k).backward()`` per call. A micro-batch (or a
replica's share) that holds no loss-bearing item under a mean rule (prompts without an
answer: every label -100) has a loss of 0/0, where in one process its rows add nothing to
the batch's loss and gradients: it weighs 0, and :func:`weigh` makes its loss a zero
whose gradient is zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.batching import TARGETS, BatchDim, WorkloadError, close, dim_of, share
from orgel.launch.errors import NonFiniteLoss
from orgel.nesting import nest

IGNORE_INDEX = -100
#: every rule, in the order :func:`calibrate` prefers them when the trial cannot tell
RULES = ("items", "shifted", "rows", "sum")
#: a weighted mean's rule by name (what process 0 tells the others: each has the function)
WEIGHTED = "weighted"
#: a weight as ``(count, total)``: the piece's loss is multiplied by ``count / total``
#: (integers for the counting rules, in lowest terms; floats for a weighted mean)
Weight = tuple[float, float]
#: a rule: one of :data:`RULES`, or a weighted mean's function of a piece's
#: ``(inputs, targets)`` that returns what its mean divides by
Rule = str | Callable[[dict[str, Any], Any], Any]


class LossRuleError(WorkloadError):
    """The loss is not one orgel can combine over micro-batches exactly; the message says why."""


def labels_of(inputs: dict[str, Any], targets: Any) -> torch.Tensor | None:
    """The tensor whose items the loss counts: the integer tensor of ``targets`` named
    ``label...`` where the targets name theirs, else the first integer tensor of
    ``targets`` not named ``...mask...`` (an attention mask beside a distillation's teacher
    logits is no labels), else the model input ``labels`` when it is an integer tensor;
    None when none is."""
    found = [(pytree.keystr(path).lower(), t)
             for path, t in pytree.tree_flatten_with_path(targets)[0]
             if isinstance(t, torch.Tensor) and t.dim() > 0 and not t.is_floating_point()]
    named = [t for name, t in found if "label" in name]
    plain = [t for name, t in found if "mask" not in name]
    if named or plain:
        return (named or plain)[0]
    labels = inputs.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() > 0 and not labels.is_floating_point():
        return labels
    return None


def label_dim(inputs: dict[str, Any], targets: Any, batch_dim: BatchDim) -> int:
    """The batch dimension of :func:`labels_of`'s tensor."""
    in_targets = any(t is labels_of({}, targets) for t in pytree.tree_leaves(targets))
    return dim_of(batch_dim, TARGETS if in_targets else "labels")


def count(labels: torch.Tensor | None, rule: str, rows: int) -> int:
    """The loss-bearing items of one piece under ``rule`` (``rows``: the piece's rows)."""
    if rule == "rows" or labels is None:
        return rows
    if rule == "shifted":
        labels = labels[..., 1:]
    return int((labels != IGNORE_INDEX).sum())


def loss_weights(rule: str, pieces: list[tuple[torch.Tensor | None, int]],
                 ) -> list[Weight]:
    """Each piece's weight under a counting rule, ``(its items, the batch's items)`` in
    lowest terms: the one rule (:func:`shares`).

    ``pieces`` are ``(labels, rows)`` of every micro-batch and replica share, in order.
    ``"sum"`` weighs every piece 1; the others by its share of the items, which sum to 1;
    a piece with none weighs ``(0, 1)`` (see :func:`weigh`).
    """
    if rule not in RULES:
        raise ValueError(f"loss rule {rule!r} is not one of {RULES}")
    if rule == "sum":
        return [(1, 1)] * len(pieces)
    return shares([count(labels, rule, rows) for labels, rows in pieces])


def shares(counts: list[float]) -> list[Weight]:
    """Each piece's share ``(count, total)`` of what the batch's mean divides by (lowest
    terms for integer counts: an equal share of ``n`` pieces is exactly ``1 / n``)."""
    total = sum(counts)
    if total == 0:  # nothing bears a loss: one process's mean is 0/0 too
        return [(1, len(counts))] * len(counts)
    if all(isinstance(c, int) for c in counts):
        return [(c // math.gcd(int(c), int(total)), total // math.gcd(int(c), int(total)))
                for c in counts]
    return [(c, total) for c in counts]


def piece_weights(rule: Rule, pieces: list[tuple[dict[str, Any], Any, int]]) -> list[Weight]:
    """Each piece's weight, pieces given as ``(inputs, targets, rows)``: the counting rules
    by :func:`loss_weights`, a weighted mean by its function's value on each piece."""
    if isinstance(rule, str):
        return loss_weights(rule, [(labels_of(x, y) if rule in ("items", "shifted") else None,
                                    rows) for x, y, rows in pieces])
    return shares([_weight_value(rule(x, y)) for x, y, _ in pieces])


def _weight_value(value: Any) -> float:
    """A weighted mean's divisor for one piece, as a float (refused unless finite, >= 0)."""
    number = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    if not math.isfinite(number) or number < 0:
        raise LossRuleError(f"loss_rule gave a piece of a batch the weight {number}: it must "
                            "return what the piece's mean divides by (a sum of weights >= 0)")
    return number


class ClassWeights:
    """What a class-weighted mean divides by: ``weight[label]`` summed over a piece's labels
    that are not ``ignore_index`` (``nn.CrossEntropyLoss(weight=w)`` and ``nn.NLLLoss``'s
    mean). Found on such a ``loss_fn`` by itself (:func:`class_weights`)."""

    def __init__(self, weight: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> None:
        self.weight = weight.detach().to("cpu", torch.float64)
        self.ignore_index = ignore_index

    def __call__(self, inputs: dict[str, Any], targets: Any) -> float:
        labels = labels_of(inputs, targets)
        if labels is None:
            raise LossRuleError("a class-weighted loss needs integer labels (targets, or "
                                "the model input 'labels')")
        kept = labels[labels != self.ignore_index].to("cpu", torch.long)
        return float(self.weight[kept].sum())

    def __repr__(self) -> str:
        return f"ClassWeights({self.weight.tolist()}, ignore_index={self.ignore_index})"


def class_weights(loss_fn: Any) -> ClassWeights | None:
    """The rule of a class-weighted ``nn.CrossEntropyLoss``/``nn.NLLLoss`` (mean), else None."""
    if (isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))
            and loss_fn.weight is not None and loss_fn.reduction == "mean"):
        return ClassWeights(loss_fn.weight, loss_fn.ignore_index)
    return None


def rule_name(rule: Rule) -> str:
    """The rule's name: a counting rule's own, ``"weighted"`` for a weighted mean."""
    return rule if isinstance(rule, str) else WEIGHTED


def weigh(loss: torch.Tensor, weight: Weight, read: Any = ()) -> torch.Tensor:
    """``loss`` times its weight ``count / total`` (in lowest terms: an equal share of
    ``n`` pieces is exactly ``loss / n``).

    A piece of weight 0 (no loss-bearing item: its loss is 0/0) gives a zero whose
    gradient to the tensors of ``read`` (what the loss was computed from) is zero, as its
    rows' in one process: not ``0 * loss``, which is NaN, and whose gradient is NaN too
    where the loss's own is 0/0 (a mean written as ``sum / count``)."""
    c, total = weight
    if c == 0:
        grads = [t for t in pytree.tree_leaves(read)
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        if not grads or not torch.is_grad_enabled():
            return torch.zeros((), dtype=loss.dtype, device=loss.device)
        return _Nothing.apply(loss.dtype, *grads)
    return loss if c == total else loss * c / total


class _Nothing(torch.autograd.Function):
    """A zero whose gradient to each input is zeros, whatever their values (a model's own
    loss among them is NaN: ``0 * t`` would be NaN, and so would its gradient)."""

    @staticmethod
    def forward(ctx: Any, dtype: torch.dtype, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.likes = [(t.shape, t.dtype, t.device) for t in tensors]
        return torch.zeros((), dtype=dtype, device=tensors[0].device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (None, *(torch.zeros(shape, dtype=dtype, device=device)
                        for shape, dtype, device in ctx.likes))


def checked_weigh(loss: torch.Tensor, weight: Weight, read: Any, *, check_finite: bool,
                  m: int, where: str) -> torch.Tensor:
    """Micro-batch ``m``'s loss weighed (:func:`weigh`), as every loss stage weighs it; with
    ``check_finite``, :class:`NonFiniteLoss` where the loss is NaN or
    infinite and counts (a piece of weight 0, whose loss is 0/0, adds nothing: it passes).
    ``where`` says where it was computed (``"stage 1"``)."""
    if check_finite and weight[0] != 0 and not bool(torch.isfinite(loss).all()):
        raise NonFiniteLoss(f"the loss of micro-batch {m} is {loss.item()} ({where}): "
                            "check the inputs and the lr")
    return weigh(loss, weight, read)


def batch_weights(rule: Rule, inputs: list[dict[str, Any]], targets: list[Any],
                  replicas: int, batch_dim: BatchDim,
                  replicated: tuple[str, ...] = ()) -> dict[tuple[int, int], Weight]:
    """The weight of every (micro-batch, replica) of a step's batch, cut into ``inputs`` and
    ``targets`` per micro-batch (of any rows: a smaller last batch's differ by one unit),
    each shared by ``replicas`` replicas; ``replicated``: the inputs every micro-batch
    takes whole."""
    from orgel.batching import batch_rows, replica_rows

    pieces, keys = [], []
    for m, (mb, tg) in enumerate(zip(inputs, targets, strict=True)):
        rows = batch_rows(mb, tg, batch_dim, replicated)
        for r in range(replicas):
            mine = {k: v if k in replicated else share(v, r, replicas, dim_of(batch_dim, k),
                                                       rows) for k, v in mb.items()}
            start, stop = replica_rows(rows, r, replicas)
            pieces.append((mine, share(tg, r, replicas, dim_of(batch_dim, TARGETS), rows),
                           stop - start))
            keys.append((m, r))
    return dict(zip(keys, piece_weights(rule, pieces), strict=True))


def default_rule(model: torch.nn.Module, inputs: dict[str, Any], targets: Any) -> str:
    """The rule without a trial (a meta model): a causal LM's own loss ``"shifted"``,
    integer labels ``"items"``, anything else ``"rows"``."""
    labels = labels_of(inputs, targets)
    if labels is None:
        return "rows"
    if labels is inputs.get("labels") and type(model).__name__.endswith("ForCausalLM"):
        return "shifted"
    return "items"


def calibrate(model: torch.nn.Module, inputs: dict[str, Any], targets: Any, loss_fn: Any,
              batch_dim: BatchDim = 0, replicated: tuple[str, ...] = (),
              given: Callable[[dict[str, Any], Any], Any] | None = None) -> Rule:
    """The rule ``loss_fn`` follows, found on a trial forward of the example batch.

    In eval mode and without gradients (the model is left as it was): the batch with
    labels set to ``ignore_index`` unevenly over two (or more) pieces, its whole loss and
    each piece's; the rule whose combination of the pieces' losses equals the whole
    loss (a class-weighted ``loss_fn``'s :class:`ClassWeights` first). ``given``: a
    weighted mean's function, the one rule tried. Raises :class:`LossRuleError` when
    none does.
    """
    from orgel.batching import batch_rows
    from orgel.guard import untouched

    rows = batch_rows(inputs, targets, batch_dim, replicated)
    k = next((d for d in range(2, rows + 1) if rows % d == 0), 1)
    if k == 1:  # one row: never cut, every rule weighs it 1
        return given or default_rule(model, inputs, targets)
    probe = _probe(inputs, targets, k, batch_dim)
    # the parameters scaled up (not written: a functional call) spread the items' losses,
    # so that the pieces' means differ and a wrong rule misses the whole by far
    attempts = [(b, s) for b in ([probe] if probe else []) + [(inputs, targets)]
                for s in (4.0, 1.0)]
    found: tuple[float, list[float], list[Any], bool] | None = None
    with untouched(model), torch.no_grad():
        model.eval()
        for i, ((named, tg), scale) in enumerate(attempts):
            try:
                found = _trial(model, named, tg, loss_fn, k, batch_dim, replicated, scale)
                break
            except Exception:  # noqa: BLE001 - a loss that refuses ignore_index: unmasked
                if i == len(attempts) - 1:
                    raise
    assert found is not None
    whole, parts, pieces, separable = found
    weighted = given or class_weights(loss_fn)
    candidates: list[Rule] = [given] if given else [
        *([weighted] if weighted else []),
        *(r for r in RULES if labels_of(*pieces[0]) is not None or r in ("rows", "sum"))]
    combined = [_combined(rule, parts, [(x, y, rows // k) for x, y in pieces])
                for rule in candidates]
    # the losses carry the model's precision: a bfloat16 model's are rounded to 3 digits
    eps = max((torch.finfo(p.dtype).eps for p in model.parameters() if p.is_floating_point()),
              default=0.0)
    tol = max(1e-4, 4 * eps) * abs(whole) + 1e-6
    matched = [r for r, c in zip(candidates, combined, strict=True) if abs(c - whole) <= tol]
    if not matched and not separable:  # the model's own outputs depend on the cut (a
        # branch or a statistic over the batch): not the loss's doing, and no weighting
        # makes such a model's micro-batches the whole batch; the labels decide the rule
        return given or default_rule(model, inputs, targets)
    if not matched:
        seen = ", ".join(f"{rule_name(r)} gives {c:.6g}"
                         for r, c in zip(candidates, combined, strict=True))
        saw = (f"on a trial forward (eval mode) the whole batch's loss is {whole:.6g} and "
               f"its {k} parts' losses are {[round(p, 6) for p in parts]}")
        if given:
            raise LossRuleError(f"the weights loss_rule gives do not make the loss of the "
                                f"whole batch from its parts: {saw}; weighed by them, the "
                                f"parts give {combined[0]:.6g}. loss_rule must return what "
                                "each part's mean divides by")
        raise LossRuleError(
            f"orgel cannot tell how loss_fn combines over parts of a batch: {saw}; no rule "
            f"reproduces the whole ({seen}). Return a mean over the rows, a mean over the "
            "labels that are not -100, or a sum of per-item losses; for a weighted mean "
            "(F.cross_entropy(..., weight=w)) pass loss_rule=a function of a part's "
            "(inputs, targets) that returns what its mean divides by (orgel.lossweights."
            "ClassWeights(w) for class weights). A loss that depends on how the batch is "
            "cut (in-batch negatives) can be trained with each micro-batch's loss counting "
            "equally: pass orgel.pipeline(..., loss_rule='rows')")
    if weighted in matched:
        return weighted
    default = default_rule(model, inputs, targets)
    return default if default in matched else matched[0]


def _combined(rule: Rule, parts: list[float], pieces: list[tuple[dict[str, Any], Any, int]],
              ) -> float:
    weights = piece_weights(rule, pieces)
    # a piece with no item adds nothing (its own loss is 0/0); any other that is not
    # finite makes the combination so, and the rule misses the whole
    return sum(p * c / t for p, (c, t) in zip(parts, weights, strict=True) if c)


def _trial(model: torch.nn.Module, named: dict[str, Any], targets: Any, loss_fn: Any, k: int,
           batch_dim: BatchDim, replicated: tuple[str, ...],
           scale: float) -> tuple[float, list[float], list[Any], bool]:
    """The whole batch's loss, its ``k`` parts' losses and ``(inputs, targets)``, with the
    floating parameters times ``scale``; and whether the parts' outputs are the rows of
    the whole batch's (the model itself does not depend on how the batch is cut)."""
    from orgel.batching import split_microbatches

    params = {n: p * scale if p.is_floating_point() else p
              for n, p in model.named_parameters()}

    outs: list[Any] = []

    # functional_call leaves a module reached by two paths (one layer reused) holding a
    # plain tensor for its parameter: every module's own parameters are put back after
    held = [(m, dict(m._parameters)) for m in model.modules(remove_duplicate=False)]

    def run(x: dict[str, Any], y: Any) -> float:
        try:
            outs.append(torch.func.functional_call(model, params, (), nest(x)))
        finally:
            for m, own in held:
                m._parameters.update(own)
        return float(loss_fn(outs[-1], y))

    whole = run(named, targets)
    pieces = split_microbatches(named, targets, k, batch_dim, replicated)
    parts = [run(mb, tg) for mb, tg in pieces]
    # a part may be 0/0 (no label in it): the rules weigh it 0 (see _combined)
    if not math.isfinite(whole) or all(not math.isfinite(v) for v in parts):
        raise LossRuleError(f"the trial loss is not finite (whole batch {whole}, parts "
                            f"{parts}): check the model's initial weights and the batch")
    return whole, parts, list(pieces), _separable(outs, k, dim_of(batch_dim, TARGETS))


def _separable(outs: list[Any], k: int, dim: int) -> bool:
    """Whether the ``k`` parts' floating outputs (``outs[1:]``) are the whole's (``outs[0]``)
    rows along ``dim``."""
    leaves = [pytree.tree_leaves(o) for o in outs]
    for j, full in enumerate(leaves[0]):
        if not (isinstance(full, torch.Tensor) and full.is_floating_point()
                and full.dim() > dim and full.shape[dim] % k == 0):
            continue
        pieces = [p[j] for p in leaves[1:] if j < len(p)]
        if len(pieces) != k or any(p.shape[dim] * k != full.shape[dim] for p in pieces):
            continue
        joined = torch.cat(pieces, dim)
        if joined.shape != full.shape or not close(joined, full):
            return False
    return True


def _probe(inputs: dict[str, Any], targets: Any, k: int,
           batch_dim: BatchDim) -> tuple[dict[str, Any], Any] | None:
    """The example batch with labels masked unevenly over its ``k`` parts (None: no labels).

    Part 0 keeps its labels; part ``j`` keeps the first ``j + 1`` positions along the last
    dimension. Where a part is left with no label after the first position, every
    ``ignore_index`` of the example is first set to one of its labels. Labels of one per
    row (class indices) are not padded: None, and the trial runs on the batch as it is
    (their rules agree on batches without -100).
    """
    labels = labels_of(inputs, targets)
    if labels is None:
        return None
    dim = label_dim(inputs, targets, batch_dim)
    if labels.dim() < 2 or dim == labels.dim() - 1:  # a label per row: no padding to probe
        return None
    valid = labels[labels != IGNORE_INDEX]
    if valid.numel() == 0:  # nothing bears a loss: the trial on the batch says so
        return None
    size = labels.shape[dim] // k

    def patterned(masked: torch.Tensor) -> torch.Tensor:
        for j in range(1, k):
            masked.narrow(dim, j * size, size)[..., 1 + j:] = IGNORE_INDEX
        return masked

    masked = patterned(labels.clone())
    if any(count(masked.narrow(dim, j * size, size), "shifted", size) == 0 for j in range(k)):
        # a part the example pads whole (prompts without an answer) tells no rule from
        # another: every position a label (one the batch holds) first
        masked = patterned(labels.masked_fill(labels == IGNORE_INDEX, int(valid[0])))
    if any(t is labels for t in pytree.tree_leaves(targets)):
        leaves, spec = pytree.tree_flatten(targets)
        return inputs, pytree.tree_unflatten([masked if t is labels else t for t in leaves],
                                             spec)
    return {**inputs, "labels": masked}, targets


def check_rule(rule: Any) -> None:
    """Raise ValueError unless ``rule`` is ``"auto"``, one of :data:`RULES`, ``"weighted"``
    or a function (a weighted mean's)."""
    if rule != "auto" and rule not in RULES and rule != WEIGHTED and not callable(rule):
        raise ValueError(f"loss_rule must be 'auto', one of {list(RULES)}, 'weighted' or a "
                         f"function of a part's (inputs, targets), got {rule!r}")


def rule_for(workload: Any, given: Rule = "auto") -> Rule:
    """The rule of an :class:`orgel.workload.Workload`'s loss: ``given`` (or the
    ``loss_rule`` attribute of its ``loss_fn``) unless "auto"; else :func:`calibrate` on
    its example batch, or :func:`default_rule` for a meta model (no values to try). A
    function is checked on the trial too; ``"weighted"`` (a weighted mean's name, as
    process 0 tells it) is this process's own function: the ``loss_fn``'s attribute, or
    its class weights."""
    from orgel.workload import named_inputs, on_meta

    check_rule(given)
    own = getattr(workload.loss_fn, "loss_rule", "auto")
    if given == "auto":
        check_rule(own)
        given = own
    if given == WEIGHTED:
        found = own if callable(own) else class_weights(workload.loss_fn)
        if found is None:
            raise LossRuleError("loss_rule 'weighted' needs the weights: a class-weighted "
                                "nn.CrossEntropyLoss or nn.NLLLoss as loss_fn, or a function "
                                "as loss_rule (or as loss_fn.loss_rule)")
        return found
    if isinstance(given, str) and given != "auto":
        return given
    named = named_inputs(workload.model, workload.inputs)
    function = given if callable(given) else None
    if on_meta(workload.model):
        return function or default_rule(workload.model, named, workload.targets)
    return calibrate(workload.model, named, workload.targets, workload.loss_fn,
                     workload.batch_dim, workload.replicated, function)
