from vitlab.models.resize import resample_patch_kernel, resample_pos_embed
from vitlab.models.tokenizers import (
    ConvTokenizer, HybridEmbed, PatchEmbed, ShiftedPatchTokenizer, Tokenizer, make_tokenizer,
)  # fmt: skip
from vitlab.models.variants import VARIANTS, create_model, list_models
from vitlab.models.vit import Attention, Block, Mlp, VisionTransformer, sincos_pos_embed_2d

__all__ = [
    "VARIANTS", "Attention", "Block", "ConvTokenizer", "HybridEmbed", "Mlp", "PatchEmbed", "ShiftedPatchTokenizer",
    "Tokenizer", "VisionTransformer", "create_model", "list_models", "make_tokenizer", "resample_patch_kernel",
    "resample_pos_embed", "sincos_pos_embed_2d",
]
