from vitlab.models.resize import resample_pos_embed
from vitlab.models.variants import VARIANTS, create_model, list_models
from vitlab.models.vit import Attention, Block, Mlp, PatchEmbed, VisionTransformer, sincos_pos_embed_2d

__all__ = [
    "VARIANTS", "Attention", "Block", "Mlp", "PatchEmbed", "VisionTransformer",
    "create_model", "list_models", "resample_pos_embed", "sincos_pos_embed_2d",
]
