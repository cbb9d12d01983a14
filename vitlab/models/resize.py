"""Resampling for a new input size: position embeddings (the core of fine-tuning at a new resolution,
paper section 3.2) and patch kernels (FlexiViT's pseudo-inverse resize, for a new patch size)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def to_2tuple(x: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(x, int):
        return (x, x)
    x = tuple(int(v) for v in x)
    if len(x) != 2:
        raise ValueError(f"expected an int or a pair (height, width), got {x}")
    return x  # type: ignore[return-value]


def infer_grid(num_tokens: int, like: Sequence[int]) -> tuple[int, int]:
    """The (h, w) grid of `num_tokens` grid tokens that a checkpoint does not record: square when it
    can be, else of the aspect ratio of `like` (the grid it goes to)."""
    side = math.isqrt(num_tokens)
    if side * side == num_tokens:
        return (side, side)
    h, w = to_2tuple(like)
    for rows in range(1, num_tokens + 1):
        if num_tokens % rows == 0 and rows * w == num_tokens // rows * h:
            return (rows, num_tokens // rows)
    raise ValueError(
        f"the checkpoint's {num_tokens} position embeddings form neither a square grid nor one shaped like "
        f"the model's {h}x{w}; build the model at the img_size the checkpoint was trained at"
    )


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: int | Sequence[int],
    *,
    old_grid: int | Sequence[int] | None = None,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
    align_corners: bool | None = None,
) -> torch.Tensor:
    """2D-interpolate the patch-grid part of a `[1, prefix + H*W, D]` embedding to `new_grid=(h, w)`.

    Prefix tokens (class token) are kept as they are. The defaults (bicubic, antialias,
    align_corners False) are timm's; torchvision uses `align_corners=True, antialias=False` and
    Google's `.npz` path in timm `mode="bilinear", antialias=False`.
    """
    new_grid = to_2tuple(new_grid)
    if pos_embed.ndim != 3 or pos_embed.shape[0] != 1:
        raise ValueError(f"expected a position embedding of shape [1, tokens, dim], got {tuple(pos_embed.shape)}")
    num_grid = pos_embed.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = math.isqrt(num_grid)
        if side * side != num_grid:
            raise ValueError(
                f"{num_grid} grid tokens do not form a square grid; pass old_grid=(h, w) "
                f"(num_prefix_tokens={num_prefix_tokens})"
            )
        old_grid = (side, side)
    old_grid = to_2tuple(old_grid)
    if old_grid[0] * old_grid[1] != num_grid:
        raise ValueError(
            f"old_grid {old_grid} has {old_grid[0] * old_grid[1]} cells but the embedding holds {num_grid} grid tokens"
        )
    if old_grid == new_grid:
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim, dtype = grid.shape[-1], grid.dtype
    grid = grid.float().reshape(1, *old_grid, dim).permute(0, 3, 1, 2)
    smooth = {} if mode in ("nearest", "area") else {"align_corners": align_corners, "antialias": antialias}
    grid = F.interpolate(grid, size=new_grid, mode=mode, **smooth)  # nearest and area take neither option
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(dtype)
    return torch.cat([prefix, grid], dim=1)


def resample_patch_kernel(
    weight: torch.Tensor, new_size: int | Sequence[int], *, mode: str = "bicubic", antialias: bool = True
) -> torch.Tensor:
    """FlexiViT's pseudo-inverse resize (arXiv 2212.08013) of a patch-embedding kernel `[D, C, p, p]`.

    With `R` the matrix of resizing a p x p patch to the new size (`F.interpolate`, here bicubic with
    antialias as FlexiViT and timm), the new kernel is `w' = pinv(R^T) w`: a patch resized with `R`
    then projected with `w'` gives the token the old patch gave with `w` (exactly when growing the
    kernel, in the least-squares sense when shrinking it).
    """
    new_size = to_2tuple(new_size)
    old_size = tuple(weight.shape[-2:])
    if weight.ndim != 4:
        raise ValueError(f"expected a patch kernel [out, in, h, w], got shape {tuple(weight.shape)}")
    if old_size == new_size:
        return weight
    n_old = old_size[0] * old_size[1]
    # Row i of `basis` resized is R's column i: what a one-hot pixel of the old patch becomes.
    basis = torch.eye(n_old, dtype=torch.float64, device=weight.device).reshape(n_old, 1, *old_size)
    resized = F.interpolate(basis, size=new_size, mode=mode, antialias=antialias, align_corners=False)
    resize_t = resized.reshape(n_old, -1)  # R^T: [old pixels, new pixels]
    flat = weight.detach().to(torch.float64).reshape(*weight.shape[:2], n_old)
    new = flat @ torch.linalg.pinv(resize_t.T)  # each output row: w^T pinv(R) = (pinv(R^T) w)^T
    return new.reshape(*weight.shape[:2], *new_size).to(weight.dtype)
