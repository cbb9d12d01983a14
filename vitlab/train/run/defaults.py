"""What every run gets by default: callbacks and checkpoint IO, all under its run folder (loggers: loggers.py)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
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
from vitlab.train.run.loggers import RememberWandbRun

log = logging.getLogger("vitlab")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


class EndRanksOnFailure(Callback):
    """When rank 0 of `--trainer.devices=N` (which launched the other ranks) fails, end those ranks:
    Lightning does so for Ctrl-C only, and a rank left waiting in a collective holds its GPU until the
    process-group timeout. SIGTERM is left alone: every rank saves and exits on its own."""

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
    """Callbacks every run needs that the recipe did not already configure: the best checkpoint (by
    val/acc1) and `LastCheckpoint` in `<run_dir>/checkpoints`, the non-finite guard, exact resume, secret
    redaction, throughput, `model`'s validation figures, the image-size schedule and the run-folder check.
    Fails now if `run_dir` is not writable."""
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
    kinds = (NonFiniteGuard, ExactResume, RedactSecrets, PerfMonitor, figures, FinetuneSource, ImgSizeSchedule)
    extra += [kind() for kind in (*kinds, RunDirCheck) if not has(kind)]
    return extra


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (avx512_bf16 or AMX tiles, about 2x float32);
    without them bf16 is emulated and slower than float32. torch's own (private) probe."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_precision(precision: str | int | None, accelerator: Any = "cpu") -> str | int | None:
    """`precision`, except that a bf16 setting on a CPU without native bf16 (`cpu_has_fast_bf16`) falls
    back to 32-true, with one log line."""
    on_cpu = accelerator == "cpu" or (
        accelerator in (None, "auto") and not torch.cuda.is_available() and not torch.backends.mps.is_available()
    )
    if not on_cpu or not str(precision).startswith("bf16") or cpu_has_fast_bf16():
        return precision
    log.warning("precision %s: this CPU has no avx512_bf16 or AMX, so bf16 would run slower than float32; "
                "training in 32-true instead", precision)  # fmt: skip
    return "32-true"


def run_plugins(existing: Sequence[Any] | None = None) -> list[Any]:
    """`AtomicCheckpointIO`, unless the recipe's plugins hold a CheckpointIO."""
    if any(isinstance(p, CheckpointIO) for p in existing or []):
        return []
    return [AtomicCheckpointIO()]
