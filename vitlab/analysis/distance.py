"""Mean attention distance (ViT paper Fig. 7 right, Fig. 11): the image-space analogue of a receptive field.

For each head, each query patch's attention weights over the key patches are multiplied by the pixel
distance between the patch centres and summed; that is averaged over query patches and images.
Low values mean a local head (like early conv layers), high values a head that integrates globally.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vitlab.analysis.rollout import _as_attention, _check_tokens
from vitlab.models.resize import to_2tuple


def patch_center_distances(grid: int | tuple[int, int], patch_size: int | tuple[int, int]) -> torch.Tensor:
    """Euclidean pixel distance between every pair of patch centres, `[h*w, h*w]` (row-major patches)."""
    (h, w), (ph, pw) = to_2tuple(grid), to_2tuple(patch_size)
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    centres = torch.stack([y.flatten() * ph, x.flatten() * pw], dim=1)  # the half-patch offset cancels
    return torch.cdist(centres, centres)


def mean_attention_distance(
    attn: torch.Tensor | Sequence[torch.Tensor],
    grid: int | tuple[int, int],
    patch_size: int | tuple[int, int],
    num_prefix_tokens: int,
) -> torch.Tensor:
    """Mean attention distance in pixels per layer and head, `[depth, heads]`.

    `attn` is `[depth, B, heads, N, N]` (or unbatched `[depth, heads, N, N]`). Prefix tokens are
    dropped as queries and as keys, and each query's weights over the patch keys are renormalised
    to sum to 1, so the value is "how far does this head look, among patches", not diluted by the
    mass a query puts on the class token. A query row with no mass on patches counts as distance 0.
    """
    a, _ = _as_attention(attn)
    grid = to_2tuple(grid)
    _check_tokens(a.shape[-1], num_prefix_tokens, grid)
    dist = patch_center_distances(grid, patch_size).to(a.device)
    out = []
    for layer in a:  # one layer at a time: [B, heads, P, P] stays small for big models
        p = layer[..., num_prefix_tokens:, num_prefix_tokens:].double()
        p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        per_query = (p * dist).sum(dim=-1)  # [B, heads, P]
        out.append(per_query.mean(dim=(0, 2)))
    return torch.stack(out).float()
