"""The transparent API: ``torch.compile(model, backend=orgel.backend(...))`` and its closure runner.

The user's training step stays a closure (Pfeife Listing 1): :mod:`~orgel.transparent.backend`
records the compiled graphs on the first step and runs the closure once per
micro-batch; :mod:`~orgel.transparent.closures` drives a forward of several
graphs through those closures.
"""
