"""Hugging Face transformers ViT (`ViTModel`, `ViTForImageClassification`), DeiT (`DeiTModel`,
`DeiTForImageClassification[WithTeacher]`) and ViT-hybrid (`ViTHybridForImageClassification`, a BiT
ResNet stem; transformers 4.x): read their state dicts, `config.json` and
`preprocessor_config.json`; export a vitlab model as a `ViTForImageClassification` folder.

Two layouts are read: the one transformers 4.x used and 5.x still writes to disk
(`encoder.layer.N.attention.attention.query`, `attention.output.dense`, `intermediate.dense`,
`output.dense`) and the 5.x in-memory one (`layers.N.attention.q_proj/k_proj/v_proj/o_proj`,
`mlp.fc1/fc2`); both with or without the `vit.` / `deit.` prefix of the task models.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vitlab.constants import IMAGENET_NORM, INCEPTION_NORM
from vitlab.interop.architecture import Converted, Source
from vitlab.interop.eval_size import TEST_KEYS, TRAIN_KEYS, eval_size_of
from vitlab.models.vit import VisionTransformer

FORMAT = "hf"
# config.json's entry for the trained and test sizes of a model exported at its test size.
SIZES_KEY = "vitlab_sizes"
# ViTImageProcessor: mean/std 0.5, bilinear resize straight to the input size (no crop).
DATA_CONFIG: dict[str, Any] = {
    **INCEPTION_NORM, "interpolation": "bilinear", "crop_pct": 1.0, "class_names": None
}  # fmt: skip
# DeiTImageProcessor: resize 256, centre crop 224, bicubic, ImageNet mean/std.
DEIT_DATA_CONFIG: dict[str, Any] = {
    **IMAGENET_NORM, "interpolation": "bicubic", "crop_pct": 0.875, "class_names": None
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
    "embeddings.distillation_token": "dist_token",  # DeiT: it follows the class token, as in vitlab and timm
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
}
# Used only for masked-image pretraining, never in a forward pass on images.
_IGNORED = ("embeddings.mask_token",)
_PREFIXES = ("vit.", "deit.")
# Classifiers -> vitlab heads: ViT's and DeiT's one head; DeiT-with-teacher's class and distillation heads.
_HEADS = {"classifier": "head", "cls_classifier": "head", "distillation_classifier": "head_dist"}
_MODEL_TYPES = ("vit", "deit", "vit-hybrid")
# ViT-hybrid (`ViTHybridForImageClassification`, transformers 4.x): its BiT stem, in timm's and vitlab's names.
_BIT = "embeddings.patch_embeddings.backbone.bit."
_BIT_STEM = {"embedder.convolution.": "stem.conv.", "embedder.norm.": "stem.norm."}
_BIT_BLOCK = re.compile(r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.(.+)$")


def looks_like(keys: list[str]) -> bool:
    return _PATCH in keys or any(f"{p}{_PATCH}" in keys for p in _PREFIXES)


def _sidecar_config(sidecar: Mapping[str, Any] | None, src: Source) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model config (heads, eps, image size) and class names from a transformers `config.json`."""
    config: dict[str, Any] = {"norm_eps": 1e-12}  # ViTConfig.layer_norm_eps default
    data: dict[str, Any] = {}
    if not sidecar or sidecar.get("model_type") not in _MODEL_TYPES:
        return config, data
    if sidecar.get("hidden_act", "gelu") != "gelu":
        raise src.error(f"hidden_act={sidecar['hidden_act']!r}; vitlab's ViT uses exact GELU ('gelu')")
    bit = sidecar.get("backbone_config") or {}
    layer, padding = bit.get("layer_type", "bottleneck"), str(bit.get("global_padding", "SAME")).upper()
    if layer != "bottleneck" or padding != "SAME":
        raise src.error(
            f"a BiT stem with layer_type={layer!r}, global_padding={padding!r}; vitlab's hybrid stem is the "
            "paper's: bottleneck blocks without pre-activation, SAME padding"
        )
    if "num_attention_heads" in sidecar:
        config["num_heads"] = int(sidecar["num_attention_heads"])
    if "layer_norm_eps" in sidecar:
        config["norm_eps"] = float(sidecar["layer_norm_eps"])
    if "image_size" in sidecar:
        size = sidecar["image_size"]
        config["img_size"] = [int(size), int(size)] if isinstance(size, (int, float)) else [int(s) for s in size]
    sizes = sidecar.get(SIZES_KEY)
    if isinstance(sizes, Mapping):
        data.update({k: sizes[k] for k in (*TEST_KEYS, *TRAIN_KEYS) if k in sizes})
    labels = sidecar.get("id2label")
    if isinstance(labels, Mapping) and labels:
        names = [str(labels.get(str(i), labels.get(i, ""))) for i in range(len(labels))]  # type: ignore[call-overload]
        if names != [f"LABEL_{i}" for i in range(len(names))]:  # transformers' placeholders say nothing
            data["class_names"] = names
    return config, data


def processor_data_config(processor: Mapping[str, Any] | None) -> dict[str, Any]:
    """mean, std, interpolation and crop fraction from a transformers `preprocessor_config.json`
    (ViT's: resize to the input size, bilinear, 0.5; DeiT's: resize 256, crop 224, bicubic, ImageNet)."""
    if not processor:
        return {}
    data: dict[str, Any] = {}
    if processor.get("do_normalize", True):
        for ours, theirs in (("mean", "image_mean"), ("std", "image_std")):
            value = processor.get(theirs)
            if isinstance(value, (list, tuple)) and len(value) == 3:
                data[ours] = [float(v) for v in value]
    by_code = {code: name for name, code in _PIL_RESAMPLE.items()}
    if processor.get("resample") in by_code:
        data["interpolation"] = by_code[processor["resample"]]
    size, crop = processor.get("size"), processor.get("crop_size")
    resized = _side(size) if processor.get("do_resize", True) else None
    cropped = _side(crop) if processor.get("do_center_crop") else None
    if resized:
        data["crop_pct"] = min(1.0, cropped / resized) if cropped else 1.0
    return data


def _side(size: Any) -> int | None:
    if isinstance(size, (int, float)):
        return int(size)
    if isinstance(size, Mapping):
        side = size.get("shortest_edge", size.get("height"))
        return int(side) if isinstance(side, (int, float)) else None
    return None


def convert(
    tensors: Mapping[str, torch.Tensor],
    path: str,
    sidecar: Mapping[str, Any] | None = None,
    processor: Mapping[str, Any] | None = None,
) -> Converted:
    src = Source(tensors, FORMAT, path)
    config, data = _sidecar_config(sidecar, src)
    defaults = DEIT_DATA_CONFIG if (sidecar or {}).get("model_type") == "deit" else DATA_CONFIG
    data = {**defaults, **processor_data_config(processor), **data}
    conv = Converted(FORMAT, {}, path, config=config, data_config=data, resample=dict(RESAMPLE))
    prefix = next((p for p in _PREFIXES if f"{p}{_PATCH}" in tensors), "")
    heads = tuple(f"{h}." for h in _HEADS)
    qkv: dict[tuple[int, str], dict[int, str]] = {}
    for key in src.keys():
        if not key.startswith(prefix) and not key.startswith((*heads, "pooler.")):
            continue
        name = key[len(prefix) :] if key.startswith(prefix) else key
        if name in _IGNORED:
            src.skip(key)
        elif name in _TOP:
            conv.put(_TOP[name], src.take(key), key)
        elif name.startswith(_BIT) and (ours := _bit_name(name[len(_BIT) :])):
            conv.put(ours, src.take(key), key)
        elif m := _BLOCK.match(name):
            i, module, param = int(m.group(1)), m.group(2), m.group(3)
            if module in _SUB:
                conv.put(f"blocks.{i}.{_SUB[module]}.{param}", src.take(key), key)
            elif module in _QKV:
                qkv.setdefault((i, param), {})[_QKV[module]] = key
    _fuse_qkv(qkv, src, conv)

    has_classifier = any(f"{h}weight" in tensors for h in heads)
    for theirs, ours in _HEADS.items():
        for param in ("weight", "bias"):
            if f"{theirs}.{param}" in tensors:
                conv.put(f"{ours}.{param}", src.take(f"{theirs}.{param}"), f"{theirs}.{param}")
    for pooler in (f"{prefix}pooler.dense", "pooler.dense"):
        for param in ("weight", "bias"):
            key = f"{pooler}.{param}"
            if key not in tensors or key in src.used:
                continue
            if has_classifier:  # the task models classify the class token, not the pooler output
                src.skip(key)
            else:  # ViTModel's pooler: dense + tanh on the class token, i.e. the pre-logits layer
                conv.put(f"pre_logits.fc.{param}", src.take(key), key)
    src.finish()
    return conv


def _bit_name(rest: str) -> str | None:
    """A ViT-hybrid stem tensor's vitlab name (`embedder.convolution` -> `stem.conv`, `encoder.stages.I.
    layers.J.*` -> `stages.I.blocks.J.*`); None for one vitlab's stem has no place for."""
    for theirs, ours in _BIT_STEM.items():
        if rest.startswith(theirs):
            return f"patch_embed.backbone.{ours}{rest[len(theirs) :]}"
    if m := _BIT_BLOCK.match(rest):
        return f"patch_embed.backbone.stages.{m.group(1)}.blocks.{m.group(2)}.{m.group(3)}"
    return None


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


# ---- export ------------------------------------------------------------------------------------

# PIL's resampling codes, which transformers' image processors store.
_PIL_RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
# The on-disk (4.x) names follow the 5.x ones in `_SUB`, so inverting it keeps the former.
_BLOCK_OUT = {ours: theirs for theirs, ours in _SUB.items()}
_TOP_OUT = {v: k for k, v in _TOP.items()}


def to_hf_state_dict(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """vitlab names -> `ViTForImageClassification` names in the layout transformers writes to disk."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        if name in _TOP_OUT:
            out[f"vit.{_TOP_OUT[name]}"] = t
        elif name.startswith("head."):
            out[f"classifier.{name[len('head.') :]}"] = t
        elif m := re.match(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$", name):
            i, module, param = m.groups()
            layer = f"vit.encoder.layer.{i}"
            if module == "attn.qkv":  # one fused projection -> query, key, value
                for part, chunk in zip(("query", "key", "value"), t.chunk(3, dim=0)):
                    out[f"{layer}.attention.attention.{part}.{param}"] = chunk.contiguous()
            else:
                out[f"{layer}.{_BLOCK_OUT[module]}.{param}"] = t
        else:  # check_expressible turns away every model with other parameters
            raise ValueError(f"no transformers ViT name for vitlab parameter {name!r}")
    return out


def hf_config(model: VisionTransformer) -> dict[str, Any]:
    """The `config.json` of a `ViTForImageClassification` equal to `model`."""
    c = model.config
    h, w = c["img_size"]
    names = model.data_config.get("class_names") or [f"LABEL_{i}" for i in range(c["num_classes"])]
    return {
        "architectures": ["ViTForImageClassification"], "model_type": "vit",
        "hidden_size": c["embed_dim"], "num_hidden_layers": c["depth"], "num_attention_heads": c["num_heads"],
        "intermediate_size": int(c["embed_dim"] * c["mlp_ratio"]), "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "initializer_range": 0.02,
        "layer_norm_eps": c["norm_eps"], "image_size": h if h == w else [h, w], "patch_size": c["patch_size"],
        "num_channels": c["in_chans"], "qkv_bias": c["qkv_bias"], "encoder_stride": c["patch_size"],
        "id2label": {str(i): str(n) for i, n in enumerate(names)},
        "label2id": {str(n): i for i, n in enumerate(names)},
        **_sizes_entry(model.data_config),
    }  # fmt: skip


def _sizes_entry(data_config: Mapping[str, Any]) -> dict[str, Any]:
    """The trained and test sizes, for a model written at its recorded test size: transformers keeps an
    unknown config key as an attribute, and vitlab reads it back."""
    if eval_size_of(data_config) is None:
        return {}
    return {SIZES_KEY: {k: data_config[k] for k in (*TEST_KEYS, *TRAIN_KEYS) if data_config.get(k) is not None}}


def preprocessor_config(data_config: Mapping[str, Any]) -> dict[str, Any]:
    """A transformers image processor that prepares inputs as vitlab's `eval_transform` does: resize
    (short side to img_size / crop_pct for a square input size), centre crop, rescale, normalise."""
    h, w = data_config["img_size"]
    crop_pct = float(data_config.get("crop_pct") or 1.0)
    interpolation = str(data_config.get("interpolation") or "bicubic").lower()
    if interpolation not in _PIL_RESAMPLE:
        raise ValueError(f"interpolation {interpolation!r} has no transformers equivalent; use bilinear or bicubic")
    common = {
        "do_resize": True, "resample": _PIL_RESAMPLE[interpolation], "do_center_crop": True,
        "crop_size": {"height": h, "width": w}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": list(data_config["mean"]), "image_std": list(data_config["std"]),
        "do_convert_rgb": True,
    }  # fmt: skip
    if h == w:  # CLIP's processor: shortest edge, then crop (timm's and vitlab's rule)
        return {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": int(h / crop_pct)}, **common}
    # DeiT's processor: resize to a fixed size, then crop (vitlab's rule for a non-square input size)
    return {"image_processor_type": "DeiTImageProcessor",
            "size": {"height": int(h / crop_pct), "width": int(w / crop_pct)}, **common}  # fmt: skip


def export_hf(model: VisionTransformer, directory: str | Path) -> Path:
    """Write a folder `ViTForImageClassification.from_pretrained` and `AutoImageProcessor` load:
    `config.json`, `model.safetensors`, `preprocessor_config.json`. Returns the folder."""
    from vitlab.interop.vitlab_format import write_folder

    return write_folder(directory, to_hf_state_dict(model), config=hf_config(model),
                        preprocessor_config=preprocessor_config(model.data_config))  # fmt: skip
