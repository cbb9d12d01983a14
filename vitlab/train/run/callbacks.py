"""Training callbacks: EMA weights and throughput / memory logging."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ThroughputMonitor
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim.swa_utils import AveragedModel
from torch.utils.flop_counter import FlopCounterMode

from vitlab.data.batch import split_batch


def batch_images(batch: Any) -> int:
    """Number of images in a batch (`split_batch`'s layouts)."""
    return split_batch(batch, targets=False)[0].shape[0]


class EMA(EMAWeightAveraging):
    """Lightning's `EMAWeightAveraging` (validation and saved/exported weights are the EMA ones; the raw
    weights are restored on resume), with the epoch of its last update kept across a resume. vitlab's
    modules build their model in `__init__` (`configure_model` only compiles), so setup copies the module
    as is instead of calling `configure_model` first."""

    def __init__(
        self, decay: float = 0.9998, update_every_n_steps: int = 1, update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None, device: str | None = None, use_buffers: bool = True,
    ) -> None:  # fmt: skip
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must lie in (0, 1) (got {decay})")
        super().__init__(device, use_buffers, decay, update_every_n_steps, update_starting_at_step,
                         update_starting_at_epoch)  # fmt: skip
        self.decay = decay

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and getattr(pl_module, "builds_model_in_init", False):
            device = self._device or pl_module.device
            self._average_model = AveragedModel(pl_module, device, use_buffers=self._use_buffers, **self._kwargs)
            return
        super().setup(trainer, pl_module, stage)

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._latest_update_epoch = state_dict.get("latest_update_epoch", self._latest_update_epoch)


def flops_per_image(model: torch.nn.Module) -> dict[str, int]:
    """FLOPs of one image through a vitlab model: {"train": forward + backward, "eval": forward}, counted on
    a meta-device copy: no memory, no compute, no random numbers drawn (the run's streams stay as they are)."""
    config = getattr(model, "config", None)
    if not isinstance(config, Mapping) or "img_size" not in config:
        return {}
    meta = copy.deepcopy(model).to("meta")
    x = torch.empty(1, int(config.get("in_chans", 3)), *config["img_size"], device="meta")
    flops = {}
    for stage, train in (("train", True), ("eval", False)):
        meta.train(train)
        with FlopCounterMode(display=False) as counter:
            out = meta(x)
            if train:
                out.float().sum().backward()
        flops[stage] = counter.get_total_flops()
    return flops


class PerfMonitor(ThroughputMonitor):
    """Lightning's `ThroughputMonitor` (samples/s, FLOPs/s and MFU, from `flops_per_image` counted once), its
    time points taken at logging steps only, since each waits for the device: a `window` of 2 measures the
    last `log_every_n_steps` steps. Also `train/samples_seen` (all ranks, restored on resume),
    `perf/epoch_time_s` (validation included) and `perf/peak_mem_mb` (CUDA's, else the process RSS)."""

    def __init__(self, window: int = 2) -> None:
        super().__init__(batch_size_fn=batch_images, window_size=window)
        self.flops: dict[str, int] = {}
        self.samples_seen = 0
        self._epoch_start = 0.0
        self._peak_rss = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if not self.flops:
            self.flops = flops_per_image(getattr(pl_module, "model", pl_module))
            # Lightning's model summary counts FLOPs only by running `example_input_array` through the module
            # (and its DataModule's batch hooks): 0 here, so the count is this line's.
            if "eval" in self.flops:
                rank_zero_info(f"FLOPs per image: {get_human_readable_count(self.flops['eval'])} forward, "
                               f"{get_human_readable_count(self.flops['train'])} training step")  # fmt: skip

    def _set_flops(self, pl_module: L.LightningModule, batch: Any, stage: str) -> None:
        if stage in self.flops:
            pl_module.flops_per_batch = self.flops[stage] * batch_images(batch)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._peak_rss = 0
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._epoch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._set_flops(pl_module, batch, "train")
        # Lightning's monitor waits for the device (`cuda.synchronize`) at each time point it takes, so take
        # them at logging steps only (the last batch of the step); other batches are counted without one.
        if not trainer.fit_loop._should_accumulate() and trainer._logger_connector.should_update_logs:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        elif trainer.is_global_zero:
            stage = trainer.state.stage
            self._samples[stage] += batch_images(batch)
            self._batches[stage] += 1
        self.samples_seen += batch_images(batch) * trainer.world_size
        seen = torch.tensor(self.samples_seen, dtype=torch.float64)  # float64: exact past float32's 2**24
        pl_module.log("train/samples_seen", seen, on_step=True, on_epoch=False)
        if pl_module.device.type != "cuda":
            self._peak_rss = max(self._peak_rss, psutil.Process().memory_info().rss)

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._set_flops(pl_module, batch, "eval")
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        elapsed = time.perf_counter() - self._epoch_start
        pl_module.log("perf/epoch_time_s", elapsed, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        if pl_module.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(pl_module.device)
        else:
            peak = self._peak_rss or psutil.Process().memory_info().rss
        pl_module.log("perf/peak_mem_mb", peak / 2**20, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples_seen = int(state_dict.get("samples_seen", 0))
