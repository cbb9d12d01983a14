"""The in-memory path: decode a dataset once into uint8 tensors, then augment whole batches on the device.

Per-image JPEG decoding and PIL augmentation take the cores the model needs; for a dataset that fits in
RAM (Tiny-ImageNet: 60k x 64x64, 0.7 GB; Imagenette at 128px: 0.5 GB) the decode is paid once at setup
and a step only indexes a tensor (on a GPU, one that never crosses the bus). Each image of a batch gets
its own random crop and flip, one affine map sampled in a single `grid_sample` call, then normalisation
and MixUp/CutMix. Validation images are preprocessed at decode time with the streaming path's own
transform (`eval_transform` minus the float conversion), so metrics are the same on both paths.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from vitlab.data.transforms import TrainCrop

log = logging.getLogger("vitlab.data")


class MemoryImages(Dataset):
    """uint8 images [N, 3, H, W] and int64 labels [N]; `__getitems__` returns a whole batch at once."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, keys: Sequence[str] | None = None) -> None:
        self.images, self.labels = images, labels.long()
        self.keys = list(keys) if keys is not None else None

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, device=self.images.device)
        return self.images[idx], self.labels[idx]

    def to(self, device: torch.device | str) -> MemoryImages:
        self.images, self.labels = self.images.to(device), self.labels.to(device)
        return self


def batch_collate(batch: Any) -> Any:
    """The batch `MemoryImages.__getitems__` already built (a module-level function, so it pickles)."""
    return batch


def _fit_square(img: Image.Image, size: int) -> Image.Image:
    """Resize the short side to `size` and centre-crop a square (only for images of another size)."""
    if img.size == (size, size):
        return img
    return TF.center_crop(TF.resize(img, size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True), size)


def decode_into_memory(
    samples: Iterable[tuple[str, Image.Image, int]], count: int, transform: Any = None
) -> MemoryImages:
    """(key, RGB image, label) samples -> MemoryImages.

    `transform` (a PIL -> PIL transform, e.g. the evaluation resize + crop) is applied first; otherwise
    images are stored at the first image's side (others are resized and centre-cropped to it). `count`
    preallocates the tensor; a different number of samples is an error (the index lied).
    """
    start = time.perf_counter()
    size: int | None = None
    images: torch.Tensor | None = None
    labels = torch.empty(count, dtype=torch.int64)
    keys: list[str] = []
    for i, (key, img, label) in enumerate(samples):
        img = transform(img) if transform is not None else _fit_square(img, size or min(img.size))
        t = TF.pil_to_tensor(img)
        if images is None:
            size = t.shape[-1]
            images = torch.empty((count, *t.shape), dtype=torch.uint8)
            log.info("decoding %d images into memory as %s uint8 (%.2f GB)", count, tuple(t.shape),
                     images.numel() / 1e9)  # fmt: skip
        images[i] = t
        labels[i] = label
        keys.append(key)
    if images is None or len(keys) != count:
        raise RuntimeError(f"expected {count} samples, decoded {len(keys)}")
    log.info("decoded %d images in %.1f s", count, time.perf_counter() - start)
    return MemoryImages(images, labels, keys)


def sample_crop_boxes(
    n: int,
    train_crop: TrainCrop = "rrc",
    scale_min: float = 0.08,
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    pad_fraction: float = 1 / 8,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Per-image crop boxes [n, 4] as (centre x, centre y, width, height), fractions of the source side.

    `rrc`: area fraction ~ U(scale_min, 1) and log aspect ratio ~ U(log ratio), as RandomResizedCrop;
    a box wider or taller than the image is shrunk to fit, keeping its aspect (torchvision instead
    retries ten times, then falls back to a centre crop). `pad`: the whole image shifted by up to
    `pad_fraction` of its side in each direction (the zero-padded random crop).
    """
    u = torch.rand(n, 4, device=device, generator=generator)
    if train_crop == "pad":
        shift = (2 * u[:, :2] - 1) * pad_fraction
        return torch.cat([0.5 + shift, torch.ones(n, 2, device=device)], dim=1)
    if train_crop != "rrc":
        raise ValueError(f"unknown train_crop {train_crop!r}; choose 'rrc' or 'pad'")
    area = scale_min + (1 - scale_min) * u[:, 0]
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u[:, 1])
    w, h = torch.sqrt(area * aspect), torch.sqrt(area / aspect)
    shrink = torch.clamp(torch.maximum(w, h), min=1.0)
    w, h = w / shrink, h / shrink
    cx = w / 2 + (1 - w) * u[:, 2]
    cy = h / 2 + (1 - h) * u[:, 3]
    return torch.stack([cx, cy, w, h], dim=1)


def crop_resize(
    images: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int], flip: torch.Tensor | None = None
) -> torch.Tensor:
    """Sample each image's box (see `sample_crop_boxes`) at `size`, mirrored where `flip`; bilinear.

    Outside the image (pad crops) reads zeros. A whole-image box at the image's own size returns it exactly.
    """
    n = images.shape[0]
    cx, cy, w, h = boxes.unbind(1)
    sx = w * (1 - 2 * flip.to(w.dtype)) if flip is not None else w
    theta = torch.zeros(n, 2, 3, device=images.device, dtype=images.dtype)
    theta[:, 0, 0], theta[:, 0, 2] = sx, 2 * cx - 1
    theta[:, 1, 1], theta[:, 1, 2] = h, 2 * cy - 1
    grid = F.affine_grid(theta, [n, images.shape[1], *size], align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


@dataclass
class BatchAugment:
    """Train batches: uint8 [B, 3, H, W] on the device -> augmented, normalised float; targets mixed
    (MixUp/CutMix) when `mix` is given."""

    img_size: int
    train_crop: TrainCrop
    scale_min: float
    hflip: bool
    mean: Sequence[float]
    std: Sequence[float]
    mix: Any = None

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`size`: crop to this side instead of img_size (progressive resizing)."""
        n = images.shape[0]
        x = images.float().div_(255)
        boxes = sample_crop_boxes(n, self.train_crop, self.scale_min, device=x.device)
        flip = torch.rand(n, device=x.device) < 0.5 if self.hflip else None
        x = crop_resize(x, boxes, (size or self.img_size,) * 2, flip)
        x = TF.normalize(x, list(self.mean), list(self.std))
        if self.mix is not None:
            x, labels = self.mix(x, labels)
        return x, labels


def normalise_batch(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Evaluation batches (already resized and cropped at decode time): uint8 -> normalised float."""
    return TF.normalize(images.float().div_(255), list(mean), list(std))
