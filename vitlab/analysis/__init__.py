"""What a ViT learns, as the paper shows it (arXiv 2010.11929, section 4.5, appendix D.7-D.8).

Attention rollout, mean attention distance, position-embedding similarity and the principal
components of the patch-embedding filters; their figures (`plots`); the CLI commands (`commands`).
"""

from vitlab.analysis.distance import mean_attention_distance, patch_center_distances
from vitlab.analysis.filters import patch_embedding_components
from vitlab.analysis.plots import (
    plot_attention_distance,
    plot_patch_components,
    plot_pos_embed_similarity,
    plot_rollout,
    save_figure,
)
from vitlab.analysis.posembed import pos_embed_similarity
from vitlab.analysis.rollout import attention_rollout, attention_rollout_matrix, pool_weights, pooling_weights

__all__ = [
    "attention_rollout", "attention_rollout_matrix", "mean_attention_distance", "patch_center_distances",
    "patch_embedding_components", "plot_attention_distance", "plot_patch_components", "plot_pos_embed_similarity",
    "plot_rollout", "pool_weights", "pooling_weights", "pos_embed_similarity", "save_figure",
]
