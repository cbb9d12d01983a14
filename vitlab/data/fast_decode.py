"""The fast CPU path (`decode="cpu"`): encoded image -> uint8 tensor [3, S, S] at the size training uses.

Per image, a DataLoader worker does only what cannot be batched:

- the RandomResizedCrop box is drawn first, from the image's header size alone, with torchvision's own
  `RandomResizedCrop.get_params` (the recipes' scale and ratio ranges, the same retries and fallback);
- a JPEG is then decoded at the smallest DCT scale (1/2, 1/4, 1/8: libjpeg's, through PIL's `draft`)
  that still leaves the crop at least the target size, so a 500x375 picture whose crop is 300 px wide
  is decoded at half size, four times fewer pixels;
- crop and resize are one PIL `resize(box=...)` (bicubic, antialiased), so only the crop is resampled;
- the flip and RandAugment run on the small uint8 result, never on floats.

The float conversion, normalisation and MixUp/CutMix run batched on the training device
(`DeviceBatchPrep`, from the DataModule's `on_after_batch_transfer`), as the in-memory path does.
Evaluation gives today's `eval_transform` pixels: the short side resized to img_size / crop_pct from a
reduced-scale decode where the resize allows it, then the same centre crop.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from vitlab.data.decode import BadImageError, load_rgb
from vitlab.data.transforms import AutoAugment, interpolation_mode, pil_to_rgb

Source = str | os.PathLike | bytes
PIL_FILTERS = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR,
               "lanczos": Image.Resampling.LANCZOS, "nearest": Image.Resampling.NEAREST}  # fmt: skip
RESAMPLABLE = ("RGB", "L", "CMYK")  # modes PIL resizes as they are; others (P, 1, I;16, RGBA...) go to RGB first


def _name(src: Source) -> str:
    return "<bytes>" if isinstance(src, bytes) else str(src)


def read_bytes(src: Source, name: str) -> bytes:
    if isinstance(src, bytes):
        return src
    try:
        with open(src, "rb") as f:
            return f.read()
    except OSError as exc:
        raise BadImageError(f"cannot read image {name}: {type(exc).__name__}: {exc}") from exc


def open_image(data: bytes, name: str) -> Image.Image:
    """Open lazily: the header is read (size, mode, format), the pixels not yet. Names `name` when it fails."""
    try:
        return Image.open(io.BytesIO(data))
    except Exception as exc:
        raise BadImageError(f"cannot decode image {name}: {type(exc).__name__}: {exc}") from exc


def decode_rgb_tensor(data: bytes, name: str) -> torch.Tensor:
    """Bytes -> uint8 [3, H, W] by torchvision.io (libjpeg-turbo, libpng, libwebp; grey and CMYK JPEGs
    converted to RGB), PIL for the formats it lacks (BMP, TIFF...). BadImageError names `name`."""
    try:
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError) as first:  # ValueError: empty bytes
        try:
            return TF.pil_to_tensor(load_rgb(data, name))
        except BadImageError as exc:
            raise BadImageError(f"{exc} (torchvision.io: {str(first).splitlines()[-1]})") from first


def dct_scale(img: Image.Image, need_w: float, need_h: float) -> int:
    """The largest libjpeg DCT reduction (1, 2, 4 or 8) that keeps a JPEG at least need_w x need_h pixels,
    as PIL's `draft` picks it; 1 for other formats."""
    if img.format != "JPEG" or len(getattr(img, "tile", ())) != 1:
        return 1
    scale = min(img.width // max(1, math.ceil(need_w)), img.height // max(1, math.ceil(need_h)))
    return next((s for s in (8, 4, 2) if scale >= s), 1)


def reduced_decode(img: Image.Image, scale: int, name: str) -> Image.Image:
    """Decode a lazily opened JPEG at 1/scale of its size (libjpeg's DCT scaling, through PIL's draft,
    which picks min(width // w, height // h) for a request w x h: hence the floor)."""
    try:
        width = img.width  # draft changes img.size to the reduced one
        drafted = img.draft("RGB", (width // scale, img.height // scale)) if scale > 1 else None
        got = round(width / drafted[1][2]) if drafted is not None else 1  # draft's box: the original's size
        if got != scale:
            raise RuntimeError(f"libjpeg decoded at 1/{got}, not 1/{scale}")  # a crop box would be misplaced
        img.load()  # the decode; a truncated or corrupt file fails here, named
        return img if img.mode in RESAMPLABLE else pil_to_rgb(img)
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError... per format
        raise BadImageError(f"cannot decode image {name}: {type(exc).__name__}: {exc}") from exc


def to_uint8_tensor(img: Image.Image) -> torch.Tensor:
    """An RGB, L or CMYK PIL image -> uint8 [3, H, W]."""
    return TF.pil_to_tensor(img if img.mode == "RGB" else img.convert("RGB"))


class FastTrainDecode:
    """Encoded image (bytes or path) -> uint8 [3, size, size]: RandomResizedCrop (from a reduced-scale
    decode where the crop allows one), flip, then RandAugment/TrivialAugment on the uint8 tensor
    (torchvision v2; its geometric ops run bilinear on tensors, which lack bicubic). Picklable."""

    decodes = True  # takes (source, name), not a decoded image (ShardDecoder, ImageFileDataset)

    def __init__(
        self,
        size: int,
        scale_min: float = 0.08,
        hflip: bool = True,
        auto_augment: AutoAugment | None = None,
        randaugment_magnitude: int = 9,
        interpolation: str = "bicubic",
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ) -> None:
        if not 0.0 < scale_min <= 1.0:
            raise ValueError(f"scale_min must be in (0, 1], got {scale_min}")
        self.size, self.scale, self.ratio, self.hflip = int(size), (scale_min, 1.0), ratio, hflip
        self.interp = interpolation_mode(interpolation)
        self.filter = PIL_FILTERS[interpolation.lower()]
        geometric = v2.InterpolationMode.NEAREST if self.interp == v2.InterpolationMode.NEAREST else \
            v2.InterpolationMode.BILINEAR  # fmt: skip
        if auto_augment == "randaugment":
            self.augment: Any = v2.RandAugment(magnitude=randaugment_magnitude, interpolation=geometric)
        elif auto_augment == "trivialaugment":
            self.augment = v2.TrivialAugmentWide(interpolation=geometric)
        elif auto_augment is None:
            self.augment = None
        else:
            raise ValueError(f"unknown auto_augment {auto_augment!r}; choose 'randaugment', 'trivialaugment' or None")

    def crop(self, src: Source, name: str) -> torch.Tensor:
        """The RandomResizedCrop of the image at `size`, uint8 [3, size, size]; the box is torchvision's
        `RandomResizedCrop.get_params` draw on the original's size."""
        data = read_bytes(src, name)
        img = open_image(data, name)
        top, left, h, w = T.RandomResizedCrop.get_params(img, list(self.scale), list(self.ratio))
        r = self.size / min(h, w)  # a reduced decode must keep the crop's short side >= size
        scale = dct_scale(img, img.width * r, img.height * r)
        if scale > 1:  # libjpeg decodes 1/scale of the pixels; the box is mapped onto them
            small = reduced_decode(img, scale, name)
            box = (left / scale, top / scale, (left + w) / scale, (top + h) / scale)
            return to_uint8_tensor(small.resize((self.size, self.size), self.filter, box=box))
        full = decode_rgb_tensor(data, name)
        return TF.resized_crop(full, top, left, h, w, [self.size, self.size], self.interp, antialias=True)

    def __call__(self, src: Source, name: str = "") -> torch.Tensor:
        out = self.crop(src, name or _name(src))
        if self.hflip and torch.rand(()) < 0.5:
            out = TF.horizontal_flip(out)
        return self.augment(out) if self.augment is not None else out


class FastEvalDecode:
    """Encoded image -> uint8 [3, h, w]: today's eval_transform pixels (short side to img_size / crop_pct,
    centre crop) up to the float conversion, from a reduced-scale decode where the resize allows it."""

    decodes = True

    def __init__(self, img_size: int | Sequence[int], crop_pct: float = 0.9, interpolation: str = "bicubic") -> None:
        self.h, self.w = (img_size, img_size) if isinstance(img_size, int) else (int(s) for s in img_size)
        if not 0.0 < crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
        self.interp = interpolation_mode(interpolation)
        # floor, as eval_transform (and timm) do: 224 / 0.9 -> 248
        self.resize: int | tuple[int, int] = (
            int(self.h / crop_pct) if self.h == self.w else (int(self.h / crop_pct), int(self.w / crop_pct))
        )

    def _out_size(self, width: int, height: int) -> list[int]:
        """The resized [h, w] torchvision's Resize gives the original (short side, long side floored)."""
        if isinstance(self.resize, tuple):
            return list(self.resize)
        short, long = sorted((width, height))
        new_long = int(self.resize * long / short)
        return [self.resize, new_long] if height <= width else [new_long, self.resize]

    def __call__(self, src: Source, name: str = "") -> torch.Tensor:
        name = name or _name(src)
        img = open_image(read_bytes(src, name), name)
        oh, ow = self._out_size(img.width, img.height)
        img = reduced_decode(img, dct_scale(img, ow, oh), name)  # scale 1: the full decode, named if bad
        img = TF.resize(img if img.mode == "RGB" else img.convert("RGB"), [oh, ow], self.interp, antialias=True)
        return to_uint8_tensor(TF.center_crop(img, [self.h, self.w]))
