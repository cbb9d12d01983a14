"""Helpers shared by the tests: small image trees (generated, or on the real CIFAR subset), random weights for parity."""

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


def image_tree(dst: Path, classes: list[str], n_train: int, n_val: int, size: int = 32, seed: int = 0) -> Path:
    """A small generated ImageFolder tree (`train/<class>/*.png`, `val/<class>/*.png`) for tests that
    need only pixels: noise around a colour of each class (class k's mean colour differs from the others')."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    for k, c in enumerate(classes):
        colour = torch.tensor([(37 + 91 * k) % 256, (181 + 53 * k) % 256, (97 + 151 * k) % 256], dtype=torch.float32)
        for split, n in (("train", n_train), ("val", n_val)):
            (dst / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                noise = torch.randn(size, size, 3, generator=gen) * 40
                pixels = (colour + noise).clamp(0, 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(dst / split / c / f"{c}_{i:03d}.png")
    return dst
