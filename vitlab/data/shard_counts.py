"""Per-shard sample counts: read from the shard index (vitlab.data.shard_index), counted where it is
missing or out of date, or assumed from `num_samples`; and `vitlab index-shards`, which writes the index
ahead."""

from __future__ import annotations

import argparse
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vitlab.data.loaders import available_cpus
from vitlab.data.shard_files import _is_remote, _raw_samples, expand_shards, sample_image, sample_label
from vitlab.data.shard_index import SHARD_INDEX, ShardCounts, index_locations, indexed_counts
from vitlab.data.split import key_in_val

_REMOTE_COUNTS: dict[tuple, ShardCounts] = {}  # remote shards have no index: counted once per process


def _count_shards(urls: list[str], val_fraction: float, labels: bool) -> list[ShardCounts]:
    """Read shards through, a few at once (zlib frees the GIL): sample count, held-out count, largest label."""

    def count(url: str) -> ShardCounts:
        total = val = 0
        max_label = -1
        for sample in _raw_samples(url):
            sample_image(sample)  # every sample must have an image; fail at indexing, not mid-epoch
            max_label = max(max_label, sample_label(sample, labels))
            total += 1
            val += val_fraction > 0 and key_in_val(sample["__key__"], val_fraction)
        return ShardCounts(total, total - val, val, max_label)

    with ThreadPoolExecutor(max(1, min(len(urls), available_cpus(), 8))) as pool:
        return list(pool.map(count, urls))


def index_shards(urls: list[str], val_fraction: float = 0.0, labels: bool = True) -> list[ShardCounts]:
    """Per-shard sample counts (and held-out split counts): local shards from their index
    (vitlab.data.shard_index), counted and indexed where it is missing or out of date."""
    count = functools.partial(_count_shards, val_fraction=val_fraction, labels=labels)
    local = [u for u in urls if not _is_remote(u)]
    counts = dict(zip(local, indexed_counts(local, count, val_fraction, labels)))
    remote = [u for u in urls if _is_remote(u) and (u, val_fraction, labels) not in _REMOTE_COUNTS]
    _REMOTE_COUNTS.update({(u, val_fraction, labels): c for u, c in zip(remote, count(remote))})
    return [counts[u] if u in counts else _REMOTE_COUNTS[u, val_fraction, labels] for u in urls]


def assumed_counts(num_samples: int, num_shards: int) -> list[int]:
    """Counts for shards all full but the last (ShardWriter's output), without reading them."""
    per = -(-num_samples // num_shards)
    last = num_samples - per * (num_shards - 1)
    if last <= 0:
        raise ValueError(
            f"num_samples={num_samples} cannot fill {num_shards} shards as all-full-but-the-last; "
            "leave num_samples unset to have the shards counted"
        )
    return [per] * (num_shards - 1) + [last]


def index_shards_main(argv: list[str] | None = None) -> int:
    """`vitlab index-shards DIR...`: count every shard once and write the index that later starts read."""
    p = argparse.ArgumentParser(
        prog="vitlab index-shards",
        description="Write shardindex.json (per-shard sample counts, held-out split counts) for shard folders, "
        "beside the shards when writable, else in the cache folder; training starts then read it instead of "
        "every shard.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="a shard folder, or one with train/ and val/ shard folders")
    p.add_argument("--val_fraction", type=float, action="append",
                   help="held-out fraction to count (repeatable); default 0.02, the data module's")  # fmt: skip
    p.add_argument("--no_labels", action="store_true", help="shards without .cls labels")
    args = p.parse_args(argv)
    fractions = args.val_fraction or [0.02]
    # each DIR, or its train/ and val/ shard folders where it has them (the layout DATA= accepts)
    subs = [[os.path.join(d, s) for s in ("train", "val") if os.path.isdir(os.path.join(d, s))] for d in args.dirs]
    for folder in [f for d, sub in zip(args.dirs, subs) for f in sub or [d]]:
        urls = expand_shards(folder)
        for vf in fractions:
            counts = index_shards(urls, vf, labels=not args.no_labels)
        written = [q for q in index_locations(Path(folder), SHARD_INDEX) if q.is_file()]
        where = max(written, key=lambda q: q.stat().st_mtime_ns) if written else "none written (no writable folder)"
        print(f"{folder}: {len(urls)} shards, {sum(c.total for c in counts)} samples; index: {where}")
    return 0
