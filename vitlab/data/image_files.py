"""`ImageFileDataset`: (path, label) pairs read as images, bad files named or skipped."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from vitlab.data.decode import BadImageError, load_rgb

log = logging.getLogger("vitlab.data")


class ImageFileDataset(Dataset):
    """(path, label) pairs -> (tensor, label); decoding errors name the file.

    With `skip_bad` a bad file is logged once and marked in a shared-memory map (so no worker decodes
    it again, and `bad_image_count` counts distinct files), and its slot is filled by the next good
    file in index order: the dataset length, and so every rank's batch count, must not change.
    """

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Any = None, skip_bad: bool = False) -> None:
        self.samples, self.transform, self.skip_bad = list(samples), transform, skip_bad
        self.bad = torch.zeros(len(self.samples), dtype=torch.uint8).share_memory_()

    @property
    def bad_image_count(self) -> int:
        return int(self.bad.sum())

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        n = len(self.samples)
        for step in range(n):
            i = (index + step) % n
            if self.bad[i]:
                continue
            path, target = self.samples[i]
            try:
                if getattr(self.transform, "decodes", False):  # decode="cpu"/"device": takes the path
                    return self.transform(path, path), target
                img = load_rgb(path)
            except BadImageError as exc:
                if not self.skip_bad:
                    raise
                self.bad[i] = 1
                log.warning("skipping bad image %s (%s)", path, exc.__cause__ or exc)
                continue
            return (self.transform(img) if self.transform is not None else img), target
        raise BadImageError(f"no image in this dataset can be decoded (e.g. {self.samples[index][0]})")
