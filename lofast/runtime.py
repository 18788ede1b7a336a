"""Where and how much a driver runs: the device a name means and how summaries name it, the
batch size a device takes by default (``certification.pipeline.run_certify``,
``training.pipeline.run_train`` and the benchmarks), and the wall-clock and memory limits of
bound computations that may run long or grow large (the CROWN fallback and branch and bound).
The limits turn what would otherwise end or hang the process (the kernel's OOM killer, a bound
that takes an hour) into exceptions that callers report as per-sample results."""

from __future__ import annotations

import contextlib
import platform
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch

from lofast.errors import LofastError


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without one is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LofastError(f"unknown device {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise LofastError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LofastError(f"device {name!r} requested but no CUDA GPU is available")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise LofastError(f"device {name!r} requested but this machine has "
                          f"{torch.cuda.device_count()} CUDA GPUs (cuda:0 ...)")
    return device


def device_name(device: torch.device) -> str:
    """The processor behind a device: the GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown processor"


def describe_device(device: torch.device) -> str:
    """How summaries and record files name the device a run used: the device, its processor
    and, for a CPU, the threads torch uses ("cpu (Intel(R) Xeon(R) ..., 2 threads)",
    "cuda:0 (NVIDIA H100 80GB HBM3)")."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({device_name(device)})"
    threads = torch.get_num_threads()
    return f"{device.type} ({device_name(device)}, {threads} thread{'s' * (threads != 1)})"


# Above this many tokens a CPU batch takes CPU_LARGE_BATCH samples: there the per-sample tensors
# (h n^2 per sample and head) dominate, and a larger batch only adds memory (257 tokens, width
# 128, two threads: 2.9 GB against 1.1 GB at 16, and 9 % slower a sample).
CPU_SMALL_MODEL_TOKENS = 65
CPU_BATCH, CPU_LARGE_BATCH, GPU_BATCH = 64, 16, 1024


def default_batch_size(device: torch.device, tokens: int) -> int:
    """Samples certified together when no batch size is given, for a model of ``tokens``
    tokens: on a GPU 1024, where the width-128 default's whole test set took 7.5 s end to end
    against 10.0 s at 256 (H200); on a CPU 64, where the shipped models certified 20-60 %
    faster per sample than at 16 (256 was slower; two threads), or 16 above
    CPU_SMALL_MODEL_TOKENS tokens (docs/studies/certifier-speed.md)."""
    if device.type == "cuda":
        return GPU_BATCH
    return CPU_BATCH if tokens <= CPU_SMALL_MODEL_TOKENS else CPU_LARGE_BATCH


class TimeLimit(BaseException):
    """Raised by the alarm inside auto_LiRPA. A BaseException, so that the library's
    `except Exception` clauses cannot swallow it."""


@contextlib.contextmanager
def alarm(seconds: float | None) -> Iterator[None]:
    """Interrupt the body with TimeLimit after `seconds` of wall-clock time.

    Uses SIGALRM, so it only works in the main thread on Unix and only when no other interval
    timer is running (pytest-timeout, say); otherwise the body runs to completion and the caller
    compares the elapsed time with the limit afterwards.
    """
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )
    if not usable:
        yield
        return
    armed = [True]

    def on_alarm(signum: int, frame: Any) -> None:
        if armed[0]:  # the body may have finished just before the timer fired
            raise TimeLimit

    previous = signal.signal(signal.SIGALRM, on_alarm)
    # the interrupt can land between a library's torch.set_grad_enabled(False) and its restore:
    # put the grad mode back, or it would leak into everything that runs afterwards
    grad_mode = torch.is_grad_enabled()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_grad_enabled(grad_mode)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an exception reports exhausted memory (CPU or GPU)."""
    full = str(error)
    # The allocator's words can sit deep in the message (TorchScript wraps errors, for one).
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or any(
        text in full for text in ("out of memory", "can't allocate memory"))


def release_cached_memory(device: torch.device) -> None:
    """Hand the blocks PyTorch's caching allocator holds back to the device (after running out
    of memory, before trying again with less); nothing to do on a CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _proc_kib(path: str, field: str) -> int | None:
    """Bytes given by a 'Field:  N kB' line of a Linux /proc file, or None."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int | None:
    """Bytes of memory the kernel can still hand out (Linux MemAvailable), or None."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def address_space() -> int | None:
    """Bytes of virtual address space this process uses now (Linux VmSize), or None."""
    return _proc_kib("/proc/self/status", "VmSize")


@contextlib.contextmanager
def memory_guard(device: torch.device) -> Iterator[None]:
    """Turn running out of CPU memory into an exception instead of a killed process.

    CROWN's memory grows with the model and the batch (alpha-CROWN on paper-d3 takes ~8 GB per
    sample in float32 and ~15 GB in float64), and on Linux the kernel's OOM killer would end
    the whole process before any exception is raised. So the address-space limit is lowered
    to what the process uses now plus 90% of the memory still available; an allocation past
    it fails with an exception that `crown_verify` reports as "out of memory". Applies to the
    whole process while it is active. Does nothing on GPUs (CUDA raises its own error and
    maps far more address space than it uses) or where the limit or /proc are unavailable.
    """
    try:
        import resource
    except ImportError:  # not Unix
        resource = None  # type: ignore[assignment]
    available, used = available_memory(), address_space()
    if device.type != "cpu" or resource is None or available is None or used is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = used + int(0.9 * available)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

