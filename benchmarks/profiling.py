"""(helper) torch.profiler's table of the operators that took the most time of their own, for
the benchmarks that print where their time goes."""

from __future__ import annotations

from collections.abc import Callable

import torch


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
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages(group_by_input_shape=shapes).table(
        sort_by=sort, row_limit=rows, max_name_column_width=40, max_shapes_column_width=70)
    return table, sort
