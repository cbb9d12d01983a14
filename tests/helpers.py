"""Helpers shared by the tests: small image trees on the real CIFAR subset, random weights for parity."""

from __future__ import annotations

from pathlib import Path

import torch


def subset_tree(src: Path, dst: Path, classes: list[str], n_train: int, n_val: int) -> Path:
    """A small ImageFolder tree (`train/<class>`, `val/<class>`) of symlinks into the shared subset."""
    for split, n in (("train", n_train), ("val", n_val)):
        for c in classes:
            (dst / split / c).mkdir(parents=True)
            for f in sorted((src / split / c).iterdir())[:n]:
                (dst / split / c / f.name).symlink_to(f)
    return dst


def perturb(model: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    """Random values added everywhere, in eval mode: peers initialise biases, norms and heads to
    0 or 1, which would hide a tensor mapped to the wrong place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * std)
    return model.eval()
