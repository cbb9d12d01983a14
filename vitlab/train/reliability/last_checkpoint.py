"""`LastCheckpoint`: keeps last.ckpt current and makes a termination signal stop every rank together;
`BestCheckpoint`: the best val/acc1. Both write to `<default_root_dir>/checkpoints` by default."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from vitlab.train.reliability.checkpoint_io import AtomicCheckpointIO, is_local_path, remove_stale_temp_files
from vitlab.train.reliability.watchdog import SignalWatchdog

log = logging.getLogger("vitlab")

_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


def _default_dir(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """`<default_root_dir>/checkpoints` (the run folder's) when no dirpath was given: Lightning's default
    (`ModelCheckpoint.__resolve_ckpt_dir`) follows the first logger's folder instead."""
    if callback.dirpath is None:
        callback.dirpath = os.path.realpath(os.path.join(str(trainer.default_root_dir), "checkpoints"))
        callback._fs = get_filesystem(callback.dirpath)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint keeping the best val/acc1 as `best-epochNNN.ckpt` in the run folder's
    checkpoints/ (last.ckpt: `LastCheckpoint`)."""

    def __init__(self, dirpath: str | Path | None = None, monitor: str = "val/acc1", mode: str = "max") -> None:
        super().__init__(dirpath=dirpath, filename="best-epoch{epoch:03d}", monitor=monitor, mode=mode, save_top_k=1,
                         save_last=False, auto_insert_metric_name=False)  # fmt: skip

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        _default_dir(self, trainer)
        super().setup(trainer, pl_module, stage)


class LastCheckpoint(ModelCheckpoint):
    """The only writer of `<dirpath>/last.ckpt`: every `every_n_train_steps` steps (Lightning's trigger),
    after every validation (or train epoch without one), at the end of training, and on SIGTERM/SIGUSR1
    (SLURM's `--signal=USR1@90`). At setup it removes the temporary files a killed run left.

    A signal stops the run at a training batch's end (single process: also at a validation batch's end)
    with Lightning's `SIGTERMException` (exit status 0), and last.ckpt is saved there, so `--ckpt_path last`
    continues exactly. Lightning 2.6 falls short (`trainer/connectors/signal_connector.py`): its SIGTERM
    handler broadcasts, and its SLURM requeue handler saves, inside the handler, each rank wherever it was
    interrupted; SIGUSR1 stops nothing without SLURM's auto-requeue; and nothing saves last.ckpt on a stop.
    Here the handler only records the signal; under DDP the ranks agree with one all-reduce at a batch end
    every `signal_check_every_n_steps` steps (default `log_every_n_steps`); Lightning's USR1 requeue handler
    runs after the save, on every rank together. A rank blocked in a collective runs no Python handler:
    `SignalWatchdog` ends it `signal_timeout_s` after the signal (exit status 124).
    """

    def __init__(
        self, dirpath: str | Path | None = None, every_n_train_steps: int | None = None,
        signal_timeout_s: float | None = 180.0, signal_check_every_n_steps: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(
            dirpath=dirpath, monitor=None, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps or 0,
            enable_version_counter=False,
        )  # fmt: skip
        if signal_check_every_n_steps is not None and signal_check_every_n_steps < 1:
            raise ValueError(f"signal_check_every_n_steps must be >= 1 or None, got {signal_check_every_n_steps}")
        if signal_timeout_s is not None and signal_timeout_s <= 0:
            raise ValueError(f"signal_timeout_s must be > 0 or None (wait forever), got {signal_timeout_s}")
        self.signal_check_every_n_steps = signal_check_every_n_steps
        self.signal_timeout_s = signal_timeout_s
        self._watchdog: SignalWatchdog | None = None
        self._signal = 0  # 1: SIGTERM, 2: SIGUSR1 (under DDP agreed over the ranks: the max)
        self._prev_sigterm: Any = None  # the handler Lightning's would chain to
        self._requeue: Any = None  # the SIGUSR1 handler before ours: Lightning's SLURM requeue, if any

    # The state key must not depend on the step interval, or changing it between a run and its
    # resume would drop this callback's state (and its last_model_path). Callback._generate_state_key's form.
    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}{{'role': 'last'}}"

    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        # `ckpt_path="last"` is resolved before setup; resolve the default folder here too.
        _default_dir(self, trainer)
        return super()._find_last_checkpoints(trainer)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        _default_dir(self, trainer)
        super().setup(trainer, pl_module, stage)
        if not isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO):
            rank_zero_warn(
                f"{type(trainer.strategy.checkpoint_io).__name__} is not vitlab's AtomicCheckpointIO: a kill during "
                "a checkpoint write may leave a torn file (add it to trainer.plugins)"
            )
        if stage == "fit" and trainer.is_global_zero and is_local_path(self.dirpath):
            for p in remove_stale_temp_files(self.dirpath):
                log.info("removed a partial checkpoint left by an interrupted run: %s", p)
        self._prev_sigterm = signal.getsignal(signal.SIGTERM)  # Lightning installs its own after setup

    def save_last_now(self, trainer: L.Trainer) -> None:
        """Write last.ckpt unless it already holds this global step (or saving makes no sense now)."""
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, {})  # no metrics: the name is last.ckpt

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # Lightning's `TrainingEpochLoop._broadcast_sigterm_tensor` shares rank 0's flag only, and a rank stops
        # on its own flag at a batch end: ranks signalled in different batches would stop at different batches.
        # Every rank runs this hook at the same batch: stop together if any rank was signalled.
        if trainer.world_size > 1:
            if trainer.global_step % (self.signal_check_every_n_steps or trainer.log_every_n_steps or 1):
                return
            flag = torch.tensor(self._signal, device=trainer.strategy.root_device)
            self._signal = int(trainer.strategy.reduce(flag, reduce_op="max"))
        if self._signal:
            raise SIGTERMException  # public, where Lightning's flag is private; `on_exception` saves last.ckpt

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if self._signal and trainer.world_size == 1:  # under DDP the ranks agree at a training batch's end
            raise SIGTERMException

    # Stock ModelCheckpoint refreshes last.ckpt after an epoch or a validation only when it saved a top-k
    # file at that step (`_last_global_step_saved == trainer.global_step` in its on_validation_end), and at
    # the end of training only when it never saved (`not self._last_checkpoint_saved` in its on_train_end).
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._should_save_on_train_epoch_end(trainer):
            self.save_last_now(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_save_on_train_epoch_end(trainer):
            self.save_last_now(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save_last_now(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Only a termination signal saves here: after any other error the state may be what broke. Lightning's
        # `save_on_exception` and `OnExceptionCheckpoint` save after any exception (and not into last.ckpt).
        if isinstance(exception, SIGTERMException) and trainer.global_step > 0:
            self.save_last_now(trainer)  # every rank together: they raised at the same batch
            if trainer.is_global_zero:
                log.warning("termination signal: %s holds global step %d; resume with --ckpt_path last",
                            self.last_model_path, trainer.global_step)  # fmt: skip
            if self._signal == 2 and callable(self._requeue):  # every rank: it saves a checkpoint too
                self._requeue(signal.SIGUSR1, None)
        # Lightning skips the callbacks' teardown after an exception: stand the watchdog down here, once the
        # save it guards is done, or its timer would end a process that outlives the fit (a notebook, pytest).
        self.teardown()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if threading.current_thread() is not threading.main_thread():
            return
        # After Lightning installed its handlers; its `_SignalConnector.teardown` puts the originals back.
        self._signal = 0
        self._requeue = signal.getsignal(signal.SIGUSR1) if hasattr(signal, "SIGUSR1") else None
        for signum in _SIGNALS:
            signal.signal(signum, lambda signum, frame: self._on_signal(trainer, signum, frame))
        if self.signal_timeout_s is not None and self._watchdog is None:
            launcher = trainer.strategy.launcher
            end_ranks = lambda: launcher is None or launcher.kill(signal.SIGKILL)  # noqa: E731
            watchdog = SignalWatchdog(self.signal_timeout_s, _SIGNALS, end_ranks)
            self._watchdog = watchdog if watchdog.install() else None

    def _on_signal(self, trainer: L.Trainer, signum: int, frame: Any) -> None:
        """Record the signal and pass it on to the ranks this process launched; one process stops now."""
        log.info("[rank %d] received signal %d; stopping at the end of a training batch", trainer.global_rank, signum)
        launcher = trainer.strategy.launcher
        if not self._signal and launcher is not None:
            launcher.kill(signum)
        self._signal = max(self._signal, 2 if signum == getattr(signal, "SIGUSR1", None) else 1)
        if signum == signal.SIGTERM and callable(self._prev_sigterm):
            self._prev_sigterm(signum, frame)

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        if self._watchdog is not None:
            self._watchdog.uninstall()
            self._watchdog = None
