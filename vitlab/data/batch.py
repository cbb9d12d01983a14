"""What a batch holds: its images and targets, and the pixels behind its normalised images."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vitlab.constants import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD


def split_batch(batch: Any, targets: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's (images, targets): `(images, targets)` or a dict holding them in that order; with
    `targets=False` also a bare tensor of images, whose targets are None."""
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, torch.Tensor):
        x, y = batch, None
    elif isinstance(batch, Sequence) and batch and isinstance(batch[0], torch.Tensor):
        x, y = batch[0], (batch[1] if len(batch) > 1 else None)
    else:
        raise TypeError(f"expected a batch of images or (images, targets), got {type(batch).__name__}")
    if targets and y is None:
        raise TypeError("expected a batch of (images, targets), got images only")
    return x, y


def denormalize(
    x: torch.Tensor, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> torch.Tensor:
    """Normalised images `[..., C, H, W]` -> their pixels in float32, not clamped; `mean`/`std` default
    to vitlab's (Inception's), as the transforms' do."""
    std_t = x.new_tensor(std or IMAGENET_INCEPTION_STD, dtype=torch.float32).view(-1, 1, 1)
    return x.float() * std_t + x.new_tensor(mean or IMAGENET_INCEPTION_MEAN, dtype=torch.float32).view(-1, 1, 1)
