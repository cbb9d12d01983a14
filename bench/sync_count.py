"""Count the host-device synchronisations of a training run (each makes the host wait for the device).

On CUDA torch reports them (`torch.cuda.set_sync_debug_mode("warn")`), plus explicit
`torch.cuda.synchronize()` calls. On the CPU nothing waits, so the calls that would on a GPU are counted:
host reads of a tensor's value (`item`, `tolist`, `bool()`...), except the data pipeline's. That misses
syncs inside torch's operators (`nonzero`); the CUDA count has exactly the device's.
Used by tests/test_host_sync.py and bench/gpu_check.py (`SyncsPerStep` in a `vitlab fit`).
"""

from __future__ import annotations

import json
import os
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@dataclass
class SyncCount:
    """How many synchronisations were counted, and from where (`file:line function`, outside torch)."""

    total: int = 0
    sites: Counter[str] = field(default_factory=Counter)
    active: bool = True

    def add(self, host_data: bool = False) -> None:
        if not self.active:
            return
        stack = traceback.extract_stack()[:-2]
        if host_data and any("/torch/utils/data/" in f.filename or "/torchdata/" in f.filename for f in stack):
            return  # the data pipeline reads host tensors (in loader workers, in a real run)
        self.total += 1
        outside = [f for f in stack if "/torch/" not in f.filename and not f.filename.endswith("sync_count.py")]
        self.sites[f"{outside[-1].filename}:{outside[-1].lineno} {outside[-1].name}" if outside else "?"] += 1


def _counting(count: SyncCount, original: Any, host_data: bool) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        count.add(host_data)
        return original(*args, **kwargs)

    return call


@contextmanager
def count_syncs(device: str | torch.device = "cuda") -> Iterator[SyncCount]:
    """Count host-device synchronisations inside the block (`syncs.total`, `syncs.sites.most_common(5)`)."""
    count = SyncCount()
    with ExitStack() as stack:
        if torch.device(device).type != "cuda":
            for name in _READS:
                read = _counting(count, getattr(torch.Tensor, name), host_data=True)
                stack.enter_context(mock.patch.object(torch.Tensor, name, read))
            yield count
            return
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("always")
        show = warnings.showwarning

        def record(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "called a synchronizing CUDA operation" in str(message):
                count.add()
            else:
                show(message, category, *args, **kwargs)

        warnings.showwarning = record
        synchronize = _counting(count, torch.cuda.synchronize, host_data=False)  # not reported by the debug mode
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", synchronize))
        stack.callback(torch.cuda.set_sync_debug_mode, torch.cuda.get_sync_debug_mode())
        torch.cuda.set_sync_debug_mode("warn")
        yield count


class SyncsPerStep(Callback):
    """Counts the host-device synchronisations of the training batches (their hooks, logging and the next
    batch's fetch; not validation) of steps [`skip_steps`, `last_step`): `steps`, `count`, `per_step`,
    `step_counts`. With `$VITLAB_SYNC_OUT` set, rank 0 writes {"device", "counts", "where"} there as JSON."""

    def __init__(self, skip_steps: int = 1, last_step: int | None = None) -> None:
        self.skip_steps, self.last_step = skip_steps, last_step
        self.steps = 0
        self.count = SyncCount(active=False)
        self.step_counts: list[int] = []
        self._counter: Any = None

    @property
    def per_step(self) -> float:
        return self.count.total / max(self.steps, 1)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counter = count_syncs(pl_module.device)
        self.count = self._counter.__enter__()
        self.count.active = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step >= self.skip_steps and (self.last_step is None or trainer.global_step < self.last_step):
            self.count.active = True
            self.steps += 1
            self.step_counts.append(self.count.total)
        else:
            self.count.active = False

    def _pause(self, *args: Any) -> None:
        self.count.active = False  # validation and the epoch's own logging are not a step's

    on_validation_start = on_train_epoch_end = _pause

    def _stop(self, *args: Any) -> None:
        self.count.active = False
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    on_exception = _stop

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()
        out = os.environ.get("VITLAB_SYNC_OUT")
        if out and trainer.is_global_zero:
            # each counted step's syncs run from its batch start to the next counted batch start (or the end)
            ends = [*self.step_counts[1:], self.count.total]
            counts = [end - start for start, end in zip(self.step_counts, ends)]
            Path(out).write_text(json.dumps({"device": pl_module.device.type, "counts": counts,
                                             "where": dict(self.count.sites)}))  # fmt: skip
