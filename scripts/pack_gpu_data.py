"""Repack small, class-balanced subsets of the shared shards for `make gpu-check` (bench/gpu_check.py).

The device machine receives the working tree plus carried folders, 64 MiB in all, so the check
trains on subsets: the first N samples of each class, in shard order (deterministic), written as
gzipped webdataset tars (`KEY.jpg` + `KEY.cls`, the original JPEG bytes) with the source's
classes.txt, so labels and class names are those of the full dataset.

    python scripts/pack_gpu_data.py --src ../shared/data --out .gpudata

Layout written (what gpu_check.py passes as `--data_path`):
    OUT/cifar10/train/        CIFAR-10 (validation held out by key, val_fraction)
    OUT/cifar10-small/train/  a small CIFAR-10 subset for the short runs (resume, DDP)
    OUT/tinyimagenet/train/   Tiny-ImageNet-200, all 200 classes
    OUT/tinyimagenet/val/     its official validation split
    OUT/imagenette/train/     Imagenette at 128px (validation held out by key)
"""

from __future__ import annotations

import argparse
import gzip
import io
import shutil
import tarfile
from collections import defaultdict
from pathlib import Path

SOURCES = {  # name: (source folder under --src, destination under --out)
    "cifar10": ("cifar10-train-shards", "cifar10/train"),
    "cifar10_small": ("cifar10-train-shards", "cifar10-small/train"),
    "tinyimagenet": ("tinyimagenet-200-shards/train", "tinyimagenet/train"),
    "tinyimagenet_val": ("tinyimagenet-200-shards/val", "tinyimagenet/val"),
    "imagenette": ("imagenette-128-shards/train", "imagenette/train"),
}
SHARD_SIZE = 5000


def read_samples(folder: Path, per_class: int) -> list[tuple[str, bytes, int]]:
    """(key, jpeg bytes, label) for the first `per_class` samples of each class, in shard order."""
    n_classes = sum(1 for line in (folder / "classes.txt").read_text().splitlines() if line.strip())
    taken: dict[int, int] = defaultdict(int)
    out: list[tuple[str, bytes, int]] = []
    shards = sorted(p for p in folder.iterdir() if p.name.endswith((".tar", ".tar.gz", ".tgz")))
    if not shards:
        raise SystemExit(f"no shards in {folder}; point --src at the shared data folder (see its README.md)")
    for shard in shards:
        if len(out) == n_classes * per_class:
            break  # every class has its share: the remaining shards are not read
        pending: dict[str, dict[str, bytes]] = defaultdict(dict)
        with tarfile.open(shard) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.rpartition(".")
                f = tar.extractfile(member)
                assert f is not None
                pending[key][ext] = f.read()
                sample = pending[key]
                if "cls" in sample and any(e in sample for e in ("jpg", "jpeg", "png")):
                    del pending[key]
                    label = int(sample["cls"].decode().strip())
                    if taken[label] < per_class:
                        taken[label] += 1
                        image = next(sample[e] for e in ("jpg", "jpeg", "png") if e in sample)
                        out.append((key, image, label))
    return out


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shards(samples: list[tuple[str, bytes, int]], dest: Path, prefix: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.tar.gz"):
        old.unlink()
    for i in range(0, len(samples), SHARD_SIZE):
        # gzip: a tar pads each small file to 1 KiB; a zero mtime keeps the bytes reproducible.
        with gzip.GzipFile(dest / f"{prefix}-{i // SHARD_SIZE:06d}.tar.gz", "wb", mtime=0) as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for key, image, label in samples[i : i + SHARD_SIZE]:
                    _add(tar, f"{key}.jpg", image)
                    _add(tar, f"{key}.cls", str(label).encode())


def pack(src: Path, out: Path, per_class: dict[str, int]) -> dict[str, int]:
    """Write every subset; returns the number of samples per subset."""
    counts = {}
    for name, n in per_class.items():
        source, dest = SOURCES[name]
        folder = src / source
        samples = read_samples(folder, n)
        write_shards(samples, out / dest, name)
        shutil.copyfile(folder / "classes.txt", out / dest / "classes.txt")
        counts[name] = len(samples)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, default=Path("../shared/data"), help="the shared data folder")
    p.add_argument("--out", type=Path, default=Path(".gpudata"))
    p.add_argument("--cifar10", type=int, default=5000, help="CIFAR-10 images per class (5000: all)")
    p.add_argument("--cifar10-small", type=int, default=100, help="CIFAR-10 images per class, small subset")
    p.add_argument("--tinyimagenet", type=int, default=40, help="Tiny-ImageNet train images per class (200 classes)")
    p.add_argument("--tinyimagenet-val", type=int, default=10, help="Tiny-ImageNet val images per class")
    p.add_argument("--imagenette", type=int, default=200, help="Imagenette images per class (10 classes)")
    args = p.parse_args(argv)
    per_class = {"cifar10": args.cifar10, "cifar10_small": args.cifar10_small, "tinyimagenet": args.tinyimagenet,
                 "tinyimagenet_val": args.tinyimagenet_val, "imagenette": args.imagenette}  # fmt: skip
    counts = pack(args.src, args.out, per_class)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(", ".join(f"{k} {v}" for k, v in counts.items()) + f" samples; {size / 2**20:.1f} MiB in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
