"""The experiment trackers a run logs to: TensorBoard and CSV by default (no account, no network), wandb
when asked for; all under the run folder."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger

log = logging.getLogger("vitlab")

WANDB_ID_KEY = "wandb_run_id"


def wandb_run_id(ckpt: Path) -> str | None:
    """The wandb run a checkpoint names (`RememberWandbRun`), or None."""
    if not ckpt.is_file():
        return None
    return torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True).get(WANDB_ID_KEY)


def _wandb_logger(run_dir: Path, run_id: str | None) -> WandbLogger:
    """A WandbLogger under `run_dir/wandb`, continuing the wandb run `run_id` when given."""
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

    def save(self) -> None:
        # Lightning's save() also writes hparams.yaml beside the events, which is the run folder here:
        # config.yaml is the run's record, and csv/hparams.yaml keeps what the modules logged.
        self.experiment.flush()


def run_loggers(run_dir: str | Path, names: Sequence[str], ckpt_path: str | None = None) -> list[Logger]:
    """TensorBoard and CSV by default (no account, no network); wandb when asked for."""
    run_dir = Path(run_dir)
    make = {
        # No `hp_metric` placeholder (-1): the hparams view lists the config; val/acc1 is a scalar.
        # Events in the run folder itself, so `tensorboard --logdir runs` names each run by its folder.
        # No `hp_metric` placeholder (-1): RunSummary logs the hyperparameters with real metrics.
        "tensorboard": lambda: HeadlineTensorBoardLogger(
            str(run_dir.parent), run_dir.name, "", default_hp_metric=False
        ),
        "csv": lambda: CSVLogger(save_dir=str(run_dir), name="csv", version=""),
        "wandb": lambda: _wandb_logger(run_dir, _resumed_wandb_id(run_dir, ckpt_path)),
    }
    for name in names:
        if name not in make:
            raise ValueError(f"unknown logger {name!r}; choose from tensorboard, csv, wandb")
    return [make[name]() for name in names]


def _resumed_wandb_id(run_dir: Path, ckpt_path: str | None) -> str | None:
    """A resumed run continues the wandb run its checkpoint names."""
    from vitlab.train.run.defaults import checkpoint_dir  # defaults imports this module

    if not ckpt_path:
        return None
    return wandb_run_id(checkpoint_dir(run_dir) / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path))


class RememberWandbRun(Callback):
    """Store the wandb run id in each checkpoint so a resumed job continues the same wandb run."""

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                checkpoint[WANDB_ID_KEY] = logger.version


# The dashboard row of a run: its key hyperparameters and these metrics (TensorBoard's HParams tab reads
# the latest scalar of each tag, under `tensorboard_tag`'s names; val/acc1 is the last validation's).
# The test size ones come from `vitlab resolution`.
SUMMARY_METRICS = ("val/acc1", "val/acc1_best", "minutes", "val/test_size", "val/test_size_acc1")


def run_hparams(trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
    """The hyperparameters that tell runs apart: recipe, init_from, epochs, image size and its schedule
    (`size_schedule`: the HParams tab ticks the first five names in order, lr among them), lr, global
    batch, precision."""
    saved = next((cb for cb in trainer.callbacks if isinstance(cb, SaveConfigCallback)), None)
    recipes = saved.config.get("config") if saved is not None else None
    data = dict(getattr(trainer.datamodule, "hparams", None) or {})
    model = pl_module.hparams
    schedule = data.get("img_size_schedule")
    return {
        "recipe": ",".join(str(p) for p in recipes or []),
        "init_from": str(model.get("init_from") or "scratch"),
        "epochs": trainer.max_epochs,
        "img_size": data.get("img_size", model.get("img_size")),
        "size_schedule": str([list(step) for step in schedule]) if schedule else "none",
        "lr": model.get("lr"),
        "batch_size": data.get("batch_size"),
        "precision": str(trainer.precision),
    }


def _hparams_summaries(hparams: Mapping[str, Any]) -> list[Any]:
    from torch.utils.tensorboard.summary import hparams as hparams_summary

    plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hparams.items()}
    return list(hparams_summary(plain, {tensorboard_tag(k): 0.0 for k in SUMMARY_METRICS}))  # values unread


def write_tensorboard_summary(
    log_dir: str | Path, hparams: Mapping[str, Any] | None, metrics: Mapping[str, float], step: int, name: str
) -> None:
    """Write `metrics` (SUMMARY_METRICS keys) at `step` into the TensorBoard run at `log_dir`, with the
    hparams record that declares them when `hparams` is given, as the events file `*.{name}` in that
    folder (so the same run), replacing the one an earlier fit of the run wrote: the HParams tab reads
    a run's first hparams record, and a resumed run's must be its latest."""
    from torch.utils.tensorboard import SummaryWriter

    for old in Path(log_dir).glob(f"events.out.tfevents.*.{name}"):
        old.unlink()
    writer = SummaryWriter(str(log_dir), filename_suffix=f".{name}")
    try:
        for summary in _hparams_summaries(hparams) if hparams is not None else []:
            writer.file_writer.add_summary(summary)
        for tag, value in metrics.items():
            writer.add_scalar(tensorboard_tag(tag), value, step)
    finally:
        writer.close()


class RunSummary(Callback):
    """One row per run on the dashboards (TensorBoard's HParams tab, wandb's run table): `run_hparams`
    with the last and best val/acc1 and the training minutes (across resumes), logged as the fit ends.
    `vitlab resolution` adds the test size it chooses (`log_test_size`)."""

    def __init__(self) -> None:
        self.best: float | None = None
        self.minutes = 0.0
        self._start: float | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.monotonic()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        acc1 = trainer.callback_metrics.get("val/acc1")
        if trainer.sanity_checking or acc1 is None:
            return
        self.best = max(float(acc1), -math.inf if self.best is None else self.best)

    def _minutes(self) -> float:
        return self.minutes + (0.0 if self._start is None else (time.monotonic() - self._start) / 60)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "minutes": self._minutes()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.minutes = state_dict["best"], state_dict["minutes"]

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        hparams = run_hparams(trainer, pl_module)
        # val/acc1 itself is logged already: its last value is the run's last accuracy.
        metrics = {"minutes": round(self._minutes(), 2)}
        if self.best is not None:
            metrics["val/acc1_best"] = self.best
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                if trainer.is_global_zero:
                    write_tensorboard_summary(logger.log_dir, hparams, metrics, trainer.global_step, "summary")
            else:
                logger.log_hyperparams(hparams)
                logger.log_metrics(metrics, step=trainer.global_step)


def log_test_size(run_dir: str | Path, test_size: int, top1: float, step: int) -> None:
    """Add the test size `vitlab resolution` chose, and its top-1, to the run's dashboard row: its
    TensorBoard run, and its wandb run when it logged to one (resumed by the id its checkpoint holds)."""
    run_dir = Path(run_dir)
    metrics = {"val/test_size": float(test_size), "val/test_size_acc1": float(top1)}
    if any(run_dir.glob("events.out.tfevents.*")):
        write_tensorboard_summary(run_dir, None, metrics, step, "test_size")
    run_id = wandb_run_id(run_dir / "checkpoints" / "last.ckpt") if (run_dir / "wandb").is_dir() else None
    if run_id:
        logger = _wandb_logger(run_dir, run_id)
        logger.experiment.summary.update(metrics)
        logger.experiment.finish()
