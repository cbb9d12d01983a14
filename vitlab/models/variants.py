"""Named ViT variants: the paper's Table 1 (Base, Large, Huge) plus DeiT's Tiny and Small, the
paper's ResNet hybrids (and timm's small ones) and DeiT's distilled models, under timm's names."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from vitlab.models.vit import VisionTransformer

# name -> (embed_dim, depth, num_heads, patch_size); patch_size is the tokenizer's total stride.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "vit_tiny_patch16": (192, 12, 3, 16),
    "vit_small_patch16": (384, 12, 6, 16),
    "vit_small_patch32": (384, 12, 6, 32),
    "vit_base_patch16": (768, 12, 12, 16),
    "vit_base_patch32": (768, 12, 12, 32),
    "vit_large_patch16": (1024, 24, 16, 16),
    "vit_large_patch32": (1024, 24, 16, 32),
    "vit_huge_patch14": (1280, 32, 16, 14),
    "vit_tiny_r_s16_p8": (192, 12, 3, 32),
    "vit_small_r26_s32": (384, 12, 6, 32),
    "vit_base_r50_s16": (768, 12, 12, 16),
    "vit_large_r50_s32": (1024, 24, 16, 32),
    "deit_tiny_distilled_patch16": (192, 12, 3, 16),
    "deit_small_distilled_patch16": (384, 12, 6, 16),
    "deit_base_distilled_patch16": (768, 12, 12, 16),
}

# Further constructor arguments of a variant. Hybrids: the ResNet's stage depths (R50+ViT-B/16 is
# paper Table 6's: stages (3, 4, 9), stride 16, then a 1x1 projection; R+ViT-Ti is the ResNet root
# alone, stride 4, then an 8x8 projection).
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {
    "vit_tiny_r_s16_p8": dict(stem="resnet", stem_layers=[]),
    "vit_small_r26_s32": dict(stem="resnet", stem_layers=[2, 2, 2, 2]),
    "vit_base_r50_s16": dict(stem="resnet", stem_layers=[3, 4, 9]),
    "vit_large_r50_s32": dict(stem="resnet", stem_layers=[3, 4, 6, 3]),
    "deit_tiny_distilled_patch16": dict(distilled=True),
    "deit_small_distilled_patch16": dict(distilled=True),
    "deit_base_distilled_patch16": dict(distilled=True),
}


def list_models() -> list[str]:
    return sorted(VARIANTS)


def variant_config(name: str) -> dict[str, Any]:
    if name not in VARIANTS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(list_models())}")
    embed_dim, depth, num_heads, patch_size = VARIANTS[name]
    options = {k: list(v) if isinstance(v, list) else v for k, v in VARIANT_OPTIONS.get(name, {}).items()}
    return dict(embed_dim=embed_dim, depth=depth, num_heads=num_heads, patch_size=patch_size, **options)


def create_model(name: str, **overrides: Any) -> VisionTransformer:
    """Build a named variant; every constructor argument of `VisionTransformer` can be overridden."""
    check_model_args(overrides)
    return VisionTransformer(**{**variant_config(name), **overrides})


def check_model_args(args: dict[str, Any]) -> None:
    """Reject unknown model arguments (recipe typos) with the valid names listed."""
    valid = [p for p in inspect.signature(VisionTransformer.__init__).parameters if p != "self"]
    for key in args:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown model argument {key!r}; {hint}valid arguments: {', '.join(valid)}")
