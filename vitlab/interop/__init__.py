"""Checkpoint interop: load vitlab, timm, HF transformers, torchvision and Google `.npz` ViT weights,
from a path, a Hugging Face Hub name (`hf-hub:ORG/NAME`) or a URL; export to vitlab, HF transformers, timm and ONNX."""

from vitlab.interop.errors import CheckpointError, ExportError, SourceError, UnsafeCheckpointError
from vitlab.interop.eval_size import EvalSize, recorded_test_size
from vitlab.interop.export import FORMATS, export
from vitlab.interop.hub import Resolved, resolve_source
from vitlab.interop.load import load_pretrained
from vitlab.interop.vitlab_format import save_pretrained

__all__ = ["FORMATS", "CheckpointError", "EvalSize", "ExportError", "Resolved", "SourceError", "UnsafeCheckpointError", "export",
           "load_pretrained", "recorded_test_size", "resolve_source", "save_pretrained"]
