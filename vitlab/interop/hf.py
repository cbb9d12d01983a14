"""Hugging Face transformers ViT (`ViTModel`, `ViTForImageClassification`) state dicts.

Two layouts: the one transformers 4.x used and 5.x still writes to disk
(`encoder.layer.N.attention.attention.query`, `attention.output.dense`, `intermediate.dense`,
`output.dense`) and the 5.x in-memory one (`layers.N.attention.q_proj/k_proj/v_proj/o_proj`,
`mlp.fc1/fc2`); both with or without the `vit.` prefix of the task models.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from vitlab.interop.base import Converted, Source

FORMAT = "hf"
# ViTImageProcessor: mean/std 0.5, bilinear resize straight to the input size (no crop).
DATA_CONFIG: dict[str, Any] = {
    "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bilinear", "crop_pct": 1.0, "class_names": None,
}  # fmt: skip
# ViTEmbeddings.interpolate_pos_encoding: bicubic, align_corners False, no antialias.
RESAMPLE: dict[str, Any] = {"mode": "bicubic", "antialias": False, "align_corners": False}

_PATCH = "embeddings.patch_embeddings.projection.weight"
_BLOCK = re.compile(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$")
_SUB = {
    "layernorm_before": "norm1",
    "layernorm_after": "norm2",
    "attention.o_proj": "attn.proj",
    "attention.output.dense": "attn.proj",
    "mlp.fc1": "mlp.fc1",
    "intermediate.dense": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
    "output.dense": "mlp.fc2",
}
_QKV = {
    "attention.q_proj": 0, "attention.k_proj": 1, "attention.v_proj": 2,
    "attention.attention.query": 0, "attention.attention.key": 1, "attention.attention.value": 2,
}  # fmt: skip
_TOP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
}
# Used only for masked-image pretraining, never in a forward pass on images.
_IGNORED = ("embeddings.mask_token",)


def looks_like(keys: list[str]) -> bool:
    return _PATCH in keys or f"vit.{_PATCH}" in keys


def _sidecar_hints(sidecar: Mapping[str, Any] | None, src: Source) -> tuple[dict[str, Any], dict[str, Any]]:
    """Hints (heads, eps, image size) and class names from a transformers `config.json`."""
    hints: dict[str, Any] = {"norm_eps": 1e-12}  # ViTConfig.layer_norm_eps default
    data: dict[str, Any] = {}
    if not sidecar or sidecar.get("model_type") != "vit":
        return hints, data
    if sidecar.get("hidden_act", "gelu") != "gelu":
        raise src.error(f"hidden_act={sidecar['hidden_act']!r}; vitlab's ViT uses exact GELU ('gelu')")
    if "num_attention_heads" in sidecar:
        hints["num_heads"] = int(sidecar["num_attention_heads"])
    if "layer_norm_eps" in sidecar:
        hints["norm_eps"] = float(sidecar["layer_norm_eps"])
    if "image_size" in sidecar:
        size = sidecar["image_size"]
        hints["img_size"] = [int(size), int(size)] if isinstance(size, (int, float)) else [int(s) for s in size]
    labels = sidecar.get("id2label")
    if isinstance(labels, Mapping) and labels:
        names = [str(labels.get(str(i), labels.get(i, ""))) for i in range(len(labels))]  # type: ignore[call-overload]
        if names != [f"LABEL_{i}" for i in range(len(names))]:  # transformers' placeholders say nothing
            data["class_names"] = names
    return hints, data


def convert(tensors: Mapping[str, torch.Tensor], path: str, sidecar: Mapping[str, Any] | None = None) -> Converted:
    src = Source(tensors, FORMAT, path)
    hints, data = _sidecar_hints(sidecar, src)
    conv = Converted(FORMAT, {}, path, hints=hints, data_config={**DATA_CONFIG, **data}, resample=dict(RESAMPLE))
    prefix = "vit." if f"vit.{_PATCH}" in tensors else ""
    qkv: dict[tuple[int, str], dict[int, str]] = {}
    for key in src.keys():
        if not key.startswith(prefix) and not key.startswith(("classifier.", "pooler.")):
            continue
        name = key[len(prefix) :] if key.startswith(prefix) else key
        if name in _IGNORED:
            src.skip(key)
        elif name in _TOP:
            conv.put(_TOP[name], src.take(key), key)
        elif m := _BLOCK.match(name):
            i, module, param = int(m.group(1)), m.group(2), m.group(3)
            if module in _SUB:
                conv.put(f"blocks.{i}.{_SUB[module]}.{param}", src.take(key), key)
            elif module in _QKV:
                qkv.setdefault((i, param), {})[_QKV[module]] = key
    _fuse_qkv(qkv, src, conv)

    has_classifier = "classifier.weight" in tensors
    for param in ("weight", "bias"):
        if f"classifier.{param}" in tensors:
            conv.put(f"head.{param}", src.take(f"classifier.{param}"), f"classifier.{param}")
    for pooler in (f"{prefix}pooler.dense", "pooler.dense"):
        for param in ("weight", "bias"):
            key = f"{pooler}.{param}"
            if key not in tensors or key in src.used:
                continue
            if has_classifier:  # ViTForImageClassification classifies the class token, not the pooler output
                src.skip(key)
            else:  # ViTModel's pooler: dense + tanh on the class token, i.e. the pre-logits layer
                conv.put(f"pre_logits.fc.{param}", src.take(key), key)
    src.finish()
    return conv


def _fuse_qkv(qkv: dict[tuple[int, str], dict[int, str]], src: Source, conv: Converted) -> None:
    for (i, param), parts in sorted(qkv.items()):
        if len(parts) != 3:
            have = ", ".join(parts[j] for j in sorted(parts))
            raise src.error(f"block {i}: query/key/value {param}s are incomplete (found only {have})")
        keys = [parts[0], parts[1], parts[2]]
        ts = [src.take(k) for k in keys]
        if len({t.shape for t in ts}) != 1:
            shapes = ", ".join(f"{k} {tuple(t.shape)}" for k, t in zip(keys, ts))
            raise src.error(f"block {i}: query/key/value {param}s differ in shape: {shapes}")
        conv.put(f"blocks.{i}.attn.qkv.{param}", torch.cat(ts, dim=0), " + ".join(keys))
