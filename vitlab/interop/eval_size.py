"""The test size a checkpoint records: the input size (and centre-crop fraction) `vitlab resolution`
chose on the validation split, beside the size the model was trained at. timm's convention, in
vitlab's words: a data_config carries `test_img_size` [H, W] and `test_crop_pct` beside `img_size` and
`crop_pct` (timm: `test_input_size`, `test_crop_pct` beside `input_size`, `crop_pct`).

`img_size` and `crop_pct` always describe the model as it is (what `eval_transform` builds); a model
moved to its test size keeps the trained ones as `train_img_size` and `train_crop_pct`.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitlab.models.resize import to_2tuple
from vitlab.models.vit import VisionTransformer

log = logging.getLogger(__name__)

TEST_KEYS = ("test_img_size", "test_crop_pct")
TRAIN_KEYS = ("train_img_size", "train_crop_pct")


@dataclass(frozen=True)
class EvalSize:
    """A recorded test size: input size (height, width) and centre-crop fraction."""

    img_size: tuple[int, int]
    crop_pct: float

    def __str__(self) -> str:
        return f"{self.img_size[0]}x{self.img_size[1]}, crop {self.crop_pct:g}"


def eval_size_of(data_config: Mapping[str, Any] | None) -> EvalSize | None:
    """The test size a data_config records, or None (a checkpoint from before, or never swept)."""
    size = (data_config or {}).get("test_img_size")
    if size is None:
        return None
    crop = data_config.get("test_crop_pct") or data_config.get("train_crop_pct") or data_config.get("crop_pct") or 1.0
    return EvalSize(tuple(int(s) for s in to_2tuple(size)), float(crop))  # type: ignore[arg-type]


def trained_size_of(data_config: Mapping[str, Any]) -> tuple[tuple[int, int], float]:
    """(input size, crop fraction) the model was trained at: `train_*` once moved to its test size."""
    size = data_config.get("train_img_size") or data_config["img_size"]
    crop = data_config.get("train_crop_pct") or data_config.get("crop_pct") or 1.0
    return tuple(int(s) for s in to_2tuple(size)), float(crop)  # type: ignore[return-value]


def recorded_test_size(ckpt: str | Path) -> EvalSize | None:
    """The test size a vitlab Lightning checkpoint records, or None: no such file, another format, or
    nothing recorded (for `vitlab validate` / `vitlab test`, which load the module, not the model).
    Reads the metadata only (mmap)."""
    p = Path(ckpt)
    if p.suffix != ".ckpt" or not p.is_file():
        return None
    obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    meta = obj.get("vitlab") if isinstance(obj, Mapping) else None
    return eval_size_of(meta.get("data_config")) if isinstance(meta, Mapping) else None


def set_test_size(model: VisionTransformer, label: str = "the model") -> bool:
    """Move `model`, in place, to the test size its data_config records: position embeddings resampled as
    `vitlab resolution` resampled them when it chose the size, `img_size`/`crop_pct` set to the test ones,
    the trained ones kept as `train_img_size`/`train_crop_pct`. Says so in one log line. False (and
    nothing changed) when no test size is recorded or the model is at it already."""
    test = eval_size_of(model.data_config)
    now = (tuple(model.patch_embed.img_size), float(model.data_config.get("crop_pct") or 1.0))
    if test is None or now == (test.img_size, test.crop_pct):
        return False
    (th, tw), tcrop = trained_size_of(model.data_config)
    model.set_image_size(test.img_size)
    model.data_config.update(crop_pct=test.crop_pct, train_img_size=[th, tw], train_crop_pct=tcrop)
    log.warning(
        "%s: at its recorded test size %s (trained at %dx%d, crop %g); load_pretrained(..., use_test_size=False) "
        "gives the trained size", label, test, th, tw, tcrop,
    )  # fmt: skip
    return True


def at_test_size(model: VisionTransformer, label: str = "the model") -> VisionTransformer:
    """`model` at its recorded test size: a resampled copy (the caller's model is left as it is), or the
    model itself when it records none or is at it already."""
    if eval_size_of(model.data_config) is None:
        return model
    moved = copy.deepcopy(model)
    return moved if set_test_size(moved, label) else model


def record_test_size(ckpt: str | Path, test: EvalSize, **evidence: Any) -> Path:
    """Write `test` into a vitlab Lightning checkpoint's data_config, with `evidence` (top-1, images,
    split) under `checkpoint["vitlab"]["test_size"]`. Atomic: the checkpoint is written to a temporary
    file beside it and renamed over it, so a failure leaves the old checkpoint whole. A symlink
    (`save_last="link"`) is followed: its target is rewritten. Returns the file written."""
    path = Path(ckpt).resolve()
    obj = torch.load(path, map_location="cpu", weights_only=True)
    meta = obj.get("vitlab") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping) or not isinstance(meta.get("data_config"), Mapping):
        raise ValueError(f"{ckpt}: not a checkpoint written by `vitlab fit` (no vitlab data_config); "
                         "cannot record a test size in it")  # fmt: skip
    h, w = test.img_size
    meta["data_config"].update(test_img_size=[h, w], test_crop_pct=test.crop_pct)
    meta["test_size"] = {"img_size": [h, w], "crop_pct": test.crop_pct, **evidence}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777)  # mkstemp's 0600 would hide it from the run's other readers
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
