"""What every run gets by default: loggers, callbacks and checkpoint IO, all under its run folder."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitlab.train.objectives.mpp import MaskedPatchPretraining
from vitlab.train.reliability.checkpoint_io import AtomicCheckpointIO
from vitlab.train.reliability.guards import NonFiniteGuard, RunDirCheck, check_run_dir
from vitlab.train.reliability.last_checkpoint import LastCheckpoint
from vitlab.train.reliability.redaction import RedactSecrets, keep_argv_out_of_trackers
from vitlab.train.reliability.resume import ExactResume
from vitlab.train.run.callbacks import PerfMonitor
from vitlab.train.run.figures import FinetuneSource, MaskedPatchFigures, ValidationFigures
from vitlab.train.run.img_size_schedule import ImgSizeSchedule

log = logging.getLogger("vitlab")

WANDB_ID_KEY = "wandb_run_id"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _resumed_wandb_id(run_dir: Path, ckpt_path: str | None) -> str | None:
    if not ckpt_path:
        return None
    path = checkpoint_dir(run_dir) / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    if not path.is_file():
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return ckpt.get(WANDB_ID_KEY)


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
    run_id = _resumed_wandb_id(run_dir, ckpt_path)
    return WandbLogger(
        save_dir=str(run_dir), project=os.environ.get("WANDB_PROJECT", "vitlab"), name=run_dir.name,
        offline=offline, id=run_id, resume="allow" if run_id else None,
    )  # fmt: skip


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a logged scalar: loss and accuracy keep their names (`train/loss`,
    `val/acc1`, `train/loss_epoch`, `train/loss_distill`, ...); every other scalar (learning rate,
    throughput, samples seen, epoch time, memory) goes under `vitals/`, which sorts after `train`,
    `test` and `val`: `lr` -> `vitals/lr`, `train/device/samples_per_sec` -> `vitals/train/device/...`."""
    group, _, name = key.partition("/")
    return key if group in ("train", "val", "test") and name.startswith(("loss", "acc")) else f"vitals/{key}"


class HeadlineTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger, its scalars named so that the Time Series tab TensorBoard opens
    on shows loss and accuracy first. That tab sorts the cards by tag, groups them by the tag's first
    segment and, on first load, expands the first two groups only: here `train` and `val`, holding
    loss, accuracy and the validation figures (`tensorboard_tag`). Lightning's `epoch` (added to every
    row it logs: a staircase over steps) is left out. The CSV and wandb keep Lightning's names."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({tensorboard_tag(k): v for k, v in metrics.items() if k != "epoch"}, step)


def run_loggers(run_dir: str | Path, names: Sequence[str], ckpt_path: str | None = None) -> list[Logger]:
    """TensorBoard and CSV by default (no account, no network); wandb when asked for."""
    run_dir = Path(run_dir)
    loggers: list[Logger] = []
    for name in names:
        if name == "tensorboard":
            # No `hp_metric` placeholder (-1): the hparams view lists the config; val/acc1 is a scalar.
            loggers.append(
                HeadlineTensorBoardLogger(str(run_dir), name="tensorboard", version="", default_hp_metric=False)
            )
        elif name == "csv":
            loggers.append(CSVLogger(save_dir=str(run_dir), name="csv", version=""))
        elif name == "wandb":
            loggers.append(_wandb_logger(run_dir, ckpt_path))
        else:
            raise ValueError(f"unknown logger {name!r}; choose from tensorboard, csv, wandb")
    return loggers


class RememberWandbRun(Callback):
    """Store the wandb run id in each checkpoint so a resumed job continues the same wandb run."""

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                checkpoint[WANDB_ID_KEY] = logger.version


class EndRanksOnFailure(Callback):
    """When rank 0 of `vitlab fit --trainer.devices=N` (the process that launched the other ranks)
    fails, end the ranks it started. Lightning does this for Ctrl-C only; otherwise a rank waiting in
    a collective that rank 0 never joins holds its GPU until the process-group timeout (30 min).
    Preemption (SIGTERM) is left alone: every rank saves and exits on its own. Under torchrun and
    `srun --kill-on-bad-exit=1` the launcher does this job.
    """

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            return
        launcher = trainer.strategy.launcher
        procs = getattr(launcher, "procs", None)
        if isinstance(launcher, _SubprocessScriptLauncher) and procs:
            log.error("rank 0 failed (%s: %s); ending the %d ranks it started", type(exception).__name__, exception,
                      len(procs))  # fmt: skip
            launcher.kill(signal.SIGKILL)


def run_callbacks(
    run_dir: str | Path, existing: Sequence[Callback], every_n_train_steps: int | None = None,
    model: LightningModule | None = None,
) -> list[Callback]:  # fmt: skip
    """Callbacks every run needs that the recipe did not already configure.

    The best checkpoint (by val/acc1) and `LastCheckpoint`, the single writer of last.ckpt (after every
    validation, every `every_n_train_steps` steps when given, and on SIGTERM/SIGUSR1), both in
    `<run_dir>/checkpoints`; the non-finite loss guard, RNG-state checkpointing for exact resume,
    secret redaction, the validation figures of `model`'s objective and the run-folder/disk-space check.
    Fails now if `run_dir` is not writable.
    """
    check_run_dir(run_dir)  # before any logger or callback writes into it
    keep_argv_out_of_trackers()  # before wandb starts and records the command line
    extra: list[Callback] = [RememberWandbRun(), EndRanksOnFailure()]

    def has(kind: type) -> bool:
        return any(isinstance(cb, kind) for cb in existing)

    if not any(isinstance(cb, ModelCheckpoint) and not isinstance(cb, LastCheckpoint) for cb in existing):
        extra.append(
            ModelCheckpoint(
                dirpath=str(checkpoint_dir(run_dir)), filename="best-epoch{epoch:03d}", auto_insert_metric_name=False,
                monitor="val/acc1", mode="max", save_top_k=1, save_last=False,  # last.ckpt: LastCheckpoint
            )  # fmt: skip
        )
    if not any(isinstance(cb, ModelCheckpoint) and cb.save_last for cb in existing):
        extra.append(LastCheckpoint(dirpath=str(checkpoint_dir(run_dir)), every_n_train_steps=every_n_train_steps))
    elif every_n_train_steps and not has(LastCheckpoint):
        log.warning(
            "the recipe's ModelCheckpoint writes last.ckpt, so checkpoint_every_n_steps=%d is not applied; "
            "use vitlab.train.reliability.last_checkpoint.LastCheckpoint(every_n_train_steps=...) in its place",
            every_n_train_steps,
        )
    # Masked patch prediction draws its corrupted and predicted patches; a prediction grid means nothing there.
    figures = MaskedPatchFigures if isinstance(model, MaskedPatchPretraining) else ValidationFigures
    for kind in (NonFiniteGuard, ExactResume, RedactSecrets, PerfMonitor, figures, FinetuneSource, ImgSizeSchedule):
        if not has(kind):
            extra.append(kind())
    if not has(RunDirCheck):
        extra.append(RunDirCheck(run_dir))
    return extra


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (avx512_bf16 or AMX tiles; oneDNN then runs a
    bf16 matmul about 2x faster than float32). Without them bf16 is emulated and slower than float32."""
    native = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(f) for f in native):  # torch's own probe (private; the flags below cover a torch without it)
        return any(f() for f in native)
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_precision(precision: str | int | None, accelerator: Any = "cpu") -> str | int | None:
    """The precision a run trains in: on the CPU (`accelerator` "cpu", or "auto"/None without a GPU), a
    bf16 setting falls back to 32-true, with one log line, when the CPU lacks native bf16
    (`cpu_has_fast_bf16`); anything else is returned as given."""
    on_cpu = accelerator == "cpu" or (
        accelerator in (None, "auto") and not torch.cuda.is_available() and not torch.backends.mps.is_available()
    )
    if not on_cpu or not str(precision).startswith("bf16") or cpu_has_fast_bf16():
        return precision
    log.warning("precision %s: this CPU has no avx512_bf16 or AMX, so bf16 would run slower than float32; "
                "training in 32-true instead", precision)  # fmt: skip
    return "32-true"


def run_plugins(existing: Sequence[Any] | None = None) -> list[Any]:
    """Trainer plugins every run needs that the recipe did not configure: `AtomicCheckpointIO`
    (temp file + fsync + rename, safe `weights_only=True` loading) unless a CheckpointIO is given."""
    if any(isinstance(p, CheckpointIO) for p in existing or []):
        return []
    return [AtomicCheckpointIO()]
