"""Google's JAX/Flax `.npz` ViT checkpoints: google-research/vision_transformer and big_vision.

Flax keeps kernels as [in, out] (convolutions as [kh, kw, in, out]) and splits attention per head:
query/key/value kernels are [dim, heads, head_dim], the output kernel [heads, head_dim, dim]. The
number of heads is therefore stored, unlike in the torch formats.

- vision_transformer: `Transformer/encoderblock_N/{LayerNorm_0, MultiHeadDotProductAttention_1,
  LayerNorm_2, MlpBlock_3}`, position embedding at `Transformer/posembed_input/pos_embedding`
  (class token slot included).
- big_vision: `params/` prefix, `pos_embedding` at the top (no class token slot when the class token
  is appended after it), blocks `{LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1,
  MlpBlock_0}`, either per block or stacked with a leading depth axis (`nn.scan`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from vitlab.constants import INCEPTION_NORM
from vitlab.interop.architecture import Converted, Source
from vitlab.models.resize import to_2tuple

FORMAT_GOOGLE = "npz (vision_transformer)"
FORMAT_BIG_VISION = "npz (big_vision)"
PREFIXES = ("opt/target/", "params/img/", "params/", "")
DATA_CONFIG: dict[str, Any] = {
    **INCEPTION_NORM, "interpolation": "bilinear", "crop_pct": 1.0, "class_names": None
}  # fmt: skip
# timm's `_load_weights` for these files: bilinear, no antialias.
RESAMPLE: dict[str, Any] = {"mode": "bilinear", "antialias": False, "align_corners": False}


def find_prefix(keys: list[str]) -> str | None:
    return next((p for p in PREFIXES if f"{p}embedding/kernel" in keys), None)


def looks_like(keys: list[str]) -> bool:
    return find_prefix(keys) is not None


def convert(arrays: Mapping[str, Any], path: str, config: Mapping[str, Any]) -> Converted:
    keys = list(arrays)
    p = find_prefix(keys) or ""
    stacked = f"{p}Transformer/encoderblock/LayerNorm_0/scale" in arrays
    big_vision = p.startswith("params/") or f"{p}pos_embedding" in arrays or stacked
    fmt = FORMAT_BIG_VISION if big_vision else FORMAT_GOOGLE
    # Only the parameter tree counts; optimiser state etc. under other roots is not the model's.
    src = Source({k: v for k, v in arrays.items() if k.startswith(p)}, fmt, path)
    conv = Converted(fmt, {}, path, config={"norm_eps": 1e-6}, data_config=dict(DATA_CONFIG), resample=dict(RESAMPLE))

    def dense(key: str, name: str, idx: int | None = None) -> None:
        conv.put(f"{name}.weight", src.take(f"{key}/kernel", idx, ndim=2).T, f"{key}/kernel")
        conv.put(f"{name}.bias", src.take(f"{key}/bias", idx, ndim=1), f"{key}/bias")

    def norm(key: str, name: str, idx: int | None = None) -> None:
        conv.put(f"{name}.weight", src.take(f"{key}/scale", idx, ndim=1), f"{key}/scale")
        conv.put(f"{name}.bias", src.take(f"{key}/bias", idx, ndim=1), f"{key}/bias")

    if f"{p}conv_root/kernel" in src:
        _resnet(src, conv, p, norm)
    kernel = src.take(f"{p}embedding/kernel", ndim=4)  # [p, p, in, dim] -> [dim, in, p, p]
    conv.put("patch_embed.proj.weight", kernel.permute(3, 2, 0, 1), f"{p}embedding/kernel")
    conv.put("patch_embed.proj.bias", src.take(f"{p}embedding/bias", ndim=1), f"{p}embedding/bias")
    has_cls = f"{p}cls" in src
    if has_cls:
        conv.put("cls_token", src.take(f"{p}cls", ndim=3), f"{p}cls")
    pos_key = f"{p}pos_embedding" if f"{p}pos_embedding" in src else f"{p}Transformer/posembed_input/pos_embedding"
    pos = src.take(pos_key, ndim=(2, 3))
    pos = pos[None] if pos.ndim == 2 else pos
    if has_cls and not _has_cls_slot(pos.shape[1], kernel.shape[0], config):
        # big_vision adds the position embedding before appending the class token: a zero slot is the same.
        pos = torch.cat([pos.new_zeros(1, 1, pos.shape[-1]), pos], dim=1)
    conv.put("pos_embed", pos, pos_key)

    if stacked:
        depth = src.shape(f"{p}Transformer/encoderblock/LayerNorm_0/scale")[0]
        blocks = [(f"{p}Transformer/encoderblock/", i, i) for i in range(depth)]
    else:
        pattern = re.compile(rf"^{re.escape(p)}Transformer/encoderblock_(\d+)/")
        ids = sorted({int(m.group(1)) for k in src.keys() if (m := pattern.match(k))})
        blocks = [(f"{p}Transformer/encoderblock_{i}/", i, None) for i in ids]
    for bp, i, idx in blocks:
        google = f"{bp}MultiHeadDotProductAttention_1/query/kernel" in src
        mha = bp + ("MultiHeadDotProductAttention_1" if google else "MultiHeadDotProductAttention_0")
        ln2 = bp + ("LayerNorm_2" if f"{bp}LayerNorm_2/scale" in src else "LayerNorm_1")
        mlp = bp + ("MlpBlock_3" if f"{bp}MlpBlock_3/Dense_0/kernel" in src else "MlpBlock_0")
        norm(f"{bp}LayerNorm_0", f"blocks.{i}.norm1", idx)
        qkv_w, qkv_b = [], []
        for part in ("query", "key", "value"):
            w = src.take(f"{mha}/{part}/kernel", idx, ndim=(2, 3))  # [dim, heads, head_dim]
            if w.ndim == 3 and "num_heads" not in conv.config:
                conv.config["num_heads"] = int(w.shape[1])
            qkv_w.append(w.reshape(w.shape[0], -1).T)
            if f"{mha}/{part}/bias" in src:
                qkv_b.append(src.take(f"{mha}/{part}/bias", idx, ndim=(1, 2)).reshape(-1))
        names = f"{mha}/{{query,key,value}}"
        if len({t.shape for t in qkv_w}) != 1:
            shapes = ", ".join(str(tuple(t.shape)) for t in qkv_w)
            raise src.error(f"{names}/kernel differ in shape after flattening the heads: {shapes}")
        conv.put(f"blocks.{i}.attn.qkv.weight", torch.cat(qkv_w), f"{names}/kernel")
        if qkv_b:
            if len(qkv_b) != 3 or len({t.shape for t in qkv_b}) != 1:
                raise src.error(f"{names}/bias are incomplete or differ in shape")
            conv.put(f"blocks.{i}.attn.qkv.bias", torch.cat(qkv_b), f"{names}/bias")
        out = src.take(f"{mha}/out/kernel", idx, ndim=(2, 3))  # [heads, head_dim, dim]
        conv.put(f"blocks.{i}.attn.proj.weight", out.reshape(-1, out.shape[-1]).T, f"{mha}/out/kernel")
        conv.put(f"blocks.{i}.attn.proj.bias", src.take(f"{mha}/out/bias", idx, ndim=1), f"{mha}/out/bias")
        norm(ln2, f"blocks.{i}.norm2", idx)
        dense(f"{mlp}/Dense_0", f"blocks.{i}.mlp.fc1", idx)
        dense(f"{mlp}/Dense_1", f"blocks.{i}.mlp.fc2", idx)

    if f"{p}Transformer/encoder_norm/scale" in src:
        norm(f"{p}Transformer/encoder_norm", "norm")
    if f"{p}pre_logits/kernel" in src:
        dense(f"{p}pre_logits", "pre_logits.fc")
    if f"{p}head/kernel" in src and src.shape(f"{p}head/kernel")[-1] > 0:
        dense(f"{p}head", "head")
    else:
        src.skip(f"{p}head/kernel", f"{p}head/bias")
    src.finish()
    return conv


def _has_cls_slot(tokens: int, patch: int, config: Mapping[str, Any]) -> bool:
    """Whether a position embedding of `tokens` rows includes the class token's row."""
    if config.get("img_size") is not None:
        h, w = to_2tuple(config["img_size"])
        return tokens == (h // patch) * (w // patch) + 1
    return math.isqrt(tokens - 1) ** 2 == tokens - 1 and math.isqrt(tokens) ** 2 != tokens


def _resnet(src: Source, conv: Converted, p: str, norm: Any) -> None:
    """The hybrid's ResNet (R50+ViT-B/16, R26+ViT-S/32...) under timm's names: `conv_root`, `gn_root`,
    `block{S}/unit{U}/{conv1..3, gn1..3, conv_proj, gn_proj}`. Without stages (R+ViT-Ti) the root is
    the whole backbone."""
    pattern = re.compile(rf"^{re.escape(p)}block(\d+)/unit(\d+)/")
    units = sorted({(int(m.group(1)), int(m.group(2))) for k in src.keys() if (m := pattern.match(k))})
    root = "patch_embed.backbone.stem." if units else "patch_embed.backbone."

    def kernel(key: str, name: str) -> None:  # [kh, kw, in, out] -> [out, in, kh, kw]
        conv.put(name, src.take(key, ndim=4).permute(3, 2, 0, 1), key)

    kernel(f"{p}conv_root/kernel", root + "conv.weight")
    norm(f"{p}gn_root", root + "norm")
    for s, u in units:
        bp, tp = f"{p}block{s}/unit{u}/", f"patch_embed.backbone.stages.{s - 1}.blocks.{u - 1}."
        for r in (1, 2, 3):
            kernel(f"{bp}conv{r}/kernel", f"{tp}conv{r}.weight")
            norm(f"{bp}gn{r}", f"{tp}norm{r}")
        if f"{bp}conv_proj/kernel" in src:
            kernel(f"{bp}conv_proj/kernel", f"{tp}downsample.conv.weight")
            norm(f"{bp}gn_proj", f"{tp}downsample.norm")
