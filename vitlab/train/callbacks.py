"""Training callbacks: EMA weights and throughput / memory logging."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging
from torch.optim.swa_utils import AveragedModel

try:
    import psutil
except ImportError:  # pragma: no cover - optional: without it the CPU peak memory is not reported
    psutil = None


def batch_images(batch: Any) -> int:
    """Number of images in a batch: `(images, targets)`, a dict holding a tensor, or a bare tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0].shape[0]
    raise TypeError(f"cannot count the images in a batch of type {type(batch).__name__}")


class RateMeter:
    """Images per second over a sliding window of steps.

    Each step's interval runs from the previous step's end, so data loading counts; after a
    `pause()` (validation, epoch end) the clock restarts at the next step's start instead. The very
    first step of a run (compilation, autotuning) is left out. Rates over many steps need no device
    synchronisation: the host can only run a bounded number of steps ahead of the device.
    """

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self.reset()

    def reset(self) -> None:
        self._intervals: deque[tuple[float, int]] = deque(maxlen=self.window)
        self._last: float | None = None
        self._skip_next = True

    def pause(self) -> None:
        self._last = None

    def start(self) -> None:
        """Call at a step's start; only starts the clock when it is paused."""
        if self._last is None:
            self._last = time.perf_counter()

    def update(self, images: int) -> float | None:
        """Record a finished step of `images`; returns the windowed rate, None when there is none yet."""
        now = time.perf_counter()
        last, self._last = self._last, now
        if last is not None:
            if self._skip_next:
                self._skip_next = False
            else:
                self._intervals.append((now - last, images))
        return self.rate()

    def rate(self) -> float | None:
        seconds = sum(dt for dt, _ in self._intervals)
        return sum(n for _, n in self._intervals) / seconds if seconds > 0 else None


class EMA(EMAWeightAveraging):
    """Exponential moving average of the weights, on Lightning's `EMAWeightAveraging`.

    What the base class does (and vitlab relies on): validation runs with the EMA weights swapped
    in; a saved checkpoint's `state_dict` is the EMA one (the raw weights go to
    `current_model_state`, restored on resume), so the exported model is the EMA model; at the
    end of fit the EMA weights are copied into the module.

    vitlab's `ViTClassifier` builds its model in `__init__` (its `configure_model` only compiles),
    so setup copies the module as is instead of calling `configure_model` first.
    """

    def __init__(
        self,
        decay: float = 0.9998,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        device: str | None = None,
        use_buffers: bool = True,
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must lie in (0, 1) (got {decay})")
        super().__init__(
            device=device,
            use_buffers=use_buffers,
            decay=decay,
            update_every_n_steps=update_every_n_steps,
            update_starting_at_step=update_starting_at_step,
            update_starting_at_epoch=update_starting_at_epoch,
        )
        self.decay = decay

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and getattr(pl_module, "builds_model_in_init", False):
            device = self._device or pl_module.device
            self._average_model = AveragedModel(
                model=pl_module, device=device, use_buffers=self._use_buffers, **self._kwargs
            )
            return
        super().setup(trainer, pl_module, stage)

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._latest_update_epoch = state_dict.get("latest_update_epoch", self._latest_update_epoch)


class PerfMonitor(Callback):
    """Logs `train/images_per_sec`, `train/samples_seen`, `perf/epoch_time_s` and `perf/peak_mem_mb`.

    Images are counted per rank and multiplied by the world size (equal batches on every rank).
    Peak memory is CUDA's `max_memory_allocated` on GPU, else the process RSS (sampled every step).
    Epoch time is the wall time of the training epoch, its validation included. When attached,
    `ViTClassifier` leaves images/s to this callback so the metric has one writer.
    """

    def __init__(self, window: int = 20) -> None:
        self.meter = RateMeter(window)
        self.samples_seen = 0
        self._epoch_start = 0.0
        self._peak_rss = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.meter.reset()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._peak_rss = 0
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._epoch_start = time.perf_counter()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.meter.start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        images = batch_images(batch) * trainer.world_size
        self.samples_seen += images
        rate = self.meter.update(images)
        if rate is not None:
            pl_module.log("train/images_per_sec", rate, on_step=True, on_epoch=False)
        # float64 keeps the count exact past float32's 2**24
        pl_module.log(
            "train/samples_seen", torch.tensor(self.samples_seen, dtype=torch.float64), on_step=True, on_epoch=False
        )
        if pl_module.device.type != "cuda" and psutil is not None:
            self._peak_rss = max(self._peak_rss, psutil.Process().memory_info().rss)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.meter.pause()  # validation time is not training time

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.meter.pause()  # nor is the gap to the next epoch (loader restart, checkpointing)
        elapsed = time.perf_counter() - self._epoch_start
        pl_module.log("perf/epoch_time_s", elapsed, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        if pl_module.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(pl_module.device)
        else:
            peak = self._peak_rss or (psutil.Process().memory_info().rss if psutil is not None else 0)
            if not peak:
                return
        pl_module.log(
            "perf/peak_mem_mb", peak / 2**20, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples_seen = int(state_dict.get("samples_seen", 0))
