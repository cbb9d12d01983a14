"""What one optimizer step shares between clipping (objectives) and the non-finite guard (reliability): the
total gradient norm, computed once per step, and the device-side skip flag. It imports neither room."""

from __future__ import annotations

from typing import Any

import torch

_STEP_VALUES = "_vitlab_step_values"  # per-step values kept on the optimizer, dropped after its step


def step_values(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A dict on `optimizer` for values of its coming step, emptied by a step post-hook."""
    values = optimizer.__dict__.get(_STEP_VALUES)
    if values is None:
        values = optimizer.__dict__[_STEP_VALUES] = {}
        optimizer.register_step_post_hook(_end_step)
    return values


def _end_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    values = optimizer.__dict__[_STEP_VALUES]
    # Only the skip flag this module set: a GradScaler sets and deletes its own.
    if "found_inf" in values and optimizer.__dict__.get("found_inf") is values["found_inf"]:
        del optimizer.found_inf
    values.clear()


def grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """Total 2-norm (float32, on the device, no host sync) of the gradients `optimizer` is about to apply;
    None without gradients. Computed once per step, so read it after any change to the gradients but clipping."""
    values = step_values(optimizer)
    if "grad_norm" not in values:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        values["grad_norm"] = torch.nn.utils.get_total_norm(grads, 2.0).float() if grads else None
    return values["grad_norm"]


def set_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> bool:
    """Make the optimizer's coming step a no-op on the device when `found_inf` (0-dim float32) is 1, as a
    GradScaler does for fused optimizers (`_step_supports_amp_scaling`): no host sync. False (nothing set)
    for other optimizers, or when something else already set one."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or hasattr(optimizer, "found_inf"):
        return False
    step_values(optimizer)["found_inf"] = found_inf
    optimizer.found_inf = found_inf
    return True
