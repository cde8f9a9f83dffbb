"""The transparent API: ``torch.compile(model, backend=orgel.backend(...))`` and its closure runner.

The user's training step stays a closure (Pfeife Listing 1): :mod:`~orgel.transparent.backend`
records the compiled graphs on the first step, joins them (one, or several where the
model has graph breaks) and runs the closure once per micro-batch through
:class:`orgel.explicit.closures.ClosurePipeline`.
"""
