"""A counter DataLoader worker processes can bump and the main process can read."""

from __future__ import annotations

import torch
from torch.utils.data import get_worker_info


class SharedCounter:
    """A counter that DataLoader worker processes can bump and the main process can read.

    Shared-memory int64 slots, one per worker id (slot 0 for the main process), so no two processes
    write the same slot. Counts are per process group member (per DDP rank).
    """

    SLOTS = 257

    def __init__(self) -> None:
        self._t = torch.zeros(self.SLOTS, dtype=torch.int64).share_memory_()

    def add(self, n: int = 1) -> None:
        info = get_worker_info()
        slot = 0 if info is None else 1 + info.id % (self.SLOTS - 1)
        self._t[slot] += n

    @property
    def value(self) -> int:
        return int(self._t.sum())

    def reset(self) -> None:
        self._t.zero_()
