"""Data-parallel training of fusetrain.Trainer across processes.

Under `torchrun` (or any launcher after which transformers has initialised `torch.distributed`), the engine's
collectives run through `torch.distributed` (gloo on CPUs) on the engine's own buffers: numpy views wrapped by
`torch.from_numpy`, so nothing is copied. Under `mpirun`/`srun`, the engine uses Open MPI directly.
"""

from __future__ import annotations

import os

import numpy as np


class TorchCommunicator:
    """The engine's collectives over the default `torch.distributed` process group. Each method receives numpy
    arrays that view engine memory and works on them in place."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchCommunicator needs torch.distributed initialised (torchrun, or "
                               "transformers.TrainingArguments under a distributed launcher)")
        self._dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.backend = f"torch.distributed ({dist.get_backend()})"

    @staticmethod
    def _tensor(array: np.ndarray):
        import torch

        return torch.from_numpy(array)  # shares the engine's memory

    def all_reduce(self, array: np.ndarray) -> None:
        self._dist.all_reduce(self._tensor(array))

    def broadcast(self, array: np.ndarray, root: int) -> None:
        self._dist.broadcast(self._tensor(array), src=root)

    def reduce_scatter(self, full: np.ndarray, part: np.ndarray, counts: list[int]) -> None:
        # gloo has no reduce-scatter: sum a copy of the whole bucket and keep this rank's part
        summed = full.copy()
        self.all_reduce(summed)
        begin = sum(counts[:self.rank])
        part[:] = summed[begin:begin + counts[self.rank]]

    def all_gather(self, array: np.ndarray, counts: list[int]) -> None:
        import torch

        width = max(counts)
        begin = sum(counts[:self.rank])
        mine = torch.zeros(width, dtype=torch.float32)
        mine[:counts[self.rank]] = self._tensor(array[begin:begin + counts[self.rank]])
        parts = [torch.empty(width, dtype=torch.float32) for _ in counts]
        self._dist.all_gather(parts, mine)
        at = 0
        for rank, count in enumerate(counts):
            array[at:at + count] = parts[rank][:count].numpy()
            at += count

    def send(self, array: np.ndarray, dest: int) -> None:
        self._dist.send(self._tensor(array), dst=dest)

    def recv(self, array: np.ndarray, source: int) -> None:
        self._dist.recv(self._tensor(array), src=source)

    def barrier(self) -> None:
        self._dist.barrier()


def engine_communicator(world_size: int):
    """What the engine trains data-parallel over for a run of `world_size` processes: None for one process, "mpi"
    when an MPI launcher started this process, else a TorchCommunicator (torch.distributed must be initialised)."""
    from fusetrain import _core

    if world_size <= 1:
        return None
    if _core._launched_by_mpi():
        return "mpi"
    return TorchCommunicator()
