"""vitlab: pretrain a Vision Transformer, then fine-tune it at a higher resolution."""

from vitlab.data.transforms import eval_transform
from vitlab.interop import export, load_pretrained, save_pretrained
from vitlab.models import VisionTransformer, create_model, list_models, resample_pos_embed

__version__ = "0.1.0"

__all__ = [
    "VisionTransformer",
    "create_model",
    "eval_transform",
    "export",
    "list_models",
    "load_pretrained",
    "resample_pos_embed",
    "save_pretrained",
]
