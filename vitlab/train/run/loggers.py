"""The experiment trackers a run logs to: TensorBoard and CSV by default (no account, no network), wandb
when asked for; all under the run folder."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger

log = logging.getLogger("vitlab")

WANDB_ID_KEY = "wandb_run_id"


def _wandb_logger(run_dir: Path, ckpt_path: str | None) -> WandbLogger:
    wandb_dir = run_dir / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file()
    offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not has_key
    if offline:
        os.environ.setdefault("WANDB_MODE", "offline")
        log.warning(
            "wandb: no API key found, logging offline to %s; upload later with `wandb sync %s/offline-run-*`",
            wandb_dir, wandb_dir,
        )  # fmt: skip
    from vitlab.train.run.defaults import checkpoint_dir  # defaults imports this module

    # A resumed run continues the wandb run its checkpoint names.
    ckpt = checkpoint_dir(run_dir) / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path or "")
    run_id = None
    if ckpt_path and ckpt.is_file():
        run_id = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True).get(WANDB_ID_KEY)
    return WandbLogger(
        save_dir=str(run_dir), project=os.environ.get("WANDB_PROJECT", "vitlab"), name=run_dir.name,
        offline=offline, id=run_id, resume="allow" if run_id else None,
    )  # fmt: skip


def tensorboard_tag(key: str) -> str:
    """Loss and accuracy keep their names (`train/loss`, `val/acc1`...); every other scalar goes under
    `vitals/`, which sorts after `train`, `test` and `val` (`lr` -> `vitals/lr`)."""
    group, _, name = key.partition("/")
    return key if group in ("train", "val", "test") and name.startswith(("loss", "acc")) else f"vitals/{key}"


class HeadlineTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger, its scalars renamed (`tensorboard_tag`) so that the Time Series tab,
    which expands its first two groups only, opens on `train` and `val`: loss, accuracy and the figures.
    Lightning's `epoch` column (a staircase over steps) is left out."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({tensorboard_tag(k): v for k, v in metrics.items() if k != "epoch"}, step)


def run_loggers(run_dir: str | Path, names: Sequence[str], ckpt_path: str | None = None) -> list[Logger]:
    """TensorBoard and CSV by default (no account, no network); wandb when asked for."""
    run_dir = Path(run_dir)
    make = {
        # No `hp_metric` placeholder (-1): the hparams view lists the config; val/acc1 is a scalar.
        "tensorboard": lambda: HeadlineTensorBoardLogger(str(run_dir), "tensorboard", "", default_hp_metric=False),
        "csv": lambda: CSVLogger(save_dir=str(run_dir), name="csv", version=""),
        "wandb": lambda: _wandb_logger(run_dir, ckpt_path),
    }
    for name in names:
        if name not in make:
            raise ValueError(f"unknown logger {name!r}; choose from tensorboard, csv, wandb")
    return [make[name]() for name in names]


class RememberWandbRun(Callback):
    """Store the wandb run id in each checkpoint so a resumed job continues the same wandb run."""

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                checkpoint[WANDB_ID_KEY] = logger.version
