"""Batches finished on the training device: `decode="cpu"` (uint8 crops from the workers) and
`decode="device"` (encoded bytes from the workers, decoded here: nvJPEG on a GPU, libjpeg on the CPU).

Either way the float conversion, normalisation and MixUp/CutMix run once per batch where the model
is, from the DataModule's `on_after_batch_transfer`; the worker's share of a sample is only what cannot
be batched. On `device`, workers only read the tar member or the file; here `torchvision.io.decode_jpeg`
decodes the batch's JPEGs in one call on the batch's device, other formats (PNG, WEBP, BMP...) are
decoded on the CPU and moved, and undecodable bytes are named by shard and key (or file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as TF

from vitlab.data.decode import BadImageError
from vitlab.data.fast_decode import FastEvalDecode, Source, decode_rgb_tensor, read_bytes

JPEG_MAGIC = b"\xff\xd8\xff"


@dataclass
class EncodedImage:
    """An image's file bytes and where they came from (shard:key or path), for the error that names it."""

    data: bytes
    name: str


class KeepEncoded:
    """The `decode="device"` worker transform: read the bytes, decode nothing."""

    decodes = True  # takes (source, name) (ShardDecoder, ImageFileDataset)

    def __call__(self, src: Source, name: str = "") -> EncodedImage:
        name = name or ("<bytes>" if isinstance(src, bytes) else str(src))
        return EncodedImage(read_bytes(src, name), name)


class EncodedBatch:
    """A batch of encoded images. Not a tensor, list or dataclass, so Lightning's batch transfer leaves it
    on the host: nvJPEG reads its input from host memory."""

    def __init__(self, images: list[EncodedImage]) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)


def encoded_collate(batch: list[tuple[EncodedImage, Any]]) -> tuple[EncodedBatch, torch.Tensor]:
    """collate_fn for `decode="device"`: (EncodedBatch, labels)."""
    return EncodedBatch([img for img, _ in batch]), default_collate([label for _, label in batch])


def decode_batch(batch: EncodedBatch, device: torch.device | str) -> list[torch.Tensor]:
    """Every image of `batch` as uint8 [3, H, W] on `device`: the JPEGs in one `decode_jpeg` call (grey
    and CMYK converted to RGB), the rest one by one on the CPU. A bad image raises BadImageError naming it."""
    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(batch)
    jpegs = [i for i, img in enumerate(batch.images) if img.data[:3] == JPEG_MAGIC]
    if jpegs:
        data = [torch.frombuffer(bytearray(batch.images[i].data), dtype=torch.uint8) for i in jpegs]
        try:
            decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one bad JPEG fails the whole call: find and name it
            decoded = [_decode_one(batch.images[i], device) for i in jpegs]
        for i, t in zip(jpegs, decoded):
            out[i] = t
    for i, img in enumerate(batch.images):
        if out[i] is None:
            out[i] = decode_rgb_tensor(img.data, img.name).to(device, non_blocking=True)
    return out  # type: ignore[return-value]


def _decode_one(img: EncodedImage, device: torch.device) -> torch.Tensor:
    try:
        return decode_jpeg(torch.frombuffer(bytearray(img.data), dtype=torch.uint8), mode=ImageReadMode.RGB,
                           device=device)  # fmt: skip
    except RuntimeError as exc:
        raise BadImageError(f"cannot decode image {img.name}: {str(exc).splitlines()[-1]}") from exc


def _resize(img: torch.Tensor, size: Sequence[int], interpolation: str) -> torch.Tensor:
    """uint8 [3, h, w] -> float [3, *size] in [0, 255], antialiased (float: CUDA lacks uint8 bicubic)."""
    mode = {"bicubic": "bicubic", "bilinear": "bilinear"}.get(interpolation, "bilinear")
    x = F.interpolate(img.unsqueeze(0).float(), size=list(size), mode=mode, antialias=True, align_corners=False)
    return x.squeeze(0).clamp_(0, 255)


@dataclass
class DeviceBatchPrep:
    """uint8 batches [B, 3, S, S], or EncodedBatch, on the training device -> normalised float; train
    batches MixUp/CutMix-ed when `mix` is given. For an EncodedBatch: decode (`decode_batch`), then per
    image torchvision's RandomResizedCrop draw + antialiased resize (train) or the eval resize and centre
    crop (`FastEvalDecode`'s sizes), then one batched flip, normalisation and mix."""

    img_size: int
    scale_min: float
    hflip: bool
    mean: Sequence[float]
    std: Sequence[float]
    crop_pct: float = 0.9
    interpolation: str = "bicubic"
    mix: Any = None
    augment: Any = None  # per image on uint8 [3, S, S] (RandAugment, TrivialAugment), train only
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def _crops(self, images: list[torch.Tensor], size: int) -> torch.Tensor:
        out = []
        for img in images:
            top, left, h, w = T.RandomResizedCrop.get_params(img, [self.scale_min, 1.0], list(self.ratio))
            crop = _resize(img[:, top : top + h, left : left + w], (size, size), self.interpolation).round_()
            out.append(crop if self.augment is None else self.augment(crop.to(torch.uint8)).float())
        return torch.stack(out)

    def _eval(self, images: list[torch.Tensor]) -> torch.Tensor:
        sizes = FastEvalDecode(self.img_size, self.crop_pct, self.interpolation)
        out = []
        for img in images:
            resized = _resize(img, sizes._out_size(img.shape[-1], img.shape[-2]), self.interpolation)
            out.append(TF.center_crop(resized.round_(), [sizes.h, sizes.w]))
        return torch.stack(out)

    def __call__(
        self, images: torch.Tensor | EncodedBatch, labels: torch.Tensor, train: bool, size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`size`: train crops at this side instead of img_size (progressive resizing)."""
        if isinstance(images, EncodedBatch):
            decoded = decode_batch(images, labels.device)
            x = self._crops(decoded, size or self.img_size) if train else self._eval(decoded)
            if train and self.hflip:
                flip = torch.rand(len(decoded), device=x.device) < 0.5
                x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        else:
            x = images.float()  # uint8 crops, flipped and augmented in the workers
        x = TF.normalize(x.div_(255), list(self.mean), list(self.std))
        if train and self.mix is not None:
            x, labels = self.mix(x, labels)
        return x, labels


def check_decode(decode: str, train_crop: str) -> None:
    """One line naming the fix for a decode setting the data module cannot serve."""
    if decode not in ("pil", "cpu", "device"):
        raise ValueError(f"unknown decode {decode!r}; choose 'pil' (per-image PIL, floats from the workers), "
                         "'cpu' (uint8 crops from the workers) or 'device' (decode on the training device)")  # fmt: skip
    if decode != "pil" and train_crop != "rrc":
        raise ValueError(f"decode={decode!r} serves train_crop='rrc' (RandomResizedCrop); set decode: pil for "
                         f"train_crop={train_crop!r}")  # fmt: skip

