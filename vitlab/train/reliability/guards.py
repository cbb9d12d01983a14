"""`NonFiniteGuard`: a NaN/Inf loss or gradient never reaches the weights (the run folder's check: run_dir.py)."""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from vitlab.train.grad_step import grad_norm, set_found_inf

log = logging.getLogger("vitlab")


class NonFiniteLossError(RuntimeError):
    """Training hit a NaN/Inf loss or gradient; the message names the step, LR and last good checkpoint."""


class NonFiniteGuard(Callback):
    """Keeps a NaN/Inf loss (or, without a GradScaler, gradient) from reaching the weights.

    Checked after backward, before the optimizer step. `action="stop"` raises `NonFiniteLossError` naming
    the first bad step, its learning rate and the last good checkpoint; `action="skip"` leaves bad steps
    out (they still count as global steps) and stops at the bad step after `max_skips`.

    Fused optimizers without a GradScaler (vitlab's default) are checked on the device, with no host sync:
    the flag goes to the optimizer as `found_inf` (what a GradScaler hands fused optimizers) and stays set
    after a stop. The host reads it every `check_every_n_steps` steps (default `log_every_n_steps`), before
    any checkpoint save and at the end. Others (foreach, DTensors, GradScaler runs, the first step of fused
    SGD with momentum) are read on the host every step and a bad step's gradients dropped. Under DDP the
    flag is all-reduced (max) on the device, so all ranks skip or stop at the same step.
    """

    def __init__(
        self, action: Literal["stop", "skip"] = "stop", max_skips: int = 0, check_grads: bool = True,
        check_every_n_steps: int | None = None,
    ) -> None:  # fmt: skip
        if action not in ("stop", "skip"):
            raise ValueError(f"NonFiniteGuard action must be 'stop' or 'skip', got {action!r}")
        if max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {max_skips}")
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1 or None, got {check_every_n_steps}")
        self.action = action
        self.max_skips = max_skips
        self.check_grads = check_grads
        self.check_every_n_steps = check_every_n_steps
        self.skipped = 0
        # Device state, made at the first check: [bad steps in the run, step offset of the stop (-1: none),
        # the stop's loss, the stop's gradient flag, first skipped step offset since the last look (-1),
        # the latest step's found_inf]; offsets count from `_base_step`.
        self._state: torch.Tensor | None = None
        self._loss_bad: torch.Tensor | None = None  # any non-finite loss since the last optimizer step
        self._loss: torch.Tensor | None = None  # the first non-finite loss since then (else the last loss)
        self._base_step = 0  # the global step the offsets count from (the last look)
        self._steps: dict[int, tuple[int, int, str]] = {}  # global step -> (epoch, batch, lr), since the look

    @property
    def _limit(self) -> int:
        return self.max_skips if self.action == "skip" else 0

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach().float().reshape(-1)[0]
        bad = (~torch.isfinite(loss)).float()
        if self._loss_bad is None:
            self._loss_bad, self._loss = bad, loss
        else:  # gradient accumulation: keep the first bad loss of the step
            self._loss = torch.where(self._loss_bad > 0, self._loss, loss)
            self._loss_bad = torch.maximum(self._loss_bad, bad)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = trainer.global_step
        if self._state is None:
            self._state = torch.tensor([float(self.skipped), -1.0, 0.0, 0.0, -1.0, 0.0], device=pl_module.device)
            self._base_step = step
        lrs = sorted({float(g["lr"]) for g in optimizer.param_groups})
        lr = f"{lrs[-1]:.6g}" if len(lrs) == 1 else f"{lrs[-1]:.6g} (groups {lrs[0]:.6g}..{lrs[-1]:.6g})"
        self._steps[step] = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx, lr)

        scaler = getattr(trainer.precision_plugin, "scaler", None)
        norm = grad_norm(optimizer) if self.check_grads and scaler is None else None
        grad_bad = (~torch.isfinite(norm)).float() if norm is not None else torch.zeros_like(self._state[0])
        loss_bad = self._loss_bad if self._loss_bad is not None else torch.zeros_like(grad_bad)
        loss = self._loss if self._loss is not None else torch.zeros_like(grad_bad)
        self._loss_bad = self._loss = None
        bad = torch.maximum(loss_bad, grad_bad)
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # on the device: no host sync
        found = self._record(bad, loss, grad_bad, step - self._base_step)

        on_device = scaler is None and not _first_sgd_momentum_step(optimizer) and set_found_inf(optimizer, found)
        if not on_device:  # read now, and drop the gradients of a bad step
            if self._look(trainer, optimizer, current=True):
                optimizer.zero_grad(set_to_none=True)
        elif (step + 1) % (self.check_every_n_steps or trainer.log_every_n_steps or 1) == 0:
            self._look(trainer, optimizer)

    def _record(self, bad: torch.Tensor, loss: torch.Tensor, grad_bad: torch.Tensor, offset: int) -> torch.Tensor:
        """Update the device state with this step's flag; returns the step's `found_inf` (1.0: skip it)."""
        s = self._state
        stopped_before = s[1] >= 0
        count = s[0] + bad
        over = count > self._limit
        new_stop = over & ~stopped_before
        s[0] = count
        s[1] = torch.where(new_stop, offset, s[1])
        s[2] = torch.where(new_stop, loss, s[2])
        s[3] = torch.where(new_stop, grad_bad, s[3])
        s[4] = torch.where((bad > 0) & ~over & (s[4] < 0), offset, s[4])
        s[5] = torch.maximum(bad, over.float())  # after a stop every later step is skipped too
        return s[5]

    def _look(self, trainer: L.Trainer, optimizer: torch.optim.Optimizer | None, current: bool = False) -> bool:
        """Read the device state (one sync): log the skips since the last look, raise for a stop.
        With `current`, returns whether the step now being taken is a bad one."""
        if self._state is None:
            return False
        count, stop_off, stop_loss, stop_grad, first_off, found = self._state.tolist()
        skipped = min(int(count), self._limit)
        new_skips = skipped - self.skipped
        if new_skips > 0 and trainer.is_global_zero:
            first = self._base_step + int(first_off)
            epoch, batch, lr = self._steps.get(first, (trainer.current_epoch, -1, "?"))
            log.warning("NonFiniteGuard: non-finite loss or gradient; skipped %d optimizer step(s) from global step "
                        "%d (epoch %d, batch %d, learning rate %s); %d of max_skips=%d used", new_skips, first, epoch,
                        batch, lr, skipped, self.max_skips)  # fmt: skip
        self.skipped = skipped
        if stop_off >= 0:
            stop = self._base_step + int(stop_off)
            if not math.isfinite(stop_loss) or stop_grad == 0:
                what = f"loss is {stop_loss}"
            else:
                # the gradients of the stop step are still there when it is the step now being taken
                here = current and optimizer is not None and stop == trainer.global_step
                detail = _nonfinite_grad(optimizer) if here else None
                what = f"gradient of {detail or 'a parameter'} is not finite (loss was finite)"
            raise NonFiniteLossError(self._message(trainer, stop, what))
        self._state[4] = -1.0
        self._base_step = trainer.global_step
        self._steps.clear()
        return current and found > 0

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # No checkpoint may hold a step taken after a stop; and the skip count saved must be current.
        self._look(trainer, None)
        if "callbacks" in checkpoint and self.state_key in checkpoint["callbacks"]:
            checkpoint["callbacks"][self.state_key] = self.state_dict()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._look(trainer, None)

    def _message(self, trainer: L.Trainer, step: int, what: str) -> str:
        epoch, batch, lr = self._steps.get(step, (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx, "?"))
        saved = [p for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)
                 for p in (cb.last_model_path, cb.best_model_path) if p and os.path.isfile(p)]  # fmt: skip
        ckpt = max(saved, key=os.path.getmtime) if saved else None  # the newest
        where = f"last good checkpoint: {ckpt}" if ckpt else "no checkpoint has been saved yet"
        skipped = (f" after skipping {self.skipped} step(s) (max_skips={self.max_skips})"
                   if self.action == "skip" else "")  # fmt: skip
        return (
            f"non-finite training: {what} at global step {step} (epoch {epoch}, batch {batch}), learning rate "
            f"{lr}{skipped}. That step and any after it were not applied and nothing was saved; {where}. Resume "
            "from it with --ckpt_path after lowering the learning rate or fixing the data, or use "
            "NonFiniteGuard(action='skip', max_skips=N) to skip such batches."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self._state = None  # made again from `skipped` at the next step


def _nonfinite_grad(optimizer: torch.optim.Optimizer) -> str | None:
    """Which gradient is not finite, for the error message (host reads: only once a run fails)."""
    for g in optimizer.param_groups:
        for i, p in enumerate(g["params"]):
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return f"parameter {i} of a group with lr {g['lr']:.3g} (shape {tuple(p.shape)})"
    return None


def _first_sgd_momentum_step(optimizer: torch.optim.Optimizer) -> bool:
    """Fused SGD makes its momentum buffers with `empty_like` at the first step and fills them in the
    kernel: skipping that step on the device would leave them uninitialised."""
    return isinstance(optimizer, torch.optim.SGD) and any(
        g["momentum"] and p.grad is not None and optimizer.state.get(p, {}).get("momentum_buffer") is None
        for g in optimizer.param_groups
        for p in g["params"]
    )
