"""The cost model the planners and the simulator share: per-block costs summed into stages.

:mod:`orgel.costs.table` holds the table of measured block costs
(:class:`~orgel.costs.table.BlockCosts`, which the profiler fills; the costs
file's fields are checked in :mod:`orgel.costs.fields`), :mod:`orgel.costs.blocks`
the one function that sums blocks into a stage (:func:`~orgel.costs.blocks.stage_cost`)
and the stage DAG of a split; :mod:`orgel.costs.tied` counts parameters that
several blocks share.
"""
