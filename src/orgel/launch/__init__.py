"""Process start and lifetime: local ranks, torchrun, failures, and which device a rank uses.

* :mod:`.processes`: :class:`LocalGroup` starts local ranks and drives them,
  :func:`spawn` runs one function on fresh ones, :func:`init_from_env` joins torchrun;
* :mod:`.devices`: the device rule (which device a rank, the profiler, a stage uses);
* :mod:`.lifeline`: a rank ends when the process that started it does;
* :mod:`.errors`: the failures of a distributed step and how they are reported.

Below the runtime, the profiler and the planners, which all start processes.
"""
