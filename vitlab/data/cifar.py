"""CIFAR-10/100 through torchvision's loaders (the python-version archives), 32px defaults."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Subset
from torchvision.datasets import CIFAR10, CIFAR100

from vitlab.data.base import ImageDataModule
from vitlab.data.split import held_out_split
from vitlab.data.transforms import TrainCrop

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
_VARIANTS = {"cifar10": CIFAR10, "cifar100": CIFAR100}


class CIFARDataModule(ImageDataModule):
    """CIFAR-10 or CIFAR-100 from `root` (torchvision's layout: root/cifar-10-batches-py/...).

    Downloads only in `prepare_data` and only with `download=True`. Defaults suit 32px images:
    img_size=32, pad-and-crop training crops, and crop_pct=1.0 so evaluation is a plain resize
    (no centre crop to lose the border of an already tiny image).

    Model selection never sees the test split: validation (and so `best-*.ckpt`) uses `val_fraction`
    of each class of the train split, held out by a fixed draw from `seed`, and `vitlab test` scores
    the test split. `validate_on_test=True` validates on the test split instead (with the whole train
    split for training), as papers that report the best test epoch do; its best checkpoint is then
    chosen on the test set.
    """

    def __init__(
        self,
        root: str = "data",
        variant: Literal["cifar10", "cifar100"] = "cifar10",
        download: bool = True,
        img_size: int = 32,
        train_crop: TrainCrop = "pad",
        crop_pct: float = 1.0,
        val_fraction: float = 0.1,
        validate_on_test: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(img_size=img_size, train_crop=train_crop, crop_pct=crop_pct, **kwargs)
        if variant not in _VARIANTS:
            raise ValueError(f"unknown CIFAR variant {variant!r}; choose 'cifar10' or 'cifar100'")
        if not 0.0 < val_fraction < 1.0 and not validate_on_test:
            raise ValueError(
                f"val_fraction must be in (0, 1), got {val_fraction}; to validate on the test split instead "
                "set validate_on_test=true"
            )
        self.root = Path(root).expanduser()
        self.variant = variant
        self.download = download
        self.val_fraction = val_fraction
        self.validate_on_test = validate_on_test

    @property
    def folder(self) -> Path:
        return self.root / _VARIANTS[self.variant].base_folder

    def _missing(self, why: str) -> RuntimeError:
        return RuntimeError(
            f"{self.variant} is not available: {why}. Fill {self.folder}/ (torchvision's python-version "
            f"archive, as CIFARDataModule(download=True) fetches it when online), or train from an image "
            f"tree instead: DATA=<ImageFolder path> (ImageFolderDataModule(root=...), with train/<class>/ "
            f"and val/<class>/ folders)"
        )

    def prepare_data(self) -> None:
        if not self.download:
            return
        cls = _VARIANTS[self.variant]
        try:
            for train in (True, False):
                cls(str(self.root), train=train, download=True)
        except Exception as exc:  # offline: URLError, socket errors, ...
            raise self._missing(f"download into {self.root} failed ({type(exc).__name__}: {exc})") from exc

    def _discover_class_names(self) -> list[str]:
        self._class_where = str(self.folder)
        if self.variant == "cifar10":
            return list(CIFAR10_CLASSES)
        meta = self.folder / CIFAR100.meta["filename"]
        if not meta.is_file():
            raise self._missing(f"{meta} not found (class names come from it)")
        with open(meta, "rb") as f:
            return list(pickle.load(f, encoding="latin1")[CIFAR100.meta["key"]])

    def _setup_datasets(self, stage: str | None) -> None:
        cls = _VARIANTS[self.variant]
        try:
            train = cls(str(self.root), train=True, transform=self.train_transform(), download=False)
            self.test_dataset = cls(str(self.root), train=False, transform=self.eval_transform(), download=False)
        except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
            raise self._missing(f"{self.folder} is missing or incomplete ({exc})") from exc
        if self.validate_on_test:
            self.train_dataset, self.val_dataset = train, self.test_dataset
            return
        # The held-out images are read with the eval transform, so they need their own dataset object.
        held_out = cls(str(self.root), train=True, transform=self.eval_transform(), download=False)
        order = torch.randperm(len(train.targets), generator=torch.Generator().manual_seed(self.seed)).tolist()
        train_idx, val_idx = held_out_split(train.targets, self.val_fraction, order)
        self.train_dataset, self.val_dataset = Subset(train, train_idx), Subset(held_out, val_idx)
