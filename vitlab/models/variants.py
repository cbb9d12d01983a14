"""Named ViT variants: the paper's Table 1 (Base, Large, Huge) plus DeiT's Tiny and Small."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from vitlab.models.vit import VisionTransformer

# name -> (embed_dim, depth, num_heads, patch_size)
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "vit_tiny_patch16": (192, 12, 3, 16),
    "vit_small_patch16": (384, 12, 6, 16),
    "vit_small_patch32": (384, 12, 6, 32),
    "vit_base_patch16": (768, 12, 12, 16),
    "vit_base_patch32": (768, 12, 12, 32),
    "vit_large_patch16": (1024, 24, 16, 16),
    "vit_large_patch32": (1024, 24, 16, 32),
    "vit_huge_patch14": (1280, 32, 16, 14),
}


def list_models() -> list[str]:
    return sorted(VARIANTS)


def variant_config(name: str) -> dict[str, Any]:
    if name not in VARIANTS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(list_models())}")
    embed_dim, depth, num_heads, patch_size = VARIANTS[name]
    return dict(embed_dim=embed_dim, depth=depth, num_heads=num_heads, patch_size=patch_size)


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
