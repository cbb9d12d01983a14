"""The validation data `vitlab validate` would build for a checkpoint at another input size."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from vitlab.models import VisionTransformer
from vitlab.recipe import data_module, import_class, init_params

# Preprocessing keys a model's data_config shares with the data modules' constructor arguments.
_PREPROCESSING = ("mean", "std", "interpolation", "crop_pct")


def recorded(ckpt: str | Path) -> dict[str, Any]:
    """What a Lightning checkpoint records besides the weights (data module and module hyperparameters);
    empty for other formats. mmap: only the small metadata is read."""
    p = Path(ckpt)
    if p.suffix != ".ckpt" or not p.is_file():
        return {}
    obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    keys = ("datamodule_hyper_parameters", "hyper_parameters", "vitlab", "global_step")
    return {k: obj[k] for k in keys if k in obj}


def data_name(recorded: Mapping[str, Any]) -> str:
    """Where the recorded data module read from, for the table."""
    hp = recorded.get("datamodule_hyper_parameters") or {}
    where = [str(hp[k]) for k in ("root", "train_shards", "val_shards", "path", "variant") if hp.get(k)]
    return ", ".join(where) or "recorded"


def datamodule_for(
    model: VisionTransformer, recorded: Mapping[str, Any], data: str | None, img_size: int, **overrides: Any
) -> L.LightningDataModule:
    """The validation data of a checkpoint at `img_size`: its recorded data module (class and arguments,
    as `vitlab fit` saved them), located at `data` when given (as `--data_path` would), preprocessing
    from the model's `data_config` where nothing is recorded."""
    hp = dict(recorded.get("datamodule_hyper_parameters") or {})
    class_path = hp.pop("_class_path", None)
    args = {k: v for k, v in model.data_config.items() if k in _PREPROCESSING}
    args.update({k: v for k, v in hp.items() if not k.startswith("_")})
    if data is not None:
        new_class, location = data_module(data)  # as `--data_path DATA` would
        if new_class != class_path:  # another reader: keep the settings it also takes (preprocessing, batch)
            args = {k: v for k, v in args.items() if k in init_params(import_class(new_class, "data"))}
        class_path = new_class
        args.update(location)
    if class_path is None:
        raise ValueError("the checkpoint records no data module (it was not trained by `vitlab fit`); pass --data DATA")
    cls = import_class(class_path, "data")
    # A progressive-resize run records its schedule; it ends at the training size, not the test size.
    args.pop("img_size_schedule", None)
    args["img_size"] = img_size
    if "in_memory" in init_params(cls):
        # Streaming validation gives the in-memory path's batches (vitlab.data.memory), without decoding
        # the train split for every size.
        args["in_memory"] = False
    args.update(overrides)
    return cls(**{k: v for k, v in args.items() if k in init_params(cls)})
