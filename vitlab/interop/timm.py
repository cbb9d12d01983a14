"""timm ViT state dicts (and vitlab weights without a config: the parameter names are the same):
read them, and export a vitlab model as a timm hub folder.

Handles the `model` / `state_dict` wrappers of timm's training checkpoints, DDP / torch.compile
name prefixes, and the patch embedding of old timm checkpoints stored as a linear layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vitlab.constants import IMAGENET_NORM, INCEPTION_NORM
from vitlab.interop.architecture import TIMM_RESAMPLE, Converted, Source, strip_prefix
from vitlab.interop.eval_size import eval_size_of
from vitlab.models.resnet import resnet_stride
from vitlab.models.vit import VisionTransformer

FORMAT = "timm"

# timm's augreg ViT weights: Inception mean/std, bicubic resize, crop 0.9.
DATA_CONFIG: dict[str, Any] = {
    **INCEPTION_NORM, "interpolation": "bicubic", "crop_pct": 0.9, "class_names": None
}  # fmt: skip


def looks_like(keys: list[str]) -> bool:
    names = strip_prefix(keys)
    has_stem = "patch_embed.proj.weight" in names or "patch_embed.convs.0.0.weight" in names
    return has_stem and any(k.startswith("blocks.0.") for k in names)


def _sidecar_data(sidecar: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model config (input size, heads) and data config from a timm hub `config.json` (`pretrained_cfg`,
    and `model_args` where the folder was written with the model's constructor arguments)."""
    if not sidecar:
        return {}, {}
    pc = sidecar.get("pretrained_cfg")
    if not isinstance(pc, Mapping):
        if "architecture" not in sidecar:
            return {}, {}
        pc = sidecar  # timm's older hub configs: one flat dict
    data = {k: pc[k] for k in ("mean", "std", "interpolation", "crop_pct", "test_crop_pct") if k in pc}
    data = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in data.items()}
    test_size = pc.get("test_input_size")
    if isinstance(test_size, (list, tuple)) and len(test_size) == 3:
        data["test_img_size"] = [int(test_size[1]), int(test_size[2])]
    names = _label_names(sidecar.get("label_names", pc.get("label_names")),
                         sidecar.get("label_descriptions", pc.get("label_descriptions")))  # fmt: skip
    if names:
        data["class_names"] = names
    config: dict[str, Any] = {}
    size = pc.get("input_size")
    if isinstance(size, (list, tuple)) and len(size) == 3:
        config["img_size"] = [int(size[1]), int(size[2])]
    model_args = sidecar.get("model_args")
    if isinstance(model_args, Mapping) and isinstance(model_args.get("num_heads"), int):
        config["num_heads"] = model_args["num_heads"]  # the shapes cannot tell it
    return config, data


def _label_names(names: Any, descriptions: Any) -> list[str] | None:
    """timm's `label_names` (a list, or index -> name) read as descriptions where it has them
    (`n01440764` -> `tench, Tinca tinca`): what a person reads in `vitlab predict`."""
    if isinstance(names, Mapping):
        try:
            names = [names[k] for k in sorted(names, key=int)]
        except (TypeError, ValueError):
            return None
    if not isinstance(names, (list, tuple)) or not names:
        return None
    descriptions = descriptions if isinstance(descriptions, Mapping) else {}
    return [str(descriptions.get(n, n)) for n in names]


def convert(
    tensors: Mapping[str, torch.Tensor],
    path: str,
    config: Mapping[str, Any],
    sidecar: Mapping[str, Any] | None = None,
    format: str = FORMAT,
) -> Converted:
    names = strip_prefix(tensors)
    src = Source(tensors, format, path)
    stated, data = _sidecar_data(sidecar) if format == FORMAT else ({}, {})
    defaults = {**DATA_CONFIG, **(IMAGENET_NORM if "dist_token" in names else {})}  # timm's DeiT weights
    conv = Converted(format, {}, path, config=stated, data_config={**defaults, **data}, resample=dict(TIMM_RESAMPLE))
    for new, old in names.items():
        t = src.take(old)
        if new == "patch_embed.proj.weight" and t.ndim == 2 and "patch_embed.norm.weight" not in names:
            t = _linear_patch_to_conv(t, int(config.get("in_chans", 3)), src)
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


# ---- export ------------------------------------------------------------------------------------

# A registered timm name per width, for readability; `model_args` in config.json set every size.
_ARCHITECTURES = {192: "vit_tiny_patch16_224", 384: "vit_small_patch16_224", 768: "vit_base_patch16_224",
                  1024: "vit_large_patch16_224", 1280: "vit_huge_patch14_224"}  # fmt: skip
# DeiT's distilled models are their own timm class (VisionTransformerDistilled): its names, per width.
_DISTILLED = {192: "deit_tiny_distilled_patch16_224", 384: "deit_small_distilled_patch16_224",
              768: "deit_base_distilled_patch16_224"}  # fmt: skip
# timm builds a hybrid's ResNet inside its registered function (root width 64): one name per stage
# depths; `model_args` then set the transformer's sizes and `patch_size` the projection kernel.
TIMM_HYBRIDS = {(): "vit_tiny_r_s16_p8_224", (2, 2, 2, 2): "vit_small_r26_s32_224",
                (3, 4, 9): "vit_base_r50_s16_224", (3, 4, 6, 3): "vit_large_r50_s32_224"}  # fmt: skip


def hybrid_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    layers = config.get("stem_layers")
    return (3, 4, 9) if layers is None else tuple(layers)  # () is the root alone, not the default


def timm_hybrid(config: Mapping[str, Any]) -> str | None:
    """timm's name for the hybrid `config` describes, or None where timm registers no such ResNet."""
    return TIMM_HYBRIDS.get(hybrid_layers(config)) if config.get("stem_channels", 64) == 64 else None


def timm_config(model: VisionTransformer) -> dict[str, Any]:
    """A timm hub `config.json`: architecture, the `model_args` that rebuild this model, `pretrained_cfg`
    (with `test_input_size` and `test_crop_pct` when the model records a test size)."""
    c, d = model.config, model.data_config
    h, w = c["img_size"]
    model_args = {
        "img_size": [h, w], "patch_size": c["patch_size"], "in_chans": c["in_chans"], "num_classes": c["num_classes"],
        "embed_dim": c["embed_dim"], "depth": c["depth"], "num_heads": c["num_heads"], "mlp_ratio": c["mlp_ratio"],
        "qkv_bias": c["qkv_bias"], "class_token": c["class_token"], "global_pool": c["pool"],
    }  # fmt: skip
    architecture = _ARCHITECTURES.get(c["embed_dim"], "vit_base_patch16_224")
    first_conv = "patch_embed.proj"
    if c.get("stem") == "resnet":
        architecture, layers = timm_hybrid(c), hybrid_layers(c)
        model_args["patch_size"] = c["patch_size"] // resnet_stride(len(layers))  # the projection's kernel
        first_conv = "patch_embed.backbone.stem.conv" if layers else "patch_embed.backbone.conv"
    if c.get("distilled"):
        architecture = _DISTILLED.get(c["embed_dim"], "deit_base_distilled_patch16_224")
        del model_args["class_token"]  # the distilled class has both prefix tokens
    pretrained_cfg = {
        "input_size": [c["in_chans"], h, w], "fixed_input_size": True, "mean": list(d["mean"]),
        "std": list(d["std"]), "crop_pct": float(d.get("crop_pct") or 1.0), "crop_mode": "center",
        "interpolation": str(d.get("interpolation") or "bicubic"), "num_classes": c["num_classes"],
        "first_conv": first_conv, "classifier": ["head", "head_dist"] if c.get("distilled") else "head",
    }  # fmt: skip
    test = eval_size_of(d)
    if test is not None:  # timm's convention: resolve_data_config(use_test_size=True) picks these
        pretrained_cfg.update(test_input_size=[c["in_chans"], *test.img_size], test_crop_pct=test.crop_pct)
    config: dict[str, Any] = {
        "architecture": architecture,
        "num_classes": c["num_classes"], "num_features": c["embed_dim"], "global_pool": c["pool"],
        "model_args": model_args, "pretrained_cfg": pretrained_cfg,
    }  # fmt: skip
    if d.get("class_names"):
        config["label_names"] = [str(n) for n in d["class_names"]]
    return config


def export_timm(model: VisionTransformer, directory: str | Path) -> Path:
    """Write `model.safetensors` (timm's names, which are vitlab's) and a timm hub `config.json`.

    Loads with `timm.create_model("local-dir:<folder>", pretrained=True)`, or with
    `timm.create_model(architecture, pretrained=True, pretrained_cfg_overlay=dict(pretrained_cfg,
    file=<folder>/model.safetensors), **model_args)` (the overlay's `num_classes` keeps the head).
    A distilled model loads as timm's `VisionTransformerDistilled`; both predict with the mean of
    the two heads' logits (DeiT's rule), so the logits are the same. A recorded test size goes into
    `pretrained_cfg` as `test_input_size`/`test_crop_pct` (`resolve_data_config(use_test_size=True)`
    reads them); `create_model(..., img_size=<test size>)` resamples the position embeddings on load.
    """
    from vitlab.interop.vitlab_format import write_folder

    return write_folder(directory, model.state_dict(), config=timm_config(model))
