"""Per-step learning-rate factor: linear warm-up, then cosine or linear decay to a floor."""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

Schedule = Literal["cosine", "linear", "constant"]


def resolve_warmup_steps(warmup: int | float, total_steps: int | float) -> int:
    """An int is a step count; a float in [0, 1] is a fraction of `total_steps`."""
    if isinstance(warmup, bool):
        raise TypeError("warmup_steps must be an int (steps) or a float fraction, not a bool")
    if isinstance(warmup, float):
        if not 0.0 <= warmup <= 1.0:
            raise ValueError(f"a float warmup_steps is a fraction of the run and must lie in [0, 1] (got {warmup})")
        if math.isinf(total_steps):
            raise ValueError("a fractional warmup_steps needs a finite run length (set max_epochs or max_steps)")
        return int(round(warmup * total_steps))
    if warmup < 0:
        raise ValueError(f"warmup_steps must be >= 0 (got {warmup})")
    return int(warmup)


def warmup_schedule(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int | float,
    schedule: Schedule = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """LR multiplier at optimizer step `step` (0-based, the number of steps already taken).

    Rises linearly 0 -> 1 over `warmup_steps`, then decays to `min_lr_ratio` at `total_steps`
    (cosine or linear), or stays at 1 (`constant`).
    """
    if step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule not in ("cosine", "linear"):
        raise ValueError(f"unknown schedule {schedule!r}; choose 'cosine', 'linear' or 'constant'")
    decay_steps = total_steps - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(
    optimizer: Optimizer,
    *,
    warmup_steps: int | float,
    total_steps: int | float,
    schedule: Schedule = "cosine",
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A `LambdaLR` stepped once per optimizer step.

    The factor is a `functools.partial` on purpose: `LambdaLR.state_dict` stores a callable
    object's `__dict__` (empty for a partial) and restores it on load, so the horizon is always
    recomputed from the current Trainer rather than frozen from the checkpoint, and the checkpoint
    stays plain data for `torch.load(weights_only=True)`.
    """
    if schedule != "constant" and math.isinf(total_steps):
        raise ValueError(f"schedule={schedule!r} needs a finite run length (set max_epochs or max_steps)")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must lie in [0, 1] (got {min_lr_ratio})")
    warmup = resolve_warmup_steps(warmup_steps, total_steps)
    fn = functools.partial(
        warmup_schedule, warmup_steps=warmup, total_steps=total_steps, schedule=schedule, min_lr_ratio=min_lr_ratio
    )
    return LambdaLR(optimizer, fn)


def lightning_schedule(
    optimizer: Optimizer, trainer: Any, warmup_steps: int | float, schedule: Schedule, min_lr_ratio: float
) -> dict[str, Any]:
    """`configure_optimizers`' return value: the optimizer and `build_scheduler` over the trainer's
    whole run (`estimated_stepping_batches`), stepped every optimizer step."""
    total = trainer.estimated_stepping_batches
    total = total if math.isinf(total) else int(total)
    scheduler = build_scheduler(
        optimizer, warmup_steps=warmup_steps, total_steps=total, schedule=schedule, min_lr_ratio=min_lr_ratio
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
