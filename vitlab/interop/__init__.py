"""Checkpoint interop: load vitlab, timm, HF transformers, torchvision and Google `.npz` ViT weights."""

from vitlab.interop.api import load_pretrained
from vitlab.interop.errors import CheckpointError, UnsafeCheckpointError
from vitlab.interop.native import save_pretrained

__all__ = ["CheckpointError", "UnsafeCheckpointError", "load_pretrained", "save_pretrained"]
