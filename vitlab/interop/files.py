"""Reading checkpoint files without executing anything they contain.

Torch pickles go through `torch.load(weights_only=True)` (tensors and plain containers only),
safetensors through safetensors, `.npz` through `numpy.load(allow_pickle=False)`. There is no
fallback to full unpickling: a pickle needing arbitrary objects is refused with an explanation.
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitlab.interop.errors import CheckpointError, UnsafeCheckpointError

# Weight files looked for inside a folder, in this order (vitlab/HF/timm hub layouts first).
FOLDER_FILES = ("model.safetensors", "pytorch_model.bin", "model.pth", "model.pt", "model.ckpt", "model.npz")
SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt", ".npz")

# Keys under which training scripts nest the state dict (timm: `model`, `state_dict`).
_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "module")
# argparse.Namespace holds only attributes; timm's training script stores its args as one.
_SAFE_EXTRA_GLOBALS = [argparse.Namespace]
# Restricted-unpickler complaints that mean a broken stream, not a forbidden object.
_MALFORMED = ("Unsupported operand", "String is too long", "unsupported persistent id")


@dataclass
class RawCheckpoint:
    path: Path  # the weights file
    kind: str  # "torch" | "safetensors" | "npz"
    obj: Any  # torch: what torch.load returned; otherwise a dict name -> tensor / array
    sidecar: dict[str, Any] | None  # config.json next to the weights, if any
    processor: dict[str, Any] | None = None  # a transformers preprocessor_config.json next to them, if any
    name: str | None = None  # how messages name the checkpoint (a hub repo or URL), else the path

    @property
    def label(self) -> str:
        return self.name or str(self.path)


def resolve(path: str | Path) -> Path:
    """The weights file for `path`, which may be a file or a folder holding one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_file():
        return path
    for name in FOLDER_FILES:
        if (path / name).is_file():
            return path / name
    found = sorted(p.name for p in path.iterdir() if p.suffix in SUFFIXES)
    if len(found) == 1:
        return path / found[0]
    raise CheckpointError(
        f"folder holds {'no' if not found else 'several'} weight files ({', '.join(found) or 'none'}); "
        f"expected one of {', '.join(FOLDER_FILES)} or a single {'/'.join(SUFFIXES)} file",
        path=str(path),
    )


def read_sidecar(weights: Path, filename: str = "config.json") -> dict[str, Any] | None:
    cfg = weights.parent / filename
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None  # an unrelated or broken file: the tensors still speak for themselves
    return data if isinstance(data, dict) else None


def read_checkpoint(path: str | Path, name: str | None = None) -> RawCheckpoint:
    """The weights at `path` (a file or a folder holding one) and the configs beside them; `name`:
    how messages call it (`hf-hub:ORG/NAME@commit`), where the path is only a cache entry."""
    weights = resolve(path)
    label = str(weights) if not name else name if name.endswith(weights.name) else f"{name} ({weights.name})"
    suffix = weights.suffix.lower()
    if suffix == ".safetensors":
        kind, obj = "safetensors", _read_safetensors(weights, label)
    elif suffix == ".npz":
        kind, obj = "npz", _read_npz(weights, label)
    else:
        kind, obj = "torch", _read_torch(weights, label)
    processor = read_sidecar(weights, "preprocessor_config.json")
    return RawCheckpoint(weights, kind, obj, read_sidecar(weights), processor, label if name else None)


def unwrap_state_dict(obj: Any, label: str) -> dict[str, Any]:
    """The named tensors (or arrays) of a read checkpoint, out of the dicts training scripts nest them in."""
    for _ in range(3):  # e.g. {"model": {"state_dict": {...}}}
        if not isinstance(obj, Mapping):
            break
        inner = next((obj[k] for k in _WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
        if inner is None or any(isinstance(v, torch.Tensor) for v in obj.values()):
            break
        obj = inner
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"holds a {type(obj).__name__}, not a state dict of named tensors", path=label)
    tensors = {str(k): v for k, v in obj.items() if isinstance(v, (torch.Tensor, np.ndarray))}
    if not tensors:
        raise CheckpointError(f"holds no state dict (keys: {', '.join(map(str, list(obj)[:12]))})", path=label)
    return tensors


def _read_safetensors(path: Path, label: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"not a readable safetensors file: {e}", path=label) from e


def _read_npz(path: Path, label: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (ValueError, OSError, EOFError) as e:
        if isinstance(e, ValueError) and "allow_pickle" in str(e):
            raise UnsafeCheckpointError(
                "the .npz holds object arrays (pickled Python objects); vitlab reads numeric arrays only",
                path=label,
            ) from e
        raise CheckpointError(f"not a readable .npz file: {e}", path=label) from e


def _read_torch(path: Path, label: str) -> Any:
    try:
        with torch.serialization.safe_globals(_SAFE_EXTRA_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "weights only" not in text.lower() or any(m in text for m in _MALFORMED):
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            detail = next((ln for ln in lines if any(m in ln for m in _MALFORMED)), lines[-1] if lines else "")
            raise CheckpointError(f"not a readable torch file ({detail})", path=label) from e
        raise UnsafeCheckpointError(_unsafe_message(path, e), path=label) from e
    except Exception as e:  # noqa: BLE001 - a corrupt pickle fails in many ways (KeyError, IndexError, ...)
        raise CheckpointError(f"not a readable torch file ({type(e).__name__}: {e})", path=label) from e


def _unsafe_message(path: Path, err: Exception) -> str:
    try:  # names the offending globals without unpickling anything (zip-format files only)
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        names = []
    what = f" ({', '.join(names)})" if names else ""
    reason = str(err).strip().splitlines()
    reason = next((ln.strip() for ln in reason if "GLOBAL" in ln or "Can only" in ln), "").split(". ")[0]
    return (
        f"refused: the pickle needs Python objects beyond tensors and plain containers{what}. "
        "vitlab loads only tensors-only checkpoints and never unpickles arbitrary objects, since unpickling "
        "can run code. If you trust the file, convert it once in a separate process: "
        "`sd = torch.load(path, weights_only=False)` (pick the state dict out of it if it is wrapped), then "
        "`safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, 'model.safetensors')` "
        "and load that file." + (f" [{reason}]" if reason else "")
    )
