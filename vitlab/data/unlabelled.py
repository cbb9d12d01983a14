"""Images without labels, for self-supervised pretraining (`vitlab.train.MaskedPatchPretraining`).

`labels=False` on `ImageFolderDataModule` and `ShardDataModule`: every sample's label is
`UNLABELLED` (-1), class folders and `.cls` files are not needed (and ignored where present), and the
DataModule reports no classes. A classifier pointed at such data is stopped by the CLI, and a
labelled DataModule that finds no labels says how to run without them (`NO_LABELS_FIX`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchvision.datasets.folder import IMG_EXTENSIONS

UNLABELLED = -1
NO_LABELS_FIX = (
    "a classifier needs labelled data (class folders, or KEY.cls in the shards); to pretrain on images "
    "without labels, use the self-supervised recipe recipes/pretrain/tinyimagenet_mpp_cpu.yaml "
    "(model.class_path: vitlab.train.MaskedPatchPretraining) or set data labels: false with that model"
)


class LabelsOption:
    """Mixin for an `ImageDataModule` with a `labels` switch: with `labels=False` there are no class
    names (`num_classes` is 0, `data_config["class_names"]` None) and MixUp/CutMix, which mix labels,
    are refused. The DataModule sets `self.labels` and calls `_check_labels_option()` in `__init__`."""

    labels: bool = True

    def _check_labels_option(self) -> None:
        if not self.labels and (self.mixup_alpha > 0 or self.cutmix_alpha > 0):  # type: ignore[attr-defined]
            raise ValueError("MixUp/CutMix mix labels, which labels=false data has none of; set their alphas to 0")

    @property
    def class_names(self) -> list[str]:
        return super().class_names if self.labels else []  # type: ignore[misc]

    @property
    def data_config(self) -> dict[str, Any]:
        if self.labels:
            return super().data_config  # type: ignore[misc]
        return {**self._preprocessing(), "class_names": None}  # type: ignore[attr-defined]


def unlabelled_samples(folder: str | os.PathLike) -> list[tuple[str, int]]:
    """Every image file under `folder`, at any depth (hidden entries skipped), sorted, labelled -1."""
    root = Path(folder)
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        images = [f for f in filenames if not f.startswith(".") and f.lower().endswith(IMG_EXTENSIONS)]
        files += [os.path.join(dirpath, f) for f in images]
    if not files:
        raise FileNotFoundError(f"no image files under {root} (image extensions: {' '.join(IMG_EXTENSIONS)})")
    return [(f, UNLABELLED) for f in sorted(files)]
