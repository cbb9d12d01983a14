"""Shared helpers for vitlab's benchmarks: device sync, timing, peak memory, environment."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import platform
import statistics
import threading
import time
from types import TracebackType
from typing import Any, Callable

import psutil
import torch

MiB = 2**20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device")
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Seconds for `iters` calls of `fn`, the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return time.perf_counter() - start


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def spread(values: list[float]) -> float | None:
    """(max - min) / median: how noisy the repeats were."""
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import timm

        env["timm"] = timm.__version__
    except ImportError:
        env["timm"] = None
    return env


# ---- peak memory ------------------------------------------------------------------------------

_libc: ctypes.CDLL | None = None


def malloc_trim() -> None:
    """Hand freed heap back to the OS so that RSS reflects live memory (glibc only; no-op elsewhere)."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if not name:
            return
        _libc = ctypes.CDLL(name)
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _read_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _read_hwm_bytes() is not None


class PeakMemory:
    """Peak memory increase, in bytes, over the state on entry.

    CUDA: `max_memory_allocated` minus `memory_allocated` on entry (tensors only, not the allocator's
    cache). CPU: process RSS, the kernel's high-water mark (VmHWM) reset on entry via
    /proc/self/clear_refs, minus RSS on entry; where that reset is not allowed, RSS sampled by a
    thread every 0.5 ms instead (which can miss a very short peak). Freed heap is trimmed first so that
    the step cannot silently reuse pages an earlier measurement left resident.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak: int | None = None
        self.method = "cuda_max_memory_allocated" if device.type == "cuda" else "rss_hwm"
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        gc.collect()
        malloc_trim()
        if not _reset_hwm():
            self.method = "rss_sampled"
            self._sampled = self._proc.memory_info().rss
            self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._base = self._proc.memory_info().rss
        if self._sampler is not None:
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled = max(self._sampled, self._proc.memory_info().rss)
            time.sleep(0.0005)

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            top = max(self._sampled, self._proc.memory_info().rss)
        else:
            top = _read_hwm_bytes() or self._proc.memory_info().rss
        self.peak = max(0, top - self._base)


def train_step_seconds(model_args: dict[str, Any], img_size: int, num_classes: int, batch: int, steps: int) -> float:
    """Fastest of `steps` AdamW training steps (forward, backward, update) of a vitlab model built from
    a recipe's `model_args`, on random images; the first step, which allocates, is left out."""
    from vitlab.models import create_model

    model = create_model("vit_tiny_patch16", **{**model_args, "img_size": img_size, "num_classes": num_classes})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, 3, img_size, img_size), torch.randint(0, num_classes, (batch,))
    best = float("inf")
    for i in range(steps + 1):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i:
            best = min(best, time.perf_counter() - start)
    return best
