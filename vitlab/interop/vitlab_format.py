"""vitlab's own checkpoints: `save_pretrained` folders (safetensors + config.json) and Lightning `.ckpt`s.

A Lightning checkpoint written by vitlab's training module holds `state_dict` with keys
`model.<vitlab name>` and `checkpoint["vitlab"] = {"model_config": ..., "data_config": ...}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vitlab.interop.architecture import Converted, Source, strip_prefix
from vitlab.interop.errors import CheckpointError
from vitlab.models.vit import VisionTransformer

FORMAT = "vitlab"
WEIGHTS_NAME = "model.safetensors"


def save_pretrained(model: VisionTransformer, directory: str | Path) -> Path:
    """Write `model.safetensors` and `config.json` into `directory` (created if needed); returns the folder."""
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"save_pretrained expects a vitlab VisionTransformer, got {type(model).__name__}")
    config = {"format": FORMAT, "model": model.config, "data": model.data_config}
    return write_folder(directory, model.state_dict(), config=config)


def write_folder(directory: str | Path, tensors: Mapping[str, torch.Tensor], **configs: Mapping[str, Any]) -> Path:
    """`model.safetensors` and a `<name>.json` per config into `directory` (created if needed): the
    folder layout of vitlab, timm and HF transformers. Returns the folder."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    for name, config in configs.items():
        (directory / f"{name}.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def is_native_sidecar(sidecar: Mapping[str, Any] | None) -> bool:
    return bool(sidecar) and sidecar.get("format") == FORMAT and isinstance(sidecar.get("model"), dict)


def is_lightning(obj: Any) -> bool:
    """A Lightning checkpoint of a vitlab module: metadata present, or `model.`-prefixed ViT weights."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("state_dict"), Mapping):
        return False
    if isinstance(obj.get("vitlab"), Mapping):
        return True
    return any(k.startswith("model.") and ".patch_embed." in f".{k}" for k in obj["state_dict"])


def _take_all(src: Source, names: Mapping[str, str], conv: Converted) -> None:
    for new, old in names.items():
        conv.put(new, src.take(old), old)


def convert_saved(tensors: Mapping[str, torch.Tensor], sidecar: Mapping[str, Any], path: str) -> Converted:
    src = Source(tensors, FORMAT, path)
    data = dict(sidecar.get("data") or {})
    conv = Converted(FORMAT, {}, path, config=dict(sidecar["model"]), complete=True, data_config=data)
    _take_all(src, {k: k for k in src.keys()}, conv)
    return conv


def convert_lightning(ckpt: Mapping[str, Any], path: str) -> Converted:
    meta = ckpt.get("vitlab")
    fmt = f"{FORMAT} (Lightning)"
    sd = {k[len("model.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    if not sd:
        raise CheckpointError("state_dict holds no `model.` parameters", format=fmt, path=path)
    names = strip_prefix(sd)
    src = Source(sd, fmt, path)
    if isinstance(meta, Mapping) and isinstance(meta.get("model_config"), Mapping):
        data = dict(meta.get("data_config") or {})
        conv = Converted(fmt, {}, path, config=dict(meta["model_config"]), complete=True, data_config=data)
    else:  # no metadata: the shapes say what the model was
        conv = Converted(f"{fmt}, config inferred", {}, path)
    _take_all(src, names, conv)
    conv.sources = {k: f"model.{v}" for k, v in conv.sources.items()}
    return conv
