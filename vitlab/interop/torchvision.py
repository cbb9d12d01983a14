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
_SUB = {
    "ln_1.weight": "norm1.weight",
    "ln_1.bias": "norm1.bias",
    "self_attention.in_proj_weight": "attn.qkv.weight",
    "self_attention.in_proj_bias": "attn.qkv.bias",
    "self_attention.out_proj.weight": "attn.proj.weight",
    "self_attention.out_proj.bias": "attn.proj.bias",
    "ln_2.weight": "norm2.weight",
    "ln_2.bias": "norm2.bias",
    "mlp.0.weight": "mlp.fc1.weight",
    "mlp.0.bias": "mlp.fc1.bias",
    "mlp.3.weight": "mlp.fc2.weight",
    "mlp.3.bias": "mlp.fc2.bias",
    "mlp.linear_1.weight": "mlp.fc1.weight",  # MLPBlock names before torchvision 0.13
    "mlp.linear_1.bias": "mlp.fc1.bias",
    "mlp.linear_2.weight": "mlp.fc2.weight",
    "mlp.linear_2.bias": "mlp.fc2.bias",
}
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
        elif (m := _BLOCK.match(key)) and m.group(2) in _SUB:
            conv.put(f"blocks.{m.group(1)}.{_SUB[m.group(2)]}", src.take(key), key)
    src.finish()
    w = conv.state_dict.get("patch_embed.proj.weight")
    pos = conv.state_dict.get("pos_embed")
    swag = False
    if w is not None and pos is not None and w.ndim == 4 and pos.ndim == 3:
        side = round((pos.shape[1] - 1) ** 0.5)
        swag = side * w.shape[-1] > 224
    conv.data_config = dict(DATA_CONFIG_SWAG if swag else DATA_CONFIG)
    return conv
