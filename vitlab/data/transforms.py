"""Image transforms (torchvision.transforms.v2) and the MixUp/CutMix batch collate.

`eval_transform` is the one piece inference code needs: it rebuilds a model's preprocessing from its
`data_config` (img_size, mean, std, interpolation, crop_pct), so a checkpoint carries everything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision.transforms import v2

from vitlab.constants import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD

if TYPE_CHECKING:
    from vitlab.models.vit import VisionTransformer

DEFAULT_MEAN = IMAGENET_INCEPTION_MEAN  # what vitlab's models and Google's checkpoints expect
DEFAULT_STD = IMAGENET_INCEPTION_STD
TrainCrop = Literal["rrc", "pad"]
AutoAugment = Literal["randaugment", "trivialaugment"]

INTERPOLATIONS = ("bicubic", "bilinear", "lanczos", "nearest")


def interpolation_mode(name: str) -> v2.InterpolationMode:
    if name.lower() not in INTERPOLATIONS:
        raise ValueError(f"unknown interpolation {name!r}; choose one of {list(INTERPOLATIONS)}")
    return v2.InterpolationMode(name.lower())


def _hw(img_size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(img_size, int):
        return img_size, img_size
    h, w = (int(s) for s in img_size)
    return h, w


def pil_to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode (L, LA, P, RGBA, CMYK, I;16...) -> RGB; alpha is dropped, as PIL's convert does."""
    if img.mode == "RGB":
        return img
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # PIL warns when a palette image with transparency goes straight to RGB
    return img.convert("RGB")


class ToRGB:
    """PIL image or uint8 tensor [C, H, W] with C in {1, 3, 4} -> three channels."""

    def __call__(self, img: Any) -> Any:
        if isinstance(img, Image.Image):
            return pil_to_rgb(img)
        if isinstance(img, torch.Tensor):
            if img.ndim == 2:
                img = img.unsqueeze(0)
            if img.ndim != 3:
                raise ValueError(f"expected an image tensor [C, H, W], got shape {tuple(img.shape)}")
            c = img.shape[0]
            if c in (1, 2):  # grey (+ alpha)
                return img[:1].expand(3, -1, -1).clone()
            if c in (3, 4):  # RGB (+ alpha)
                return img[:3]
            raise ValueError(f"expected 1, 2, 3 or 4 channels, got {c} (shape {tuple(img.shape)})")
        raise TypeError(f"expected a PIL image or an image tensor, got {type(img).__name__}")

    def __repr__(self) -> str:
        return "ToRGB()"


def _to_normalised(mean: Sequence[float], std: Sequence[float]) -> list[Any]:
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]


def train_transform(
    img_size: int | Sequence[int] = 224,
    *,
    train_crop: TrainCrop = "rrc",
    scale_min: float = 0.08,
    hflip: bool = True,
    auto_augment: AutoAugment | None = "randaugment",
    randaugment_magnitude: int = 9,
    mean: Sequence[float] = DEFAULT_MEAN,
    std: Sequence[float] = DEFAULT_STD,
    interpolation: str = "bicubic",
) -> v2.Compose:
    """Training augmentation: crop -> flip -> auto-augment -> float tensor, normalised.

    `train_crop="rrc"` is Inception-style RandomResizedCrop (ImageNet); `"pad"` resizes to `img_size`
    (a no-op for native-size data) and takes a random crop of the image zero-padded by 1/8 of its
    side, the classic 32px CIFAR recipe where RRC's rescaling would destroy most of a tiny image.
    """
    size = _hw(img_size)
    interp = interpolation_mode(interpolation)
    ops: list[Any] = [ToRGB()]
    if train_crop == "rrc":
        if not 0.0 < scale_min <= 1.0:
            raise ValueError(f"scale_min must be in (0, 1], got {scale_min}")
        ops.append(v2.RandomResizedCrop(size, scale=(scale_min, 1.0), interpolation=interp, antialias=True))
    elif train_crop == "pad":
        pad = max(1, round(min(size) / 8))
        ops += [v2.Resize(size, interpolation=interp, antialias=True), v2.RandomCrop(size, padding=pad)]
    else:
        raise ValueError(f"unknown train_crop {train_crop!r}; choose 'rrc' (RandomResizedCrop) or 'pad'")
    if hflip:
        ops.append(v2.RandomHorizontalFlip())
    if auto_augment == "randaugment":
        ops.append(v2.RandAugment(magnitude=randaugment_magnitude, interpolation=interp))
    elif auto_augment == "trivialaugment":
        ops.append(v2.TrivialAugmentWide(interpolation=interp))
    elif auto_augment is not None:
        raise ValueError(f"unknown auto_augment {auto_augment!r}; choose 'randaugment', 'trivialaugment' or None")
    return v2.Compose(ops + _to_normalised(mean, std))


class SizedTransform:
    """A transform built per size, applied at the size a shared-memory tensor holds now (progressive
    resizing): DataLoader workers, persistent ones too, read the size the main process set for the
    epoch. `build(size)` must pickle (a module-level function or a partial of one)."""

    def __init__(self, size: torch.Tensor, build: Callable[[int], Any]) -> None:
        self.size, self.build = size, build
        self._built: dict[int, Any] = {}
        self.decodes = getattr(build(int(size)), "decodes", False)  # takes encoded images, as what it builds

    def __call__(self, *args: Any) -> Any:
        size = int(self.size)
        if size not in self._built:
            self._built[size] = self.build(size)
        return self._built[size](*args)

    def __repr__(self) -> str:
        return f"SizedTransform(size={int(self.size)}, build={self.build!r})"


def eval_transform(model_or_data_config: VisionTransformer | Mapping[str, Any]) -> v2.Compose:
    """The evaluation preprocessing of a model (anything with `.data_config`) or of a data_config dict.

    Resize the short side to img_size / crop_pct, centre-crop img_size, scale to [0, 1], normalise.
    Accepts a PIL image (any mode) or a uint8 tensor [C, H, W] (1, 3 or 4 channels); returns a float
    tensor [3, H, W]. crop_pct=1.0 makes it a plain resize for square inputs (vitlab's 32px default).
    """
    cfg = getattr(model_or_data_config, "data_config", model_or_data_config)
    if not isinstance(cfg, Mapping):
        raise TypeError(f"expected a model with .data_config or a data_config dict, got {type(cfg).__name__}")
    if "img_size" not in cfg:
        raise ValueError(f"data_config has no 'img_size': {dict(cfg)}")
    h, w = _hw(cfg["img_size"])
    crop_pct = float(cfg.get("crop_pct") or 1.0)
    if not 0.0 < crop_pct <= 1.0:
        raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
    interp = interpolation_mode(cfg.get("interpolation") or "bicubic")
    # floor, as timm does: 224 / 0.875 -> 256, 224 / 0.9 -> 248
    resize = int(h / crop_pct) if h == w else (int(h / crop_pct), int(w / crop_pct))
    ops = [
        ToRGB(),
        v2.Resize(resize, interpolation=interp, antialias=True),
        v2.CenterCrop((h, w)),
    ]
    return v2.Compose(ops + _to_normalised(cfg.get("mean") or DEFAULT_MEAN, cfg.get("std") or DEFAULT_STD))


class MixupCutmixCollate:
    """collate_fn: stack the batch, then MixUp or CutMix it (one picked per batch when both are on).

    Labels come out as soft targets [B, num_classes] (float) when either alpha > 0, else as class
    indices [B]. A class (not a closure) so DataLoader workers can pickle it.
    """

    def __init__(self, num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0) -> None:
        if mixup_alpha < 0 or cutmix_alpha < 0:
            raise ValueError(f"mixup_alpha/cutmix_alpha must be >= 0, got {mixup_alpha}/{cutmix_alpha}")
        self.num_classes = num_classes
        ops: list[Any] = []
        if mixup_alpha > 0:
            ops.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            ops.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        self.mix = None if not ops else ops[0] if len(ops) == 1 else v2.RandomChoice(ops)

    def __call__(self, batch: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = default_collate(batch)
        if self.mix is not None:
            images, labels = self.mix(images, labels)
        return images, labels


mixup_cutmix_collate = MixupCutmixCollate  # the public name (vitlab.data)
