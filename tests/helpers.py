"""Helpers shared by the tests that train on the real CIFAR subset."""

from __future__ import annotations

from pathlib import Path


def subset_tree(src: Path, dst: Path, classes: list[str], n_train: int, n_val: int) -> Path:
    """A small ImageFolder tree (`train/<class>`, `val/<class>`) of symlinks into the shared subset."""
    for split, n in (("train", n_train), ("val", n_val)):
        for c in classes:
            (dst / split / c).mkdir(parents=True)
            for f in sorted((src / split / c).iterdir())[:n]:
                (dst / split / c / f.name).symlink_to(f)
    return dst
