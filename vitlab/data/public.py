"""The public datasets vitlab's default recipes name, written once into shard folders on first use.

`make pretrain` reads Tiny-ImageNet-200 and `make finetune` Imagenette from `data/<name>/{train,val}/`,
the shard layout `DATA=` also takes. When that folder is missing, `ensure_public` fetches the dataset
from its public source (Tiny-ImageNet from the Hugging Face hub through `datasets`, Imagenette through
torchvision's `Imagenette`) and writes it there as webdataset shards with a `classes.txt`. Offline,
it fails at once with one message that names `DATA=` and the layouts it takes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock

SHARD_SIZE = 5000
OFFLINE_ENV = "VITLAB_OFFLINE"


class DataUnavailable(FileNotFoundError):
    """A dataset is neither on disk nor fetchable; the message says what to give instead."""


def _write_split(out: Path, samples: Iterator[tuple[bytes, int]], class_names: list[str]) -> int:
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    (out / "classes.txt").write_text("\n".join(class_names) + "\n")
    n = 0
    with wds.ShardWriter(str(out / f"{out.name}-%06d.tar"), maxcount=SHARD_SIZE, verbose=0) as sink:
        for n, (jpeg, label) in enumerate(samples, 1):
            sink.write({"__key__": f"{out.name}{n:07d}", "jpg": jpeg, "cls": str(label)})
    return n


def _fetch_tinyimagenet(root: Path) -> None:
    from datasets import Image, load_dataset

    ds = load_dataset("zh-plus/tiny-imagenet").cast_column("image", Image(decode=False))
    names = ds["train"].features["label"].names
    for split, out in (("train", "train"), ("valid", "val")):
        _write_split(root / out, ((r["image"]["bytes"], r["label"]) for r in ds[split]), names)


def _fetch_imagenette(root: Path) -> None:
    from torchvision.datasets import Imagenette

    raw = root / "download"
    for split in ("train", "val"):
        # The loader hands back the file's bytes: the JPEGs go into the shards as they are.
        ds = Imagenette(str(raw), split=split, size="160px", download=split == "train",
                        loader=lambda path: Path(path).read_bytes())  # fmt: skip
        _write_split(root / split, (ds[i] for i in range(len(ds))), [c[0] for c in ds.classes])


SOURCES: dict[str, tuple[str, str, Callable[[Path], None]]] = {
    "tinyimagenet": (
        "huggingface.co",
        "Tiny-ImageNet-200 (Hugging Face hub: zh-plus/tiny-imagenet)",
        _fetch_tinyimagenet,
    ),
    "imagenette": ("s3.amazonaws.com", "Imagenette (torchvision.datasets.Imagenette, 160px)", _fetch_imagenette),
}


def _unavailable(name: str, root: Path, why: str) -> DataUnavailable:
    return DataUnavailable(
        f"{name} is not in {root}/ and cannot be fetched ({why}). Give a local copy: DATA=<folder> with train/ and "
        f"val/ folders of webdataset shards (KEY.jpg + KEY.cls, classes.txt), or train/<class>/*.jpg image "
        f"folders; e.g. DATA=../shared/data/{'tinyimagenet-200' if name == 'tinyimagenet' else 'imagenette-128'}-shards"
    )


def _online(host: str, timeout: float = 3.0) -> str | None:
    """None when `host` answers on 443, else why not."""
    if os.environ.get(OFFLINE_ENV) == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return f"offline: {OFFLINE_ENV}=1 or HF_HUB_OFFLINE=1"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as exc:
        return f"no network: {host} unreachable ({type(exc).__name__})"
    return None


def ensure_public(name: str, root: str | os.PathLike) -> Path:
    """`root` holding `name` as train/ + val/ shard folders, fetched there first if missing."""
    if name not in SOURCES:
        raise ValueError(f"unknown public dataset {name!r}; choose one of {sorted(SOURCES)}")
    root = Path(root)
    done = root / ".complete"
    if done.is_file():
        return root
    host, about, fetch = SOURCES[name]
    why = _online(host)
    if why is not None:
        raise _unavailable(name, root, why)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):  # DDP ranks and parallel runs: one fetches, the rest wait
        if not done.is_file():
            print(f"vitlab: fetching {about} into {root}/ (once)", flush=True)
            fetch(root)
            done.write_text(about + "\n")
    return root
