"""Checkpoint interop: load vitlab, timm, HF transformers, torchvision and Google `.npz` ViT weights;
export to vitlab, HF transformers, timm and ONNX."""

from vitlab.interop.errors import CheckpointError, UnsafeCheckpointError
from vitlab.interop.export import FORMATS, ExportError, export
from vitlab.interop.load import load_pretrained
from vitlab.interop.vitlab_format import save_pretrained

__all__ = ["FORMATS", "CheckpointError", "ExportError", "UnsafeCheckpointError", "export", "load_pretrained",
           "save_pretrained"]
