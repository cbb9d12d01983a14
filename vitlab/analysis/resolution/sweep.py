"""The sweep: one checkpoint scored at every (test size, patch size), each model resampled from the
checkpoint's own weights."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitlab.analysis.resolution.data import data_name, datamodule_for, recorded
from vitlab.analysis.resolution.score import Limit, score


@dataclass
class Row:
    """One (checkpoint, test size, patch size): top-1 and NLL on the validation split, or why not."""

    label: str
    ckpt: str
    data: str
    img_size: int
    patch_size: int
    trained_img_size: int
    trained_patch_size: int
    grid: str = ""
    acc1: float | None = None
    loss: float | None = None
    images: int = 0
    skipped: str = ""
    crop_pct: float | None = None  # the centre crop the size was scored with


def label_of(ckpt: str) -> str:
    p = Path(ckpt)
    return f"{p.parent.parent.name}/{p.name}" if p.parent.name == "checkpoints" else p.name


def sweep(
    ckpt: str,
    data: str | None,
    sizes: Sequence[int],
    patch_sizes: Sequence[int | None] = (None,),
    *,
    label: str | None = None,
    accelerator: str = "auto",
    precision: str = "32-true",
    limit_batches: Limit = None,
    **data_overrides: Any,
) -> list[Row]:
    """Score `ckpt` at every (size, patch size); `None` is the checkpoint's own patch size. Each model is
    resampled from the checkpoint's weights as trained (never from another size's, nor from a recorded
    test size). A size the model cannot take (not a multiple of the patch size, a tokenizer whose patch
    size is not a kernel) gives a skipped row."""
    from vitlab.interop import load_pretrained

    base = load_pretrained(ckpt, use_test_size=False)
    rec = recorded(ckpt)
    own_size, own_patch = base.patch_embed.img_size[0], base.patch_embed.patch_size
    rows = []
    for patch in patch_sizes:
        for size in sizes:
            row = Row(label or label_of(ckpt), str(ckpt), str(data or data_name(rec)), size, patch or own_patch,
                      own_size, own_patch)  # fmt: skip
            rows.append(row)
            model = copy.deepcopy(base)
            try:
                model.set_image_size(size, patch_size=patch)
            except ValueError as e:
                row.skipped = str(e)
                continue
            row.grid = "x".join(map(str, model.patch_embed.grid_size))
            dm = datamodule_for(model, rec, data, size, **data_overrides)
            row.crop_pct = getattr(dm, "crop_pct", None)
            row.acc1, row.loss, row.images = score(model, dm, accelerator, precision, limit_batches)
    return rows


def around(sizes: Sequence[int], patch: int) -> list[int]:
    """`sizes`, the midpoint of the two outer ones, a size below and one above them (a quarter of the
    smallest / largest beyond), all rounded to multiples of `patch`."""
    lo, hi = min(sizes), max(sizes)
    snap = lambda s: max(patch, round(s / patch) * patch)  # noqa: E731
    return sorted({snap(s) for s in (*sizes, (lo + hi) / 2, lo * 0.75, hi * 1.25)})
