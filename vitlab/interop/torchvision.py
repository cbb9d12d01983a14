"""torchvision `VisionTransformer` state dicts (`vit_b_16`, `vit_b_32`, `vit_l_*`, `vit_h_14`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from vitlab.constants import IMAGENET_NORM
from vitlab.interop.architecture import Converted, Source

FORMAT = "torchvision"
# ViT_*_Weights.IMAGENET1K_V1: bilinear resize 256, centre crop 224.
DATA_CONFIG: dict[str, Any] = {
    **IMAGENET_NORM, "interpolation": "bilinear", "crop_pct": 224 / 256, "class_names": None
}  # fmt: skip
# The SWAG end-to-end weights (384/512/518 px): bicubic resize straight to the input size.
DATA_CONFIG_SWAG: dict[str, Any] = {**DATA_CONFIG, "interpolation": "bicubic", "crop_pct": 1.0}
# torchvision.models.vision_transformer.interpolate_embeddings: bicubic, align_corners True, no antialias.
RESAMPLE: dict[str, Any] = {"mode": "bicubic", "antialias": False, "align_corners": True}

_BLOCK = re.compile(r"^encoder\.layers\.encoder_layer_(\d+)\.(.+)$")
# Block modules; `self_attention.in_proj_{weight,bias}` are read as `in_proj.{weight,bias}`.
_SUB = {
    "ln_1": "norm1", "self_attention.in_proj": "attn.qkv", "self_attention.out_proj": "attn.proj", "ln_2": "norm2",
    "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2",
    "mlp.linear_1": "mlp.fc1", "mlp.linear_2": "mlp.fc2",  # MLPBlock names before torchvision 0.13
}  # fmt: skip
_TOP = {
    "conv_proj.weight": "patch_embed.proj.weight",
    "conv_proj.bias": "patch_embed.proj.bias",
    "class_token": "cls_token",
    "encoder.pos_embedding": "pos_embed",
    "encoder.ln.weight": "norm.weight",
    "encoder.ln.bias": "norm.bias",
    "heads.head.weight": "head.weight",
    "heads.head.bias": "head.bias",
    "heads.pre_logits.weight": "pre_logits.fc.weight",
    "heads.pre_logits.bias": "pre_logits.fc.bias",
}


def looks_like(keys: list[str]) -> bool:
    return "encoder.pos_embedding" in keys and any(k.startswith("conv_proj.") for k in keys)


def convert(tensors: Mapping[str, torch.Tensor], path: str) -> Converted:
    src = Source(tensors, FORMAT, path)
    conv = Converted(FORMAT, {}, path, config={"norm_eps": 1e-6}, resample=dict(RESAMPLE))
    for key in src.keys():
        if key in _TOP:
            conv.put(_TOP[key], src.take(key), key)
        elif m := _BLOCK.match(key):
            module, _, param = m.group(2).replace("in_proj_", "in_proj.").rpartition(".")
            if module in _SUB and param in ("weight", "bias"):
                conv.put(f"blocks.{m.group(1)}.{_SUB[module]}.{param}", src.take(key), key)
    src.finish()
    w = conv.state_dict.get("patch_embed.proj.weight")
    pos = conv.state_dict.get("pos_embed")
    swag = False
    if w is not None and pos is not None and w.ndim == 4 and pos.ndim == 3:
        side = round((pos.shape[1] - 1) ** 0.5)
        swag = side * w.shape[-1] > 224
    conv.data_config = dict(DATA_CONFIG_SWAG if swag else DATA_CONFIG)
    return conv
