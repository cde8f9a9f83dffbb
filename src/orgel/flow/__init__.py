"""The one flow every front end runs: options, prepare, start.

:mod:`~orgel.flow.options` holds every option of ``orgel.pipeline``, ``orgel.load`` and
``orgel.backend`` and the one table of what is refused; :mod:`~orgel.flow.prepare`
captures, plans and splits (:func:`~orgel.flow.prepare.prepare`); :mod:`~orgel.flow.start`
starts the ranks, forked from this process or as a rank of a torchrun job.
"""
