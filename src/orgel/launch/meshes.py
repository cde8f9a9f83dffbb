"""What keeps a process group alive after it was destroyed: DTensor's device meshes.

:func:`forget_meshes` is called by :func:`orgel.launch.processes.leave_group`.
"""

from __future__ import annotations

import sys

import torch


def forget_meshes() -> None:
    """Empty DTensor's caches that keep every device mesh alive, and with each mesh the
    process groups it names (``DeviceMesh._pg_registry``) and their gloo threads.

    FSDP2 and tensor parallelism make a mesh per replica set; torch caches redistribution
    planners (keyed by a weak reference to the mesh, but holding the mesh itself), mesh
    topologies and sharding decisions (keyed by specs that hold the mesh) for the life of
    the process. Left so, a script that sharded a stage kept a group's threads past
    :func:`orgel.launch.processes.leave_group` (found 2026-12-05: ``shard="fsdp"`` under
    torchrun, then the check that nothing of gloo's is left). Only caches: DTensor fills
    them again when used.
    """
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is None:  # DTensor never ran here
        return
    collectives = sys.modules.get("torch.distributed.tensor._collective_utils")
    topology = getattr(getattr(collectives, "MeshTopoInfo", None), "build_from_mesh", None)
    for clear in (getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
                  getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear",
                          None),
                  getattr(getattr(redistribute, "_planner_cache", None), "clear", None),
                  getattr(topology, "cache_clear", None)):
        if clear is not None:
            clear()
