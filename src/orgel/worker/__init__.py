"""The rank workers both APIs share, and the handle that drives them.

:mod:`~orgel.worker.engine` is one rank's side (its executor, parameters by
original name, checkpoint shard); :mod:`~orgel.worker.closure` a rank fed by
closures; :mod:`~orgel.launch.processes` forks local workers and talks to them
over pipes; :mod:`~orgel.worker.pipe` is the :class:`Pipeline` a user steps.
"""
