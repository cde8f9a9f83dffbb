"""The explicit API: ``orgel.pipeline(model, inputs, targets, loss_fn)``, ``orgel.load``, the demo.

:mod:`~orgel.explicit.api` captures, plans and splits a workload and starts its
ranks; :mod:`~orgel.explicit.glued` trains a forward Dynamo captures as several
graphs (the Python between them runs in the controller).
"""
