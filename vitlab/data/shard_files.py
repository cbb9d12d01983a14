"""Shard file access: finding the shard files of a spec, a shard's raw samples, a sample's label and
image, and the `classes.txt` beside the shards."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import webdataset as wds

from vitlab.data.unlabelled import NO_LABELS_FIX, UNLABELLED

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


def _is_remote(spec: str) -> bool:
    return "://" in spec or spec.startswith("pipe:")


def expand_shards(spec: str) -> list[str]:
    """A directory, a glob, a brace pattern (`a-{000000..000009}.tar`), or several joined by '::'."""
    urls: list[str] = []
    for name in wds.shardlists.expand_urls(spec):  # '::' and braces, as webdataset reads them
        name = os.path.expanduser(name.strip())
        if not name or _is_remote(name):
            urls += [name] if name else []
        elif os.path.isdir(name):
            found = sorted(str(p) for p in Path(name).iterdir() if p.name.endswith(SHARD_SUFFIXES))
            if not found:
                raise FileNotFoundError(f"no {'/'.join(SHARD_SUFFIXES)} shards in folder {name}")
            urls += found
        else:
            matches = sorted(glob.glob(name)) if glob.has_magic(name) else [name] if os.path.exists(name) else []
            if not matches:
                raise FileNotFoundError(
                    f"no shard matches {name!r} (from {spec!r}); give a folder, glob or brace pattern"
                )
            urls += matches
    if not urls:
        raise FileNotFoundError(f"no shards in {spec!r}")
    return urls


def _raw_samples(url: str) -> Iterator[dict[str, Any]]:
    """Samples of one shard as dicts of raw bytes (`__key__`, `jpg`, `cls`, ...), via webdataset."""
    try:
        yield from wds.tariterators.tarfile_samples([{"url": url}])
    except Exception as exc:
        raise RuntimeError(f"cannot read shard {url}: {type(exc).__name__}: {exc}") from exc


def sample_label(sample: dict[str, Any], labels: bool = True) -> int:
    """The sample's class index; UNLABELLED (-1) for every sample when `labels` is False."""
    if not labels:
        return UNLABELLED
    if "cls" not in sample:
        raise KeyError(f"{_where(sample)} has no .cls label (has {_exts(sample)}); {NO_LABELS_FIX}")
    try:
        return int(sample["cls"])  # int() reads bytes too, whitespace around the digits included
    except ValueError:
        raise ValueError(f"{_where(sample)}: bad label {sample['cls']!r}") from None


def sample_image(sample: dict[str, Any]) -> bytes:
    for k in IMAGE_KEYS:
        if k in sample:
            return sample[k]
    raise KeyError(f"{_where(sample)} has no image ({'/'.join(IMAGE_KEYS)}); has {_exts(sample)}")


def _where(sample: dict[str, Any]) -> str:
    return f"sample {sample.get('__key__')} in {sample.get('__url__')}"


def _exts(sample: dict[str, Any]) -> str:
    return ", ".join(k for k in sample if not k.startswith("__")) or "nothing"


def read_classes_txt(path: Path) -> list[str] | None:
    if not path.is_file():
        return None
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]
