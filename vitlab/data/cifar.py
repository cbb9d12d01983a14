"""CIFAR-10/100 through torchvision's loaders (the python-version archives), 32px defaults."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Literal

from torchvision.datasets import CIFAR10, CIFAR100

from vitlab.data.base import ImageDataModule
from vitlab.data.transforms import TrainCrop

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
_VARIANTS = {"cifar10": CIFAR10, "cifar100": CIFAR100}


class CIFARDataModule(ImageDataModule):
    """CIFAR-10 or CIFAR-100 from `root` (torchvision's layout: root/cifar-10-batches-py/...).

    Downloads only in `prepare_data` and only with `download=True`. Defaults suit 32px images:
    img_size=32, pad-and-crop training crops, and crop_pct=1.0 so evaluation is a plain resize
    (no centre crop to lose the border of an already tiny image). Validation = the test split.
    """

    def __init__(
        self,
        root: str = "data",
        variant: Literal["cifar10", "cifar100"] = "cifar10",
        download: bool = True,
        img_size: int = 32,
        train_crop: TrainCrop = "pad",
        crop_pct: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(img_size=img_size, train_crop=train_crop, crop_pct=crop_pct, **kwargs)
        if variant not in _VARIANTS:
            raise ValueError(f"unknown CIFAR variant {variant!r}; choose 'cifar10' or 'cifar100'")
        self.root = Path(root).expanduser()
        self.variant = variant
        self.download = download

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
        if self.train_dataset is not None:
            return
        cls = _VARIANTS[self.variant]
        try:
            self.train_dataset = cls(str(self.root), train=True, transform=self.train_transform(), download=False)
            self.val_dataset = cls(str(self.root), train=False, transform=self.eval_transform(), download=False)
        except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
            raise self._missing(f"{self.folder} is missing or incomplete ({exc})") from exc
