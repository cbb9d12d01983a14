"""Helpers shared by the tests: small image trees and shards (generated, or on the real CIFAR subset), random
weights for parity."""

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


def _pixels(k: int, gen: torch.Generator, size: int):
    """Noise around a colour of class k (each class's mean colour differs from the others'), HxWx3 uint8."""
    colour = torch.tensor([(37 + 91 * k) % 256, (181 + 53 * k) % 256, (97 + 151 * k) % 256], dtype=torch.float32)
    noise = torch.randn(size, size, 3, generator=gen) * 40
    return (colour + noise).clamp(0, 255).to(torch.uint8).numpy()


def image_tree(dst: Path, classes: list[str], n_train: int, n_val: int, size: int = 32, seed: int = 0) -> Path:
    """A small generated ImageFolder tree (`train/<class>/*.png`, `val/<class>/*.png`) for tests that
    need only pixels: noise around a colour of each class (class k's mean colour differs from the others')."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    for k, c in enumerate(classes):
        for split, n in (("train", n_train), ("val", n_val)):
            (dst / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(_pixels(k, gen, size)).save(dst / split / c / f"{c}_{i:03d}.png")
    return dst


def shard_tree(
    dst: Path, classes: list[str], num_shards: int, per_shard: int, size: int = 32, seed: int = 0
) -> list[str]:
    """Generated webdataset shards in the shared data's format: `dst/shards-00000N.tar.gz`, each of
    `per_shard` samples `KEY.jpg` (JPEG bytes, pixels as `image_tree`'s) + `KEY.cls` (class index as
    text), keys `<class>_<n>` mixed across classes in sha256 order of the key (as the shared shards, so
    which keys a shard holds does not depend on a random generator); `classes.txt` beside.
    Returns the keys in writing order."""
    import hashlib
    import io

    import webdataset as wds
    from PIL import Image

    samples = [(f"{classes[i % len(classes)]}_{i // len(classes):05d}", i % len(classes))
               for i in range(num_shards * per_shard)]  # fmt: skip
    samples.sort(key=lambda s: hashlib.sha256(s[0].encode()).digest())
    gen = torch.Generator().manual_seed(seed)
    dst.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(dst / "shards-%06d.tar.gz"), maxcount=per_shard, verbose=0, mtime=0) as sink:
        for key, y in samples:
            buf = io.BytesIO()
            Image.fromarray(_pixels(y, gen, size)).save(buf, format="JPEG", quality=90)
            sink.write({"__key__": key, "jpg": buf.getvalue(), "cls": str(y)})
    (dst / "classes.txt").write_text("\n".join(classes) + "\n")
    return [key for key, _ in samples]
