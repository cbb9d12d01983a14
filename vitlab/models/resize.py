"""Position-embedding resampling: the core of fine-tuning at a new resolution (paper, section 3.2)."""

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
    if mode in ("nearest", "area"):
        grid = F.interpolate(grid, size=new_grid, mode=mode)
    else:
        grid = F.interpolate(grid, size=new_grid, mode=mode, align_corners=align_corners, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(dtype)
    return torch.cat([prefix, grid], dim=1)
