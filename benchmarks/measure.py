"""(helper) How the benchmarks measure: wall-clock seconds with the device synchronised, and
torch.profiler's table of the operators that took the most time of their own; where they write
their figures (``output_file``) and the counts they take (``positive_int``); the operators
that launch work (``LaunchCounter``), which predict an accelerator's time where the host
launches every kernel."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def output_file(value: str) -> str:
    """argparse type of an --out file: its folder is made (with parents) and must be writable,
    so that a run of minutes cannot end in a traceback instead of its figures."""
    folder = os.path.dirname(os.path.abspath(value))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot make the folder of {value}: {error.strerror}")
    if os.path.isdir(value) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {value}")
    return value


def positive_int(value: str) -> int:
    """argparse type of a count that must be at least 1."""
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value[:40]!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {count}")
    return count


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], Any], device: torch.device, repeats: int = 1) -> tuple[Any, float]:
    """The result of the last of ``repeats`` calls of run() and their mean wall-clock seconds,
    the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        out = run()
    sync(device)
    return out, (time.perf_counter() - start) / repeats


def profile_table(device: torch.device, run: Callable[[], object], repeats: int = 1,
                  rows: int = 40, shapes: bool = False) -> tuple[str, str]:
    """Runs ``run`` ``repeats`` times under torch.profiler and returns the table of the ``rows``
    operators with the most self time (device time on a GPU, else CPU time), grouped by input
    shape with ``shapes``, and the column it is sorted by."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=shapes) as profiler:
        for _ in range(repeats):
            run()
        sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages(group_by_input_shape=shapes).table(
        sort_by=sort, row_limit=rows, max_name_column_width=40, max_shapes_column_width=70)
    return table, sort


# Operators that only relabel memory (is_view covers the rest of the views).
METADATA_ONLY = {"_unsafe_view", "_reshape_alias", "alias", "detach", "lift_fresh"}


class LaunchCounter(TorchDispatchMode):
    """Counts the operators dispatched inside it that do work (not views)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in METADATA_ONLY:
            self.count += 1
        return func(*args, **(kwargs or {}))
