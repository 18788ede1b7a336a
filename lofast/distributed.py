"""Several processes on one job (torchrun): who am I, and the collective calls lofast needs.

torchrun sets RANK and WORLD_SIZE (and MASTER_ADDR/PORT) for every process; the process group
uses gloo for CPU tensors and Python objects, NCCL where a GPU trains.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lofast.errors import LofastError


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun with more than one process, else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise LofastError("RANK and WORLD_SIZE must be integers (as torchrun sets them)") from None
    if world < 1:
        raise LofastError(f"WORLD_SIZE {world}: a job has at least one process")
    if world == 1:
        return None
    # the rest of torchrun's environment, checked here: torch.distributed's own refusals are
    # tracebacks, and a job of processes that each think they are rank 0 would write clashing
    # files
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        raise LofastError(f"WORLD_SIZE is {world} but {names} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: start the job with "
                          "torchrun, or unset WORLD_SIZE for one process")
    if not 0 <= rank < world:
        raise LofastError(f"RANK {rank} is outside WORLD_SIZE {world}")
    return rank, world


@contextmanager
def process_group(backend: str = "gloo", timeout_hours: float = 24.0) -> Iterator[None]:
    """The default process group for the block (from torchrun's environment). Collectives wait
    up to timeout_hours: a rank that finishes its share early waits for the slowest."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group(backend, timeout=timedelta(hours=timeout_hours))
    try:
        yield
        # Every rank done before any tears its connections down, so that none leaves while
        # another still writes its checkpoint. (The abort that gloo can still cause in Python's
        # finalization is avoided where the process ends: ``cli.main.main``.) A rank that
        # raises skips this, and torchrun stops the others.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gather_on_first(value: Any) -> list[Any] | None:
    """Every rank's value, in rank order, on rank 0 (None on the others); a collective call
    that every rank must make."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered
