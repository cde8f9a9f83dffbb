"""The cost model the planners and the simulator share: per-block costs summed into stages.

:mod:`orgel.costs.blocks` holds the table of measured block costs
(:class:`~orgel.costs.blocks.BlockCosts`, which the profiler fills) and the one
function that sums blocks into a stage (:func:`~orgel.costs.blocks.stage_cost`);
:mod:`orgel.costs.tied` counts parameters that several blocks share.
"""
