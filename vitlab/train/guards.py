"""Guards that fail a run early and clearly instead of late and silently: a NaN/Inf loss never reaches
the weights, and a run folder that cannot be written (or a disk without room for a few checkpoints)
fails at the start, not at the first save hours in."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, WeightAveraging

from vitlab.train.last_checkpoint import LastCheckpoint

log = logging.getLogger("vitlab")


# ---- non-finite loss ----------------------------------------------------------------------------


class NonFiniteLossError(RuntimeError):
    """Training hit a NaN/Inf loss or gradient; the message names the step, LR and last good checkpoint."""


class NonFiniteGuard(Callback):
    """Keeps a NaN/Inf loss (or, without a GradScaler, a NaN/Inf gradient) from reaching the weights.

    The check runs after backward and before the optimizer step (`on_before_optimizer_step`), so the
    bad step is never applied. `action="stop"` raises `NonFiniteLossError` naming the global step, the
    learning rate and the last good checkpoint (nothing is saved: last.ckpt keeps the last good
    state). `action="skip"` drops the gradients instead (torch optimizers leave parameters whose
    `.grad` is None untouched: no update, no weight decay, no moment update) and carries on; after
    `max_skips` skipped steps in the run, the next one stops. A skipped batch still counts as a global
    step and advances the LR schedule.

    Costs one host-device synchronisation per optimizer step. With fp16 AMP the GradScaler already
    skips steps with overflowing gradients, so only the loss is checked there.
    """

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_skips: int = 0, check_grads: bool = True) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"NonFiniteGuard action must be 'stop' or 'skip', got {action!r}")
        if max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {max_skips}")
        self.action = action
        self.max_skips = max_skips
        self.check_grads = check_grads
        self.skipped = 0
        self._bad_loss: float | None = None  # the first non-finite loss since the last optimizer step

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._bad_loss is None and not bool(torch.isfinite(loss.detach()).all()):
            self._bad_loss = float(loss.detach().float().reshape(-1)[0])

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        what = None
        if self._bad_loss is not None:
            what = f"loss is {self._bad_loss}"
        elif self.check_grads and getattr(trainer.precision_plugin, "scaler", None) is None:
            bad = _nonfinite_grad(optimizer)
            if bad is not None:
                what = f"gradient of {bad} is not finite (loss was finite)"
        self._bad_loss = None
        # Every rank must take the same decision, or their optimizer steps (and collectives) diverge.
        bad_anywhere = trainer.strategy.reduce_boolean_decision(what is not None, all=False)
        if not bad_anywhere:
            return
        what = what or "another rank saw a non-finite loss or gradient"
        if self.action == "skip" and self.skipped < self.max_skips:
            optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            if trainer.is_global_zero:
                log.warning("NonFiniteGuard: %s at global step %d; skipped this optimizer step (%d of max_skips=%d)",
                            what, trainer.global_step, self.skipped, self.max_skips)  # fmt: skip
            return
        optimizer.zero_grad(set_to_none=True)  # whatever happens next, these gradients must not be applied
        raise NonFiniteLossError(self._message(trainer, optimizer, what))

    def _message(self, trainer: L.Trainer, optimizer: torch.optim.Optimizer, what: str) -> str:
        lrs = sorted({float(g["lr"]) for g in optimizer.param_groups})
        lr = f"{lrs[-1]:.6g}" if len(lrs) == 1 else f"{lrs[-1]:.6g} (groups {lrs[0]:.6g}..{lrs[-1]:.6g})"
        ckpt = last_good_checkpoint(trainer)
        where = f"last good checkpoint: {ckpt}" if ckpt else "no checkpoint has been saved yet"
        skipped = ""
        if self.action == "skip":
            skipped = f" after skipping {self.skipped} step(s) (max_skips={self.max_skips})"
        return (
            f"non-finite training: {what} at global step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch {trainer.fit_loop.epoch_loop.batch_idx}), learning rate {lr}{skipped}. The step was not applied "
            f"and nothing was saved; {where}. Resume from it with --ckpt_path after lowering the learning rate or "
            "fixing the data, or use NonFiniteGuard(action='skip', max_skips=N) to skip such batches."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))


def _nonfinite_grad(optimizer: torch.optim.Optimizer) -> str | None:
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return None
    # One fused reduction (and one sync) instead of one per tensor.
    norms = torch._foreach_norm(grads) if hasattr(torch, "_foreach_norm") else [g.norm() for g in grads]
    if bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):
        return None
    for g in optimizer.param_groups:
        for i, p in enumerate(g["params"]):
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return f"parameter {i} of a group with lr {g['lr']:.3g} (shape {tuple(p.shape)})"
    return "a parameter"


def last_good_checkpoint(trainer: L.Trainer) -> str | None:
    """The most recent checkpoint file the run's checkpoint callbacks wrote (last.ckpt first)."""
    candidates: list[str] = []
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    callbacks.sort(key=lambda cb: not isinstance(cb, LastCheckpoint))
    for cb in callbacks:
        candidates += [cb.last_model_path, cb.best_model_path]
    existing = [p for p in candidates if p and os.path.isfile(p)]
    return max(existing, key=os.path.getmtime) if existing else None


# ---- run folder and disk space ----------------------------------------------------------------------


class RunDirError(RuntimeError):
    """The run folder cannot be written, or its disk lacks room for the run's checkpoints."""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_run_dir(run_dir: _PATH, need_bytes: int = 0, what: str = "") -> None:
    """Create `run_dir` if needed, prove it writable (create + delete a probe file) and, when
    `need_bytes` > 0, that its filesystem has that much free space. Raises RunDirError otherwise."""
    run_dir = str(run_dir)
    if not _is_local_file_protocol(run_dir):
        return  # remote stores: no cheap, meaningful probe
    path = Path(run_dir).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".vitlab-write-probe-")
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise RunDirError(
            f"run folder {path} is not writable ({type(exc).__name__}: {exc.strerror or exc}); "
            "choose another --run_dir or fix its permissions"
        ) from exc
    if need_bytes > 0:
        free = shutil.disk_usage(path).free
        if free < need_bytes:
            raise RunDirError(
                f"not enough free disk space for run folder {path}: about {_fmt_bytes(need_bytes)} needed"
                f"{' (' + what + ')' if what else ''}, {_fmt_bytes(free)} available; free some space or "
                "choose another --run_dir"
            )


def checkpoint_size_estimate(pl_module: torch.nn.Module, optimizer_slots: float = 2.0, averaged: bool = False) -> int:
    """Bytes one training checkpoint takes: weights + buffers + optimizer state (`optimizer_slots`
    copies of the trainable weights: 2 for Adam/AdamW, 1 for SGD with momentum) + an averaged copy
    (EMA) when `averaged`."""
    weights = sum(t.numel() * t.element_size() for t in pl_module.parameters())
    weights += sum(t.numel() * t.element_size() for t in pl_module.buffers())
    trainable = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
    return int(weights + optimizer_slots * trainable + (weights if averaged else 0))


class RunDirCheck(Callback):
    """At the start of fit (rank 0 checks, every rank raises): the run folder is writable and its disk
    has room for `keep` checkpoints (best, last and the temporary copy of an atomic write) plus
    `margin_bytes` for logs. `run_dir` defaults to the trainer's default_root_dir."""

    def __init__(self, run_dir: _PATH | None = None, keep: int = 3, margin_bytes: int = 64 * 2**20) -> None:
        self.run_dir = run_dir
        self.keep = keep
        self.margin_bytes = margin_bytes

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        error = None
        if trainer.is_global_zero:
            run_dir = self.run_dir if self.run_dir is not None else trainer.default_root_dir
            hp = getattr(pl_module, "hparams", {})
            slots = 1.0 if hp.get("optimizer") == "sgd" else 2.0
            averaged = any(isinstance(cb, WeightAveraging) for cb in trainer.callbacks)
            per_ckpt = checkpoint_size_estimate(pl_module, slots, averaged)
            need = self.keep * per_ckpt + self.margin_bytes
            what = f"{self.keep} checkpoints of ~{_fmt_bytes(per_ckpt)} (weights + optimizer state) + logs"
            try:
                check_run_dir(run_dir, need, what)
            except RunDirError as exc:
                error = str(exc)
        error = trainer.strategy.broadcast(error, src=0)
        if error:
            raise RunDirError(error)
