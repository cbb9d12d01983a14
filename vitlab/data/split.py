"""Held-out validation splits decided by keys alone: the same on every rank, in every run."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def name_hash(name: str) -> int:
    """A stable 64-bit hash (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


def key_in_val(key: str, val_fraction: float) -> bool:
    """Held-out membership of one sample from its key (independent of shard order and count)."""
    return name_hash(key) < val_fraction * 2.0**64


def held_out_split(targets: Sequence[int], fraction: float, keys: Sequence[Any]) -> tuple[list[int], list[int]]:
    """(train, val) indices: per class, the round(fraction * n) items of lowest key go to val; with
    fraction > 0, a class of two or more gives at least one and keeps at least one for train.

    The keys decide the draw: hashes of the file names (`name_hash`, independent of directory-listing
    order) for image folders, a seeded permutation for CIFAR, whose images have no names.
    """
    by_class: dict[int, list[tuple[Any, int]]] = {}
    for i, (target, key) in enumerate(zip(targets, keys)):
        by_class.setdefault(target, []).append((key, i))
    val: set[int] = set()
    for items in by_class.values():
        k = round(fraction * len(items))
        if fraction > 0 and len(items) >= 2:
            k = min(max(k, 1), len(items) - 1)
        val.update(i for _, i in sorted(items)[:k])
    return [i for i in range(len(targets)) if i not in val], sorted(val)
