"""Under torchrun this process is one rank: a pipeline's calls run here and are gathered."""

from __future__ import annotations

import gc
from typing import Any

from orgel.launch.errors import WorkerError
from orgel.worker.engine import RankEngine


class OwnRank:
    """SPMD: this process is one rank; ``call`` runs locally and all-gathers the results."""

    def __init__(self, engine: RankEngine, num_ranks: int, *, owns_group: bool) -> None:
        self._engine: RankEngine | None = engine
        self.num_ranks = num_ranks
        self.owns_group = owns_group

    @property
    def engine(self) -> RankEngine:
        """This rank's engine; WorkerError once the pipeline is closed (as in local spawn)."""
        if self._engine is None:
            raise WorkerError("the pipeline is closed; create a new pipeline", -1)
        return self._engine

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import torch.distributed as dist

        result = getattr(self.engine, method)(*args, **kwargs)
        gathered: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(gathered, result)
        return gathered

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every process, by global rank."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered

    def close(self) -> None:
        """Leave together and let go of this rank's stages, optimizer and messages (as a
        local rank's end frees them); the process group stays (see below)."""
        import torch.distributed as dist

        if self._engine is None:
            return
        # the group orgel made stays for the next pipeline in these processes and is
        # destroyed at exit (orgel.launch.processes.leave_group); the ranks leave together
        if self.owns_group and dist.is_initialized():
            dist.barrier()
        self._engine = None
        gc.collect()  # its objects refer to each other: freed now, not at some later collection
