"""Count the host-device synchronisations of a training run: each makes the host wait for the device
and empties the queue of work the host had launched ahead of it.

On CUDA torch reports them (`torch.cuda.set_sync_debug_mode("warn")`); `torch.cuda.synchronize()` calls
are counted too. On the CPU nothing waits, so the calls that would on a GPU are counted: reads of a
tensor's value on the host (`item`, `tolist`, `numpy`, `bool()`, `float()`, `int()`, `index()`), except
the data pipeline's (host tensors, read in loader workers in a real run). That count misses syncs inside
torch's operators (`nonzero`, boolean-mask indexing); the CUDA count has exactly the device's.

    with count_syncs("cuda") as syncs:
        ...
    syncs.total, syncs.sites.most_common(5)
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

# The Python calls that read a tensor's value on the host (and so wait for its device).
_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
_CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


@dataclass
class SyncCount:
    """How many synchronisations were counted, and from where (`file:line function`, outside torch)."""

    total: int = 0
    sites: Counter[str] = field(default_factory=Counter)
    active: bool = True  # SyncsPerStep pauses the count outside training batches

    def add(self, host_data: bool = False) -> None:
        if not self.active:
            return
        stack = traceback.extract_stack()[:-2]
        if host_data and any(_LOADING in f.filename or "/torchdata/" in f.filename for f in stack):
            return  # the data pipeline reads host tensors (in loader workers, in a real run)
        self.total += 1
        self.sites[_caller(stack)] += 1


_LOADING = "/torch/utils/data/"


def _caller(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch and this module: who asked for the value."""
    for frame in reversed(stack):
        if "/torch/" not in frame.filename and not frame.filename.endswith("sync_count.py"):
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"


@contextmanager
def count_syncs(device: str | torch.device = "cuda") -> Iterator[SyncCount]:
    """Count host-device synchronisations inside the block; see the module docstring for what counts."""
    count = SyncCount()
    if torch.device(device).type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            show = warnings.showwarning

            def record(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
                if _CUDA_SYNC_WARNING in str(message):
                    count.add()
                else:
                    show(message, category, *args, **kwargs)

            warnings.showwarning = record
            synchronize = torch.cuda.synchronize  # explicit: not reported by the debug mode

            def counted_synchronize(*args: Any, **kwargs: Any) -> None:
                count.add()
                synchronize(*args, **kwargs)

            torch.cuda.synchronize = counted_synchronize
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield count
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                torch.cuda.synchronize = synchronize
        return
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(original: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            count.add(host_data=True)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class SyncsPerStep(Callback):
    """Counts the host-device synchronisations of the training batches (each batch's hooks, logging and
    the fetch of the next batch; not validation), after `skip_steps` warm-up steps. After the fit:
    `steps`, `count.total`, `count.sites` and `per_step`."""

    def __init__(self, skip_steps: int = 1) -> None:
        self.skip_steps = skip_steps
        self.steps = 0
        self.count = SyncCount(active=False)
        self._counter: Any = None

    @property
    def per_step(self) -> float:
        return self.count.total / max(self.steps, 1)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counter = count_syncs(pl_module.device)
        self.count = self._counter.__enter__()
        self.count.active = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step >= self.skip_steps:
            self.count.active = True
            self.steps += 1

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.count.active = False

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.count.active = False  # the epoch's own logging is not a step's

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._counter is not None:
            self.count.active = False
            self._counter.__exit__(None, None, None)
            self._counter = None
