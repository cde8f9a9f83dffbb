"""``orgel.backend`` under torchrun: process 0 runs the closures, every process a rank.

Every process of the job runs the user's script, so each compiles the model and calls
``pipe.step(closure, *batch)``. Process 0's step is the one trained (its batch, its
closures), as for ``orgel.pipeline`` with graph breaks under torchrun
(:mod:`orgel.explicit.glued_job`): its rank's engine answers in a thread beside the
closures, and every other process *follows*, serving process 0's commands on its own rank
until process 0's call of the same method ends. On the first step every process finds
the graphs itself (micro-batch 0's closure up to its backward, as in local-spawn mode);
the plan is process 0's (:func:`orgel.flow.prepare.on_process_zero`), and process 0's
closures run the Python around and between the graphs
(:func:`orgel.explicit.glued_job.start_job` with ``closures=True``).
"""

from __future__ import annotations

import os

from orgel.launch.processes import init_from_env, under_torchrun


def follows() -> bool:
    """Whether this process follows process 0's steps (a torchrun process other than 0)."""
    return under_torchrun() and int(os.environ.get("RANK", "0")) != 0


def check_world(ranks: int) -> None:
    """Under torchrun, ``ranks`` must be the job's process count (else ValueError)."""
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != ranks:
        raise ValueError(f"orgel.backend(ranks={ranks}) but torchrun started WORLD_SIZE="
                         f"{os.environ['WORLD_SIZE']} processes: pass ranks="
                         f"{os.environ['WORLD_SIZE']} or run torchrun --nproc-per-node {ranks}")


def join(timeout_s: float) -> None:
    """Under torchrun, make sure this process is in the job's process group."""
    import torch.distributed as dist

    if under_torchrun() and not dist.is_initialized():
        init_from_env(timeout=timeout_s, device="cpu")
