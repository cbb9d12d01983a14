"""timm ViT state dicts (and vitlab weights without a config: the parameter names are the same).

Handles the `model` / `state_dict` wrappers of timm's training checkpoints, DDP / torch.compile
name prefixes, and the patch embedding of old timm checkpoints stored as a linear layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from vitlab.interop.base import TIMM_RESAMPLE, Converted, Source, strip_prefix

FORMAT = "timm"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")

# timm's augreg ViT weights: Inception mean/std, bicubic resize, crop 0.9.
DATA_CONFIG: dict[str, Any] = {
    "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bicubic", "crop_pct": 0.9, "class_names": None,
}  # fmt: skip


def looks_like(keys: list[str]) -> bool:
    names = strip_prefix(keys, *WRAPPER_PREFIXES)
    has_stem = "patch_embed.proj.weight" in names or "patch_embed.convs.0.0.weight" in names
    return has_stem and any(k.startswith("blocks.0.") for k in names)


def _sidecar_data(sidecar: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Hints and data config from a timm hub `config.json` (`pretrained_cfg`), when present."""
    if not sidecar or not isinstance(sidecar.get("pretrained_cfg"), Mapping):
        return {}, {}
    pc = sidecar["pretrained_cfg"]
    data = {k: pc[k] for k in ("mean", "std", "interpolation", "crop_pct") if k in pc}
    data = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in data.items()}
    if isinstance(sidecar.get("label_names"), list):
        data["class_names"] = list(sidecar["label_names"])
    hints: dict[str, Any] = {}
    size = pc.get("input_size")
    if isinstance(size, (list, tuple)) and len(size) == 3:
        hints["img_size"] = [int(size[1]), int(size[2])]
    return hints, data


def convert(
    tensors: Mapping[str, torch.Tensor],
    path: str,
    user_config: Mapping[str, Any],
    sidecar: Mapping[str, Any] | None = None,
    format: str = FORMAT,
) -> Converted:
    names = strip_prefix(tensors, *WRAPPER_PREFIXES)
    src = Source(tensors, format, path)
    hints, data = _sidecar_data(sidecar) if format == FORMAT else ({}, {})
    conv = Converted(format, {}, path, hints=hints, data_config={**DATA_CONFIG, **data}, resample=dict(TIMM_RESAMPLE))
    for new, old in names.items():
        t = src.take(old)
        if new == "patch_embed.proj.weight" and t.ndim == 2 and "patch_embed.norm.weight" not in names:
            t = _linear_patch_to_conv(t, int(user_config.get("in_chans", 3)), src)
        conv.put(new, t, old)
    return conv


def _linear_patch_to_conv(w: torch.Tensor, in_chans: int, src: Source) -> torch.Tensor:
    # Old timm weights patchified by hand, flattening each patch channel-first (C, p, p).
    dim, fan_in = w.shape
    patch = math.isqrt(fan_in // in_chans)
    if in_chans * patch * patch != fan_in:
        raise src.error(
            f"linear patch_embed.proj.weight {tuple(w.shape)} is no in_chans={in_chans} x p x p patch "
            f"projection; pass config={{'in_chans': ...}}"
        )
    return w.reshape(dim, in_chans, patch, patch)
