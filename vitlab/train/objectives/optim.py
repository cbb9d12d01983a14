"""Optimizer parameter groups (weight-decay split, layer-wise LR decay), the optimizer itself, gradient
clipping that keeps fused kernels under bf16 (with the step's shared gradient norm, `grad_step`), and
`ViTOptimization`, the base of vitlab's LightningModules: the one declaration of the optimizer settings."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

import lightning as L
import torch
import torch.nn as nn
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from vitlab.train.grad_step import grad_norm
from vitlab.train.objectives.schedule import Schedule, lightning_schedule

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


def kernel_kwargs(params: Iterable[torch.Tensor], fused: bool = True) -> dict[str, bool]:
    """Fused kernels when every parameter is a plain dense float tensor on a device that has them (and
    `fused`), else the foreach (multi-tensor) kernels, which torch does not pick by itself on the CPU."""
    params = list(params)
    plain = all(type(p) in (nn.Parameter, torch.Tensor) and p.is_floating_point() and not p.is_sparse for p in params)
    if not params or not plain:
        return {}  # torch picks what it can (e.g. DTensors under FSDP2)
    if fused and all(p.device.type in set(_get_fused_kernels_supported_devices()) for p in params):
        return {"fused": True}
    return {"foreach": True}


def fused_allowed(trainer: L.Trainer | None) -> bool:
    """Whether this run may use a fused optimizer: not with a GradScaler (16-mixed) and gradient clipping.

    A fused optimizer unscales the gradients inside its step, so the gradients clipping sees would still
    be scaled; the foreach optimizer lets Lightning's `scaler.unscale_` run before clipping instead.
    bf16 and float32 runs scale nothing, so they keep the fused kernels (`clip_gradients` clips there).
    """
    if trainer is None:
        return True
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler is None or not trainer.gradient_clip_val


def build_optimizer(
    groups: list[dict[str, Any]],
    optimizer: OptimizerName = "adamw",
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    betas: tuple[float, float] = (0.9, 0.999),
    momentum: float = 0.9,
    fused: bool = True,
) -> torch.optim.Optimizer:
    """AdamW (the paper's pretraining optimizer) or SGD with momentum (its fine-tuning one) over `groups`
    (`param_groups`), with fused kernels where the parameters allow them and `fused` (see `fused_allowed`),
    else foreach ones."""
    if not groups:
        raise ValueError("the model has no trainable parameters")
    impl = kernel_kwargs((p for g in groups for _, p in g["params"]), fused)
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay, **impl)
    if optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, **impl)
    raise ValueError(f"unknown optimizer {optimizer!r}; choose 'adamw' or 'sgd'")


def clip_gradients(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    clip_val: float | None,
    algorithm: str | GradClipAlgorithmType | None,
) -> None:
    """Gradient clipping for `LightningModule.configure_gradient_clipping`.

    Lightning's `MixedPrecision` refuses to clip for any optimizer that unscales in its step (fused
    AdamW/SGD), even under bf16, where no GradScaler exists and the gradients are the true ones. Where
    the gradients in `.grad` are the true ones (no scaler, or the scaler already unscaled them) under
    Lightning's plain, mixed or half precision, clip here (foreach kernels, with the shared
    `grad_norm`, no host sync); everything else (FSDP, DeepSpeed, custom plugins) keeps Lightning's path.
    """
    if not clip_val or clip_val <= 0:
        return
    algorithm = GradClipAlgorithmType(algorithm or GradClipAlgorithmType.NORM)
    plugin = module.trainer.precision_plugin
    unscaled = getattr(plugin, "scaler", None) is None or not _optimizer_handles_unscaling(optimizer)
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision) or not unscaled:
        module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm.value)
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if algorithm == GradClipAlgorithmType.VALUE:
        torch.nn.utils.clip_grad_value_(params, clip_val)
        return
    norm = grad_norm(optimizer)
    if norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, norm)


# Each setting's valid values: (test, what it must be, an example). Checked when the module is built, so a bad
# value stops the run before the data is read (the optimizer and schedule are built after the data's setup).
_RULES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "optimizer": (lambda v: v in get_args(OptimizerName), "choose adamw or sgd", "adamw"),
    "lr": (lambda v: v > 0, "the learning rate must be a positive number", "1e-3"),
    "weight_decay": (lambda v: v >= 0, "weight_decay must be 0 or more", "0.05 (0 turns it off)"),
    "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "each beta must be in [0, 1)", "[0.9,0.999]"),
    "momentum": (lambda v: v >= 0, "momentum must be 0 or more", "0.9"),
    "warmup_steps": (
        lambda v: not isinstance(v, bool) and (0 <= v <= 1 if isinstance(v, float) else v >= 0),
        "warmup_steps is a step count (an int, 0 or more) or a fraction of the run (a float in [0, 1])", "0.05",
    ),
    "schedule": (lambda v: v in get_args(Schedule), "choose cosine, linear or constant", "cosine"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "min_lr_ratio, the final fraction of the lr, must lie in [0, 1]", "0.0"),
    "layer_decay": (lambda v: v is None or 0 < v <= 1, "layer_decay must lie in (0, 1] (null: off)", "0.75"),
}


def check_optimizer_settings(settings: dict[str, Any]) -> None:
    """A one-line ValueError naming the first setting outside its valid values (`_RULES`), with an example.
    Settings are named by their recipe key (`--model.lr`), where users set them."""
    for key, value in settings.items():
        test, rule, example = _RULES[key]
        try:
            valid = test(value)
        except TypeError:  # e.g. a string lr from Python code
            valid = False
        if not valid:
            shown = list(value) if isinstance(value, tuple) else value
            raise ValueError(f"--model.{key}={shown}: {rule}, e.g. --model.{key}={example}")


class ViTOptimization(L.LightningModule):
    """The base of vitlab's objectives: the optimizer and LR-schedule settings, declared once here.

    The objectives take these through `**kwargs` and pass them to `super().__init__`; jsonargparse follows
    that call to this signature, so a recipe sets them flat under `model:` (`model.lr`), and a checkpoint's
    flat hyperparameters load back through the same keywords. Also `configure_optimizers` and
    `configure_gradient_clipping`; the parameter groups are `optimizer_groups()`, by default those of `self.model`.

    Args:
        optimizer: AdamW (the paper's pretraining optimizer) or SGD with momentum (its fine-tuning one).
        lr: the peak learning rate, reached after the warm-up.
        weight_decay: decoupled (AdamW) or L2 (SGD) decay of the linear and convolution weights only.
        betas: AdamW's moment coefficients.
        momentum: SGD's momentum.
        warmup_steps: linear warm-up, in optimizer steps (int) or as a fraction of the run (float in [0, 1]).
        schedule: the decay after the warm-up, to `min_lr_ratio * lr` at the run's last step.
        min_lr_ratio: the final learning rate as a fraction of `lr`.
        layer_decay: layer-wise LR decay, `lr * layer_decay ** (depth + 1 - layer)`; None: off.
    """

    def __init__(
        self,
        optimizer: OptimizerName = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        momentum: float = 0.9,
        warmup_steps: int | float = 0,
        schedule: Schedule = "cosine",
        min_lr_ratio: float = 0.0,
        layer_decay: float | None = None,
    ) -> None:
        check_optimizer_settings({k: v for k, v in locals().items() if k in _RULES})
        super().__init__()
        # Lightning collects these and the subclasses' arguments (their frames' too) into `hparams`.
        self.save_hyperparameters()

    def optimizer_groups(self) -> list[dict[str, Any]]:
        hp = self.hparams
        return param_groups(self.model, hp.weight_decay, layer_decay=hp.layer_decay, lr=hp.lr)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = build_optimizer(
            self.optimizer_groups(), hp.optimizer, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
            momentum=hp.momentum, fused=fused_allowed(self._trainer),
        )  # fmt: skip
        return lightning_schedule(optimizer, self.trainer, hp.warmup_steps, hp.schedule, hp.min_lr_ratio)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:  # fmt: skip
        # vitlab's clipping keeps fused AdamW/SGD under bf16 (Lightning's refuses them); see clip_gradients.
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)
