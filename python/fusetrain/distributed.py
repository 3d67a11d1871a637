"""Data-parallel training of fusetrain.Trainer across processes.

Under `torchrun` (or any launcher after which transformers has initialised `torch.distributed`), the engine's
collectives run through `torch.distributed` (gloo on CPUs) on the engine's own buffers: numpy views wrapped by
`torch.from_numpy`, so nothing is copied. Under `mpirun`/`srun`, the engine uses Open MPI directly.

`join_process_group` is how fusetrain.TrainingArguments joins the CPU processes' group (before transformers would,
through accelerate, with no limit on the wait): a peer that never connects is an error naming the launcher's
variables after a timeout, not a hang.
"""

from __future__ import annotations

import atexit
import os
import re
from datetime import timedelta

import numpy as np

# The environment variable that sets fusetrain.TrainingArguments' default fusetrain_rendezvous_timeout (seconds).
RENDEZVOUS_TIMEOUT_VARIABLE = "FUSETRAIN_RENDEZVOUS_TIMEOUT"
# accelerate's MASTER_PORT for a CPU launch that sets none.
_DEFAULT_MASTER_PORT = "29500"


def join_process_group(backend: str, rendezvous_timeout: float, group_timeout: float) -> None:
    """Initialises torch.distributed's default process group from a launcher's variables (WORLD_SIZE, RANK,
    MASTER_ADDR, MASTER_PORT, as torchrun sets them), as torch's env:// initialisation does, but waits at most
    `rendezvous_timeout` seconds for every process to connect to MASTER_ADDR:MASTER_PORT; the group's collectives
    then time out after `group_timeout` seconds (transformers' ddp_timeout). Raises RuntimeError naming the
    variables, and what was expected, when the processes do not all connect in time."""
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    world_size = int(os.environ["WORLD_SIZE"])
    rank_text, address = os.environ.get("RANK"), os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT") or _DEFAULT_MASTER_PORT
    launch = (f"WORLD_SIZE={world_size} makes this process one of {world_size} (RANK={rank_text or 'unset'}, "
              f"MASTER_ADDR={address or 'unset'}, MASTER_PORT={port})")
    single = "or WORLD_SIZE unset to train in one process"
    if rank_text is None or not rank_text.isdigit() or int(rank_text) >= world_size:
        raise RuntimeError(f"fusetrain: {launch}, but RANK is {'not set' if rank_text is None else repr(rank_text)}; "
                           f"expected this process's index, an integer in [0, {world_size}), as torchrun sets it, "
                           f"{single}")
    if not address:
        raise RuntimeError(f"fusetrain: {launch}, but MASTER_ADDR is not set; expected the address of rank 0's host, "
                           f"as torchrun sets it, {single}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RuntimeError(f"fusetrain: {launch}, but MASTER_PORT is {port!r}; expected a port number in [1, 65535], "
                           f"{single}")
    rank = int(rank_text)
    os.environ["MASTER_PORT"] = port  # env:// reads it; accelerate sets the same default
    try:
        store, rank, world_size = next(rendezvous("env://", rank, world_size,
                                                  timeout=timedelta(seconds=rendezvous_timeout)))
    except dist.DistError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        joined = re.search(r"(\d+)/\d+ clients joined", reason)
        if rank == 0 and isinstance(error, dist.DistStoreError):
            found = (f"{f'only {joined[1]}' if joined else 'not all'} of the {world_size} processes connected to it "
                     f"within {rendezvous_timeout:g} s")
        elif rank != 0 and "timed out" in reason.lower():
            found = f"this process could not reach rank 0 there within {rendezvous_timeout:g} s"
        else:
            found = f"the rendezvous at MASTER_ADDR:MASTER_PORT failed: {reason}"
        raise RuntimeError(f"fusetrain: {launch}, but {found}; expected all {world_size} processes started with the "
                           f"same WORLD_SIZE, MASTER_ADDR and MASTER_PORT and distinct RANKs (torchrun sets them), "
                           f"{single}. fusetrain_rendezvous_timeout (or ${RENDEZVOUS_TIMEOUT_VARIABLE}) sets the "
                           "wait") from None
    store.set_timeout(timedelta(seconds=group_timeout))
    # The store and prefix torch's own env:// initialisation uses, so that peers initialised by it join this group.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=group_timeout))
    # The group this process created is torn down before the interpreter's own teardown: left to it, gloo's threads
    # can be destroyed still running once a peer has gone, and the process then aborts at exit.
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
