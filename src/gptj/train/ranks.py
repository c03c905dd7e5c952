"""Where a training process stands among the run's ranks: a process group torchrun set up, one gptj
spawned, or none (one process, rank 0 of 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    """This process's place among a run's ranks (one process: rank 0 of 1), its device, and whether
    it started the process group (and so must end it)."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    started_group: bool = False

    @property
    def main(self) -> bool:
        """Rank 0: the one that prepares data, writes files and prints."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for in one process)."""
        if self.world > 1:
            dist.barrier()


def setup_ranks(device: str) -> Ranks:
    """This process's place: a process group torchrun set up (env), one gptj spawned, or none."""
    from gptj.parallel.launch import backend_for, rank_device, under_torchrun
    from gptj.device import resolve_device

    started = False
    if not dist.is_initialized() and under_torchrun():
        dist.init_process_group(backend_for(device))
        started = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = resolve_device(rank_device(device))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return Ranks(dist.get_rank(), dist.get_world_size(), dev, started)
    return Ranks(device=resolve_device(device))
