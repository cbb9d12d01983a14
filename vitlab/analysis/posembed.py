"""Position-embedding similarity (ViT paper Fig. 7 centre, Fig. 10).

The cosine similarity between one patch's position embedding and every other shows what the model
learned about 2D layout: close patches get similar embeddings, and row/column structure appears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.models.resize import to_2tuple


def pos_embed_similarity(
    pos_embed: torch.Tensor, grid: int | tuple[int, int], num_prefix_tokens: int
) -> torch.Tensor:
    """Cosine similarity of every patch's position embedding with every other, `[h, w, h, w]`.

    `pos_embed` is `[1, prefix + h*w, D]` (as `model.pos_embed`) or `[prefix + h*w, D]`;
    `sim[i, j]` is the map for the patch at row i, column j. Prefix tokens are dropped. Pass the
    model's current grid (`model.patch_embed.grid_size`), which follows `set_image_size`.
    """
    h, w = to_2tuple(grid)
    pe = pos_embed.detach().float()
    if pe.ndim == 3:
        if pe.shape[0] != 1:
            raise ValueError(f"expected a position embedding [1, tokens, D], got {tuple(pe.shape)}")
        pe = pe[0]
    if pe.ndim != 2:
        raise ValueError(f"expected a position embedding [1, tokens, D] or [tokens, D], got {tuple(pos_embed.shape)}")
    if pe.shape[0] != num_prefix_tokens + h * w:
        raise ValueError(
            f"position embedding has {pe.shape[0]} tokens but grid {h}x{w} with {num_prefix_tokens} "
            f"prefix token(s) needs {num_prefix_tokens + h * w}"
        )
    pe = F.normalize(pe[num_prefix_tokens:], dim=-1)
    return (pe @ pe.T).reshape(h, w, h, w)
