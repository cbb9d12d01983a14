"""Optimizer parameter groups (weight-decay split, layer-wise LR decay) and the optimizer itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn as nn

try:  # private helper; the fallback covers a torch that moves it
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
except ImportError:  # pragma: no cover

    def _get_fused_kernels_supported_devices() -> list[str]:
        return ["cuda"]

OptimizerName = Literal["adamw", "sgd"]


# Path parts that wrappers insert: torch.compile(model), FSDP (use_orig_params), activation checkpointing.
_WRAPPER_PARTS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def _clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def layer_id(name: str, depth: int) -> int:
    """Depth index for layer-wise LR decay: tokenizer/cls/pos 0, block i -> i + 1, the rest depth + 1."""
    if name.startswith(("patch_embed.", "cls_token", "dist_token", "pos_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def param_groups(
    model: nn.Module,
    weight_decay: float,
    layer_decay: float | None = None,
    lr: float = 1e-3,
) -> list[dict[str, Any]]:
    """Split trainable parameters into decay / no-decay groups, one pair per layer under `layer_decay`.

    Decay for the weights of linear and convolution layers only, except the names in
    `model.no_weight_decay()`: norms, biases and scalar temperatures take none. Decided by module
    type, not `p.ndim`: under FSDP a parameter is a 1-D slice of its shard, so its ndim says nothing.
    Frozen parameters (e.g. a fixed sin-cos position embedding) are left out. Each group carries `param_names` (kept by torch optimizers) and
    `lr_scale`, the layer-decay multiplier already applied to its `lr`.
    """
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    depth = len(model.blocks) if hasattr(model, "blocks") else 0
    layers = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    decayed = {
        _clean_name(f"{name}.weight" if name else "weight")
        for name, module in model.named_modules()
        if isinstance(module, layers) and getattr(module, "weight", None) is not None
    }
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for raw_name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = _clean_name(raw_name)
        no_decay = name not in decayed or name in skip
        layer = layer_id(name, depth) if layer_decay is not None else 0
        scale = layer_decay ** (depth + 1 - layer) if layer_decay is not None else 1.0
        group = groups.setdefault(
            (layer, no_decay),
            {"params": [], "weight_decay": 0.0 if no_decay else weight_decay, "lr": lr * scale, "lr_scale": scale},
        )
        # (name, tensor) pairs make the optimizer record `param_names` for the group.
        group["params"].append((name, p))
    return [groups[k] for k in sorted(groups)]


def _impl_kwargs(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """Fused kernels when every parameter is a plain dense float tensor on a device that has them."""
    params = list(params)
    supported = set(_get_fused_kernels_supported_devices())
    plain = all(type(p) in (nn.Parameter, torch.Tensor) and p.is_floating_point() and not p.is_sparse for p in params)
    if params and plain and all(p.device.type in supported for p in params):
        return {"fused": True}
    return {}  # torch picks foreach where it can (e.g. DTensors under FSDP2)


def build_optimizer(
    model: nn.Module,
    optimizer: OptimizerName = "adamw",
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    betas: tuple[float, float] = (0.9, 0.999),
    momentum: float = 0.9,
    layer_decay: float | None = None,
) -> torch.optim.Optimizer:
    """AdamW (the paper's pretraining optimizer) or SGD with momentum (its fine-tuning one)."""
    groups = param_groups(model, weight_decay, layer_decay=layer_decay, lr=lr)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    impl = _impl_kwargs(p for g in groups for _, p in g["params"])
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay, **impl)
    if optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, **impl)
    raise ValueError(f"unknown optimizer {optimizer!r}; choose 'adamw' or 'sgd'")
