"""Attention rollout (Abnar & Zuidema 2020, arXiv 2005.00928; ViT paper Fig. 6 and Fig. 14).

Attention in one layer says where a token reads from, but after a few layers every token is a
mixture of all of them. Rollout follows the mixing through the network: average the heads, add the
identity for the residual connection, renormalise each row to a distribution, and multiply the
layers together, first layer first. The row of the pooled output (the class token, or the mean of
the patch rows for GAP models) over the patch tokens is then a map of what the prediction reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from vitlab.models.resize import to_2tuple

HeadFusion = Literal["mean", "max", "min"]
Normalize = Literal["max", "sum", "none"]
_FUSE = {"mean": torch.mean, "max": torch.amax, "min": torch.amin}
_SCALE = {"max": torch.amax, "sum": torch.sum}


def _as_attention(attn: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """-> (`[depth, B, heads, N, N]`, whether the input was unbatched `[depth, heads, N, N]`)."""
    if not isinstance(attn, torch.Tensor):
        attn = torch.stack(list(attn))
    if attn.ndim == 4:
        return attn.unsqueeze(1), True
    if attn.ndim != 5 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(
            f"expected attention of shape [depth, B, heads, N, N] (or [depth, heads, N, N]), got {tuple(attn.shape)}"
        )
    return attn, False


def _check_tokens(n: int, num_prefix_tokens: int, grid: tuple[int, int]) -> None:
    h, w = grid
    if n != num_prefix_tokens + h * w:
        raise ValueError(
            f"attention has {n} tokens but grid {h}x{w} with {num_prefix_tokens} prefix token(s) "
            f"needs {num_prefix_tokens + h * w}"
        )


def attention_rollout_matrix(
    attn: torch.Tensor | Sequence[torch.Tensor],
    *,
    discard_ratio: float = 0.0,
    head_fusion: HeadFusion = "mean",
) -> torch.Tensor:
    """The rolled-out token-to-token mixing `[B, N, N]` (unbatched input gives `[N, N]`).

    Row i says how much of each input token ends up in output token i; every row sums to 1.
    `discard_ratio` zeroes that fraction of the weakest entries of each head-fused row before the
    identity is added (the noise filter of common rollout code, done per row so no row empties).
    """
    a, unbatched = _as_attention(attn)
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    if head_fusion not in _FUSE:
        raise ValueError(f"unknown head_fusion {head_fusion!r}; choose 'mean', 'max' or 'min'")
    a = _FUSE[head_fusion](a.detach().float(), dim=2)
    n = a.shape[-1]
    drop = int(n * discard_ratio)
    if drop:
        idx = a.topk(drop, dim=-1, largest=False).indices
        a = a.scatter(-1, idx, 0.0)
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    a = a + eye  # the residual stream carries each token past the attention
    a = a / a.sum(dim=-1, keepdim=True)
    rollout = eye.expand_as(a[0]).clone()
    for layer in a:  # x_l = A_l x_{l-1}: later layers multiply from the left
        rollout = layer @ rollout
    return rollout[0] if unbatched else rollout


def attention_rollout(
    attn: torch.Tensor | Sequence[torch.Tensor],
    num_prefix_tokens: int,
    grid: int | tuple[int, int],
    *,
    image_size: int | tuple[int, int] | None = None,
    pool: str = "token",
    discard_ratio: float = 0.0,
    head_fusion: HeadFusion = "mean",
    query_weights: torch.Tensor | None = None,
    normalize: Normalize = "max",
) -> torch.Tensor:
    """Rollout heat-map over the patch grid, `[B, h, w]`, or `[B, H, W]` when `image_size` is given.

    `attn` is `model.forward_attention(x)[1]`, `[depth, B, heads, N, N]` (an unbatched
    `[depth, heads, N, N]` gives `[h, w]`). Which rolled-out row is read:

    - `pool="token"`: the class token's row (token 0) over the patch tokens.
    - `pool="avg"` / `"seq"`: the mean of the patch tokens' rows (what global average pooling reads);
      for sequence pooling pass the learned pooling weights `[B, N]` as `query_weights` to weigh
      the rows as the model does.

    Prefix tokens are left out of the map (columns), so the raw row sums to at most 1; the rest is
    the mass that stays on the class token. `normalize`:

    - `"max"` (default): divided by its maximum, so the map lies in [0, 1] with 1 at the peak;
      a map with no mass on any patch (attention that never leaves the class token) stays all zero.
    - `"sum"`: divided by its sum, a distribution over pixels (all zero, again, if there is no mass).
    - `"none"`: the raw rolled-out weights (per patch; after upsampling, per patch-sized area).

    Upsampling to `image_size` is bilinear (align_corners False) and happens before normalising.
    """
    a, unbatched = _as_attention(attn)
    grid = to_2tuple(grid)
    _check_tokens(a.shape[-1], num_prefix_tokens, grid)
    rollout = attention_rollout_matrix(a, discard_ratio=discard_ratio, head_fusion=head_fusion)
    b, n = rollout.shape[0], rollout.shape[-1]
    if query_weights is not None:
        weights = query_weights.detach().float().reshape(b, n).to(rollout.device)
    else:
        weights = pool_weights(pool, b, n, num_prefix_tokens, device=rollout.device)
    row = (weights.unsqueeze(1) @ rollout).squeeze(1)  # [B, N]
    heat = row[:, num_prefix_tokens:].reshape(b, *grid)
    if image_size is not None:
        heat = F.interpolate(heat.unsqueeze(1), size=to_2tuple(image_size), mode="bilinear", align_corners=False)
        heat = heat.squeeze(1)
    heat = _normalize(heat, normalize)
    return heat[0] if unbatched else heat


def pool_weights(
    pool: str, batch: int, num_tokens: int, num_prefix_tokens: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """`[batch, num_tokens]` weights of the tokens a pooling type reads, each row summing to 1: the class
    token (`"token"`), or the patch tokens equally (`"avg"`, and `"seq"` when its learned weights are not
    at hand; `pooling_weights` has them)."""
    weights = torch.zeros(batch, num_tokens, device=device)
    if pool == "token":
        if num_prefix_tokens < 1:
            raise ValueError("pool='token' needs a class token (num_prefix_tokens >= 1); use pool='avg'")
        weights[:, 0] = 1.0
    elif pool in ("avg", "seq"):
        weights[:, num_prefix_tokens:] = 1.0 / (num_tokens - num_prefix_tokens)
    else:
        raise ValueError(f"unknown pool {pool!r}; choose 'token', 'avg' or 'seq'")
    return weights


@torch.no_grad()
def pooling_weights(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """How `model`'s pooled output reads its tokens for the images `x`, `[B, N]` (N with the prefix
    tokens), each row summing to 1: the class token, the patch mean (GAP), or the learned sequence-
    pooling weights. `weights @ attention` is then the attention row the prediction reads, for
    attention rollout and for any one layer's map."""
    h, w = model.patch_embed.grid_size
    n, b = model.num_prefix_tokens + h * w, x.shape[0]
    if model.pool == "seq":
        return model.seq_pool_weights(model.forward_features(x)).float().reshape(b, n)
    return pool_weights(model.pool, b, n, model.num_prefix_tokens, device=x.device)


def _normalize(heat: torch.Tensor, how: Normalize) -> torch.Tensor:
    if how == "none":
        return heat
    if how not in _SCALE:
        raise ValueError(f"unknown normalize {how!r}; choose 'max', 'sum' or 'none'")
    scale = _SCALE[how](heat.flatten(1), dim=1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero map stays zero
    return heat / scale.view(-1, *([1] * (heat.ndim - 1)))
