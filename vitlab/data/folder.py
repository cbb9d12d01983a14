"""Class-per-folder image trees: ImageNet-1k (train/ + val/) and ImageNet-21k (flat, or split folders)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from torchvision.datasets.folder import IMG_EXTENSIONS

from vitlab.data.base import ImageDataModule
from vitlab.data.image_files import ImageFileDataset
from vitlab.data.shard_index import indexed_files
from vitlab.data.split import held_out_split, name_hash
from vitlab.data.unlabelled import NO_LABELS_FIX, LabelsOption, unlabelled_samples

TRAIN_DIRS = ("train", "imagenet21k_train")
VAL_DIRS = ("val", "validation", "imagenet21k_val")
TEST_DIR = "test"


def _layouts(root: Path) -> str:
    return (
        f"expected one of: {root}/train/<class>/*.jpg with {root}/val/<class>/*.jpg (ImageNet-1k); "
        f"{root}/<class>/*.jpg (ImageNet-21k, validation held out by file-name hash); "
        f"{root}/imagenet21k_train/<class>/ with {root}/imagenet21k_val/<class>/; "
        f"beside a train folder, {root}/test/<class>/ is the test split (`vitlab test`)"
    )


def _class_dirs(folder: Path) -> list[str]:
    with os.scandir(folder) as it:
        return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))


def _has_image(folder: Path) -> bool:
    return any(f.lower().endswith(IMG_EXTENSIONS) for _, _, files in os.walk(folder, followlinks=True) for f in files)


class ImageFolderDataModule(LabelsOption, ImageDataModule):
    """Images in one folder per class; class index = position of the folder name in sorted order.

    Layouts (checked in this order): `root/train` or `root/imagenet21k_train` for training, with
    `root/val`, `root/validation` or `root/imagenet21k_val` for validation; else `root` itself holds
    the class folders. Without a validation folder, `val_fraction` of each class is held out by
    file-name hash (`val_fraction=0` disables validation). Beside a train folder, `root/test` is a
    test split: never used for model selection, evaluated by `vitlab test` (which otherwise
    evaluates the validation data). Images of any mode load as RGB. Each folder's file list is walked
    once (`prepare_data`, one process per node) into `fileindex.json` (vitlab.data.shard_index), which
    later starts and the other ranks read; a class folder whose mtime changed is walked again.
    `labels=False`: images at any depth of the train (and val) folder, class folders or not, label -1
    (self-supervised pretraining; see vitlab.data.unlabelled).
    """

    supports_decode = True

    def __init__(self, root: str, val_fraction: float = 0.02, labels: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.labels = labels
        self._check_labels_option()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.root = Path(root).expanduser()
        self.val_fraction = val_fraction

    @functools.cached_property
    def _layout(self) -> tuple[Path, Path | None, Path | None]:
        """(train folder, val folder or None, test folder or None)."""
        root = self.root
        if not root.is_dir():
            what = "is not a folder" if root.exists() else "does not exist"
            raise FileNotFoundError(f"image folder root {root} {what}; {_layouts(root)}")
        train = next((root / d for d in TRAIN_DIRS if (root / d).is_dir()), None)
        val = next((root / d for d in VAL_DIRS if (root / d).is_dir()), None)
        # Only beside a train folder: in the flat layout, root/test would be a class named "test".
        test = root / TEST_DIR if train is not None and (root / TEST_DIR).is_dir() else None
        if train is None:
            if val is not None:
                raise FileNotFoundError(
                    f"{root} has a validation folder {val.name}/ but no train folder; {_layouts(root)}"
                )
            train = root
        if self.labels and not _class_dirs(train):
            raise FileNotFoundError(f"no class folders in {train}; {_layouts(root)}; {NO_LABELS_FIX}")
        for split, folder in (("val", val), ("test", test)):
            if self.labels and folder is not None:
                tr, other = set(_class_dirs(train)), set(_class_dirs(folder))
                if tr != other:
                    missing, extra = sorted(tr - other), sorted(other - tr)
                    raise ValueError(
                        f"{split} classes in {folder} differ from training classes in {train}: "
                        f"missing from {split}: {missing or 'none'}; only in {split}: {extra or 'none'}"
                    )
        return train, val, test

    def _discover_class_names(self) -> list[str]:
        train_dir = self._layout[0]
        self._class_where = str(train_dir)
        classes = _class_dirs(train_dir)
        if len(classes) < 2 and not any(_has_image(train_dir / c) for c in classes):
            # Checked here, while it is cheap: a classifier for fewer than 2 classes fails before setup.
            raise FileNotFoundError(
                f"no images found in {train_dir}: its class folder {', '.join(classes)} holds no image files "
                f"(image extensions: {' '.join(IMG_EXTENSIONS)}); {_layouts(self.root)}"
            )
        return classes

    def prepare_data(self) -> None:
        """List the image files into the file index (vitlab.data.shard_index) where it is missing or out
        of date. Lightning runs this once per node while the other ranks wait, so their `setup` reads
        the index instead of walking the tree."""
        for folder in self._layout if self.labels else ():
            if folder is not None:
                indexed_files(folder, self.class_names, IMG_EXTENSIONS)

    def _scan(self, folder: Path, classes: list[str]) -> list[tuple[str, int]]:
        """(path, class index) of every image, in torchvision's make_dataset order, from the file index."""
        files = indexed_files(folder, classes, IMG_EXTENSIONS)
        samples = [(os.path.join(folder, c, f), i) for i, c in enumerate(classes) for f in files[c]]
        empty = [c for c in classes if not files[c]]
        if empty:
            raise FileNotFoundError(
                f"class folders without images in {folder}: {', '.join(empty)} "
                f"(image extensions: {' '.join(IMG_EXTENSIONS)}); remove the folders or add images"
            )
        return samples

    def _setup_datasets(self, stage: str | None) -> None:
        train_dir, val_dir, test_dir = self._layout
        scan = (lambda d: self._scan(d, self.class_names)) if self.labels else unlabelled_samples
        samples = scan(train_dir)
        if val_dir is not None:
            val_samples = scan(val_dir)
        elif self.val_fraction > 0:
            keys = [name_hash(os.path.relpath(path, train_dir)) for path, _ in samples]
            train, val = held_out_split([target for _, target in samples], self.val_fraction, keys)
            samples, val_samples = [samples[i] for i in train], [samples[i] for i in val]
        else:
            val_samples = []
        skip = self.skip_bad_images
        self.train_dataset = ImageFileDataset(samples, self.train_decoder(), skip)
        self.val_dataset = ImageFileDataset(val_samples, self.eval_decoder(), skip) if val_samples else None
        if test_dir is not None:
            self.test_dataset = ImageFileDataset(scan(test_dir), self.eval_decoder(), skip)
