"""One rank's stream of webdataset shards (`.tar` / `.tar.gz`), from CIFAR-sized to ImageNet-21k-sized.

Splitting (ShardStream): each epoch the shards are put in an order seeded by (seed, epoch), the same
on every process, and their samples are seen as one concatenated sequence of N. Rank r reads the
contiguous range [r*L, (r+1)*L) with L = N // world_size, and its DataLoader workers cut that range
into contiguous pieces of whole batches (one worker also takes the final partial batch). So:

- every sample is read by exactly one rank x worker; a piece is mostly whole shards, and a shard
  that straddles two pieces is read by both, each skipping (without decoding) the other's samples;
- every rank yields exactly L samples, so ceil(L / per-device batch) batches: `len(dataloader)` is
  right and DDP ranks never wait on one another at an epoch's end;
- the N % world_size samples at the end of the epoch's order (at most world_size - 1) are DROPPED,
  a different few each epoch since the order changes. Nothing is padded or repeated.

Why not whole shards per rank x worker: unless all shards hold the same count and their number
divides by ranks x workers, ranks would get different sample counts (a DDP hang at the epoch's end,
or whole shards dropped or repeated). The range split serves any shard count, more or fewer than
ranks x workers, at the cost of at most one partly skipped shard per piece.

This needs the per-shard sample counts up front: counted once into `shardindex.json` (wids' format;
vitlab.data.shard_index), or, for huge collections, `num_samples` (all shards full but the last, as
webdataset's ShardWriter writes them, checked while reading). A held-out validation split (no
`val_shards`) is chosen by hashing each sample's key.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from vitlab.data.decode import BadImageError, load_rgb
from vitlab.data.shard_files import _raw_samples, _where, sample_image, sample_label
from vitlab.data.split import key_in_val

log = logging.getLogger("vitlab.data")

Part = Literal["all", "train", "val"]
RECOUNT = "(num_samples wrong, or the file changed); leave num_samples unset to recount"


def split_range(
    total: int, rank: int, world_size: int, worker: int, num_workers: int, batch_size: int | None
) -> tuple[int, int]:
    """[start, stop) of the epoch's concatenated sample sequence that (rank, worker) reads.

    Each rank gets total // world_size samples; inside a rank, workers get contiguous pieces of
    whole batches (round-robin counts, as the DataLoader fetches), the partial batch going to the
    worker whose turn is next, so the rank yields ceil(per_rank / batch_size) batches.
    """
    per_rank = total // world_size
    if batch_size:
        full, rem = divmod(per_rank, batch_size)
        sizes = [(full // num_workers + (w < full % num_workers)) * batch_size for w in range(num_workers)]
        sizes[full % num_workers] += rem
    else:
        sizes = [per_rank // num_workers + (w < per_rank % num_workers) for w in range(num_workers)]
    start = rank * per_rank + sum(sizes[:worker])
    return start, start + sizes[worker]


class ShardDecoder:
    """Raw sample -> (transformed image, label), or (key, RGB image, label) when `keyed` (decoding into
    memory); picklable for DataLoader workers."""

    def __init__(self, transform: Any, labels: bool = True, keyed: bool = False) -> None:
        self.transform, self.labels, self.keyed = transform, labels, keyed

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, ...]:
        name = f"{sample.get('__url__')}:{sample.get('__key__')}"
        if getattr(self.transform, "decodes", False):  # decode="cpu"/"device": the transform takes the bytes
            return self.transform(sample_image(sample), name), sample_label(sample, self.labels)
        img = load_rgb(sample_image(sample), name)
        out = (self.transform(img) if self.transform is not None else img), sample_label(sample, self.labels)
        return (sample["__key__"], *out) if self.keyed else out


class ShardStream(IterableDataset):
    """One rank's view of a set of shards for one split; see the module docstring for the split.

    `decoder=None` yields `(key, label)` without decoding any image (indexing, tests, statistics).
    `set_epoch` writes to shared memory, so persistent DataLoader workers see the new epoch.
    """

    def __init__(
        self,
        urls: list[str],
        counts: list[int],
        *,
        part: Part = "all",
        val_fraction: float = 0.0,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int | None = None,
        shuffle: bool = False,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        decoder: Callable[[dict[str, Any]], Any] | None = None,
        num_classes: int | None = None,
        skip_bad_images: bool = False,
        labels: bool = True,
    ) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.urls, self.counts = list(urls), list(counts)
        self.total = sum(self.counts)
        if self.total < world_size:
            raise ValueError(f"{self.total} samples cannot be split over {world_size} ranks")
        self.part, self.val_fraction = part, val_fraction
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.shuffle, self.shuffle_buffer, self.seed = shuffle, shuffle_buffer, seed
        self.decoder, self.num_classes = decoder, num_classes
        self.skip_bad_images, self.labels = skip_bad_images, labels
        # Bad images skipped: one shared-memory slot per DataLoader worker (0: the main process), so no
        # two processes write the same slot; their sum is this rank's count.
        self._skips = torch.zeros(257, dtype=torch.int64).share_memory_()
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def bad_image_count(self) -> int:
        """Bad samples skipped so far; each is met once per epoch, so this grows with epochs."""
        return int(self._skips.sum())

    def __len__(self) -> int:
        """Samples this rank yields per epoch (the same on every rank)."""
        return self.total // self.world_size

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(int(epoch))

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.urls)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)  # same on every rank and worker
        return order

    def pieces(self, epoch: int, worker: int = 0, num_workers: int = 1) -> list[tuple[int, int, int]]:
        """(shard index, first, stop) in-part sample positions this rank x worker reads, in order."""
        a, b = split_range(self.total, self.rank, self.world_size, worker, num_workers, self.batch_size)
        out, pos = [], 0
        for s in self.shard_order(epoch):
            n = self.counts[s]
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                out.append((s, lo - pos, hi - pos))
            pos += n
        return out

    def _read_piece(self, s: int, first: int, stop: int) -> Iterator[dict[str, Any]]:
        url, i = self.urls[s], 0
        with contextlib.closing(_raw_samples(url)) as samples:
            for sample in samples:
                if self.part != "all" and key_in_val(sample["__key__"], self.val_fraction) != (self.part == "val"):
                    continue
                if i >= stop:  # a sample past the indexed count: the shard changed since it was counted
                    raise RuntimeError(f"shard {url} holds more than the {self.counts[s]} samples indexed {RECOUNT}")
                if i >= first:
                    yield sample
                i += 1
                if i == stop and stop < self.counts[s]:
                    return  # the rest of the shard belongs to another rank/worker
        if i < stop:
            raise RuntimeError(f"shard {url} ended after {i} samples but was indexed with {self.counts[s]} {RECOUNT}")

    def _label_checked(self, sample: dict[str, Any]) -> int:
        label = sample_label(sample, self.labels)
        if self.labels and self.num_classes is not None and not 0 <= label < self.num_classes:
            raise ValueError(f"{_where(sample)}: label {label} outside [0, {self.num_classes})")
        return label

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        epoch = self.epoch
        pieces = self.pieces(epoch, worker, num_workers)
        raw: Iterator[dict[str, Any]] = (sample for piece in pieces for sample in self._read_piece(*piece))
        if self.shuffle and self.shuffle_buffer > 1:
            rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}")
            raw = wds.filters.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(raw)
        if self.decoder is None:
            yield from ((sample["__key__"], self._label_checked(sample)) for sample in raw)
        else:
            yield from self._decoded(raw)

    def _decoded(self, raw: Iterator[dict[str, Any]]) -> Iterator[Any]:
        # A skipped image's slot is refilled by re-augmenting the last good sample: the per-rank
        # sample count must not change, or DDP ranks would disagree on the number of batches.
        last_good, owed = None, 0
        for sample in raw:
            self._label_checked(sample)
            try:
                out = self.decoder(sample)
            except BadImageError as exc:
                if not self.skip_bad_images:
                    raise
                info = get_worker_info()
                self._skips[0 if info is None else 1 + info.id % 256] += 1
                log.warning("skipping bad image %s:%s (%s)", sample["__url__"], sample["__key__"], exc.__cause__ or exc)
                if last_good is None:
                    owed += 1
                else:
                    yield self.decoder(last_good)
                continue
            last_good = sample
            yield out
            for _ in range(owed):
                yield self.decoder(last_good)
            owed = 0
        if owed:
            raise BadImageError(f"no decodable image in this worker's {owed} samples of {self.urls}")
