"""`LastCheckpoint`: keeps last.ckpt current (periodically, after validation, at the end, and on
SIGTERM/SIGUSR1), and makes a termination signal stop every rank together, or end the job when a rank
is blocked."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import lightning as L
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from vitlab.train.reliability.checkpoint_io import remove_stale_temp_files, use_atomic_io
from vitlab.train.reliability.lightning_internals import (
    end_launched_ranks,
    forward_signal_to_launched_ranks,
    mark_sigterm,
    replace_sigterm_notifier,
)
from vitlab.train.reliability.watchdog import SignalWatchdog

log = logging.getLogger("vitlab")


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class LastCheckpoint(ModelCheckpoint):
    """Keeps `last.ckpt` current; the only writer of it in a vitlab run.

    Saves `<dirpath>/last.ckpt` (default dirpath: `<default_root_dir>/checkpoints`, i.e. the run's
    checkpoint folder) after every `every_n_train_steps` optimizer steps (so a kill loses at most that
    many steps), after every validation (or every train epoch without validation) and at the end of
    training; stock `ModelCheckpoint(save_last=True)` next to a monitor only refreshes last.ckpt when
    the monitored metric improves.

    Signals: SIGTERM (and SIGUSR1, SLURM's preemption warning, `#SBATCH --signal=USR1@90`) stop the run
    at the end of the current training batch through Lightning's `SIGTERMException` (a `SystemExit`,
    exit status 0), after this callback saved last.ckpt there, so `vitlab fit ... --ckpt_path last`
    continues exactly. Under DDP every rank must stop at the same batch, or the ones still training
    wait forever in the next all-reduce: this callback replaces Lightning's SIGTERM notifier (which
    broadcasts from inside the signal handler, wherever each rank happens to be) with one that only
    records the signal, and the ranks agree at a batch end (one all-reduce of a flag; see below);
    the save then runs in `on_exception`, which every rank reaches together. Under SLURM with
    auto-requeue Lightning's own USR1 handler still runs first (hpc checkpoint + `scontrol requeue`).
    The ranks agree every `signal_check_every_n_steps` optimizer steps (default: the trainer's
    `log_every_n_steps`, where logging already waits for the device), not every step: the all-reduce
    reads its result on the host, which would make the host wait for the device at each step.

    A signal must end the job even when a rank is blocked in a collective (where no Python signal
    handler can run) or the save itself waits on a rank that never comes: `SignalWatchdog` then ends
    the process (and the ranks it launched) `signal_timeout_s` seconds after the signal, with exit
    status 124 and the reason logged; last.ckpt keeps the last completed save.

    The checkpoint files are written atomically: at setup it installs `AtomicCheckpointIO` unless the
    strategy carries a custom CheckpointIO, and it removes temporary files a killed run left behind.
    """

    def __init__(
        self, dirpath: _PATH | None = None, every_n_train_steps: int | None = None, save_on_signal: bool = True,
        signal_timeout_s: float | None = 180.0, signal_check_every_n_steps: int | None = None,
    ) -> None:  # fmt: skip
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must be >= 0 or None, got {every_n_train_steps}")
        super().__init__(
            dirpath=dirpath, monitor=None, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps or 0,
            enable_version_counter=False,
        )  # fmt: skip
        if signal_check_every_n_steps is not None and signal_check_every_n_steps < 1:
            raise ValueError(f"signal_check_every_n_steps must be >= 1 or None, got {signal_check_every_n_steps}")
        self.signal_check_every_n_steps = signal_check_every_n_steps
        if signal_timeout_s is not None and signal_timeout_s <= 0:
            raise ValueError(f"signal_timeout_s must be > 0 or None (wait forever), got {signal_timeout_s}")
        self.save_on_signal = save_on_signal
        self.signal_timeout_s = signal_timeout_s
        self._prev_usr1: Any = None
        self._usr1_installed = False
        self._watchdog: SignalWatchdog | None = None
        self._signalled = False  # this rank received SIGTERM/SIGUSR1
        self._agree_on_stop = False  # Lightning's notifier replaced: ranks agree at batch ends

    # The state key must not depend on the step interval, or changing it between a run and its
    # resume would drop this callback's state (and its last_model_path).
    @property
    def state_key(self) -> str:
        return self._generate_state_key(role="last")

    def _use_default_dir(self, trainer: L.Trainer) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.realpath(os.path.join(str(trainer.default_root_dir), "checkpoints"))
            self._fs = get_filesystem(self.dirpath)

    @property
    def last_path(self) -> str | None:
        if self.dirpath is None:
            return None
        return os.path.join(str(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        # `ckpt_path="last"` is resolved before setup; resolve the default folder here too.
        self._use_default_dir(trainer)
        return super()._find_last_checkpoints(trainer)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._use_default_dir(trainer)
        super().setup(trainer, pl_module, stage)
        if not use_atomic_io(trainer):
            rank_zero_warn(
                f"{type(trainer.strategy.checkpoint_io).__name__} is not vitlab's AtomicCheckpointIO: "
                "a kill during a checkpoint write may leave a torn file"
            )
        if stage == "fit" and trainer.is_global_zero and _is_local_file_protocol(str(self.dirpath)):
            for p in remove_stale_temp_files(self.dirpath):
                log.info("removed a partial checkpoint left by an interrupted run: %s", p)

    # ---- saving ----------------------------------------------------------------------------------

    def save_last_now(self, trainer: L.Trainer) -> str | None:
        """Write last.ckpt unless it already holds this global step (or saving makes no sense now)."""
        if self._should_skip_saving_checkpoint(trainer):
            return None
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        return self.last_model_path

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        every = self.signal_check_every_n_steps or trainer.log_every_n_steps or 1
        if self._agree_on_stop and trainer.world_size > 1 and trainer.global_step % every == 0:
            # Every rank runs this hook at the same batch: stop together if any rank was signalled.
            if trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
                mark_sigterm(trainer)  # Lightning raises SIGTERMException after this batch, on every rank
        # One process: the loop state saved here is the same as a periodic save's, which resumes
        # exactly. Under DDP the save waits for `on_exception`, which every rank reaches together.
        if self.save_on_signal and trainer.world_size == 1 and trainer.received_sigterm:
            path = self.save_last_now(trainer)
            if path and trainer.is_global_zero:
                log.warning("termination signal: saved %s at global step %d; resume with --ckpt_path last",
                            path, trainer.global_step)  # fmt: skip

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._should_save_on_train_epoch_end(trainer):
            self.save_last_now(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_save_on_train_epoch_end(trainer):
            self.save_last_now(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_usr1()
        # Only a termination signal saves here: after any other error the state may be what broke.
        if self.save_on_signal and isinstance(exception, SIGTERMException) and not (
            trainer.sanity_checking or trainer.global_step == 0
        ):
            path = self.save_last_now(trainer)
            if trainer.is_global_zero:
                where = path or self.last_path
                log.warning("termination signal: %s holds global step %d; resume with --ckpt_path last",
                            where, trainer.global_step)  # fmt: skip
        # Lightning skips the callbacks' teardown after an exception: stand the watchdog down here, once the
        # save it guards is done, or its timer would end a process that outlives the fit (a notebook, pytest).
        self._stop_watchdog()

    # ---- signals -----------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # After Lightning registered its handlers (SLURM requeue on USR1, its SIGTERM notifier).
        if not _is_main_thread():
            return
        self._signalled = False
        self._agree_on_stop = replace_sigterm_notifier(trainer, lambda signum, frame: self._on_sigterm(trainer, signum))
        if self.save_on_signal and hasattr(signal, "SIGUSR1"):
            self._prev_usr1 = signal.getsignal(signal.SIGUSR1)
            signal.signal(signal.SIGUSR1, self._on_usr1)
            self._usr1_installed = True
        if self.signal_timeout_s is not None and self._watchdog is None:
            watched = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if s is not None)
            watchdog = SignalWatchdog(self.signal_timeout_s, watched, on_expire=lambda: end_launched_ranks(trainer))
            if watchdog.install():
                self._watchdog = watchdog

    def _on_sigterm(self, trainer: L.Trainer, signum: int) -> None:
        """Lightning's notifier minus its in-handler broadcast: record the signal, pass it on to the
        ranks this process launched; one process stops at this batch's end right away."""
        log.info("[rank %d] received signal %d; stopping at the end of this training batch", trainer.global_rank,
                 signum)  # fmt: skip
        if not self._signalled:
            forward_signal_to_launched_ranks(trainer, signum)
        self._signalled = True
        if trainer.world_size == 1:
            mark_sigterm(trainer)

    def _on_usr1(self, signum: int, frame: Any) -> None:
        if callable(self._prev_usr1):
            self._prev_usr1(signum, frame)
        # Same path as SIGTERM (the handler installed above; it also tells DDP children).
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):
            handler(signal.SIGTERM, frame)
        else:  # no fit in progress any more: nothing to save, behave like the default action
            raise SystemExit(128 + signum)

    def _restore_usr1(self) -> None:
        if self._usr1_installed and _is_main_thread():
            if signal.getsignal(signal.SIGUSR1) == self._on_usr1:
                signal.signal(signal.SIGUSR1, self._prev_usr1 if self._prev_usr1 is not None else signal.SIG_DFL)
            self._usr1_installed = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_usr1()
        self.save_last_now(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_usr1()
        self._stop_watchdog()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.uninstall()
            self._watchdog = None
