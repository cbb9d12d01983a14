"""webdataset shards (`.tar` / `.tar.gz`): the streaming path, from CIFAR-sized to ImageNet-21k-sized.

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

import argparse
import contextlib
import functools
import glob
import logging
import os
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchvision.transforms import v2

from vitlab.data.base import ImageDataModule, per_device_batch
from vitlab.data.decode import BadImageError, load_rgb
from vitlab.data.loaders import available_cpus
from vitlab.data.memory import BatchAugment, MemoryImages, batch_collate, decode_into_memory, normalise_batch
from vitlab.data.public import ensure_public
from vitlab.data.shard_index import SHARD_INDEX, ShardCounts, index_locations, indexed_counts
from vitlab.data.split import key_in_val
from vitlab.data.transforms import eval_transform
from vitlab.data.unlabelled import NO_LABELS_FIX, UNLABELLED, LabelsOption

log = logging.getLogger("vitlab.data")

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
Part = Literal["all", "train", "val"]
SplitIndex = tuple[list[str], list[int], Part, float]  # urls, per-shard counts, part of each shard, val_fraction
RECOUNT = "(num_samples wrong, or the file changed); leave num_samples unset to recount"


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


def read_classes_txt(path: Path) -> list[str] | None:
    if not path.is_file():
        return None
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


class ShardDataModule(LabelsOption, ImageDataModule):
    """Image classification from webdataset shards: `KEY.jpg|jpeg|png|webp` + `KEY.cls` per sample.

    `train_shards` / `val_shards`: a folder, glob or brace pattern (several joined with '::').
    Class names come from `classes.txt` beside the train shards, else `num_classes` or the labels.
    Without `val_shards`, `val_fraction` of the train samples (by key hash) is held out. Shards are counted
    once into `shardindex.json` (`prepare_data`; `vitlab index-shards` ahead of time), or `num_samples`
    (train samples in all shards) stands for the count; see the module doc. `source` names the public
    dataset (vitlab.data.public) to fetch into the parent of `train_shards` when that folder is missing.
    `in_memory=True` decodes both splits once into uint8 tensors and augments batches on the device
    (vitlab.data.memory): the fast path for datasets that fit in RAM. `labels=False` reads images only
    (shards without `.cls` work), every label -1.
    """

    supports_decode = True

    def __init__(
        self,
        train_shards: str,
        val_shards: str | None = None,
        val_fraction: float = 0.02,
        shuffle_buffer: int = 1000,
        num_samples: int | None = None,
        in_memory: bool = False,
        source: Literal["tinyimagenet", "imagenette"] | None = None,
        labels: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.labels = labels  # False: `.cls` not read (nor needed), every label -1 (vitlab.data.unlabelled)
        self._check_labels_option()
        if in_memory and self.auto_augment is not None:
            raise ValueError(
                f"auto_augment={self.auto_augment!r} runs per image on PIL images, which the in-memory path skips; "
                "set auto_augment: null (crops, flips and MixUp/CutMix still apply) or in_memory: false"
            )
        if in_memory and self.decode != "pil":
            raise ValueError(f"in_memory decodes once at setup and ignores decode={self.decode!r}; drop one of them")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be >= 1 or None, got {num_samples}")
        self.train_shards, self.val_shards = train_shards, val_shards
        self.val_fraction, self.shuffle_buffer, self.num_samples = val_fraction, shuffle_buffer, num_samples
        self.in_memory, self.source = in_memory, source
        self._augment: BatchAugment | None = None

    @property
    def held_out(self) -> bool:
        return self.val_shards is None and self.val_fraction > 0

    @functools.cached_property
    def _urls(self) -> list[str]:
        if self.source is not None and not _is_remote(self.train_shards) and not Path(self.train_shards).exists():
            ensure_public(self.source, Path(self.train_shards).parent)
        return expand_shards(self.train_shards)

    def _discover_class_names(self) -> list[str]:
        urls = self._urls
        txt = Path(urls[0]).parent / "classes.txt"
        if not _is_remote(urls[0]) and (names := read_classes_txt(txt)) is not None:
            self._class_where = str(txt)
            return names
        if self._num_classes_arg is not None:
            return [str(i) for i in range(self._num_classes_arg)]
        if self.num_samples is not None and not self.held_out:
            raise ValueError(
                f"no classes.txt beside {urls[0]} and num_classes not given; with num_samples set the shards "
                "are not read ahead, so give num_classes (or a classes.txt, one name per line)"
            )
        counts = index_shards(urls, self.val_fraction if self.held_out else 0.0)
        return [str(i) for i in range(max(c.max_label for c in counts) + 1)]

    @functools.cached_property
    def _index(self) -> dict[str, SplitIndex]:
        urls, names, vf = self._urls, self.class_names, self.val_fraction
        counts: list[ShardCounts] = []  # with num_samples, labels are checked per sample while reading
        index: dict[str, SplitIndex]
        if self.held_out:
            counts = index_shards(urls, vf, self.labels)
            index = {"train": (urls, [c.train for c in counts], "train", vf),
                     "val": (urls, [c.val for c in counts], "val", vf)}  # fmt: skip
        elif self.num_samples is not None:
            index = {"train": (urls, assumed_counts(self.num_samples, len(urls)), "all", 0.0)}
        else:
            counts = index_shards(urls, labels=self.labels)
            index = {"train": (urls, [c.total for c in counts], "all", 0.0)}
        if self.val_shards is not None:
            vurls = expand_shards(self.val_shards)
            vcounts = index_shards(vurls, labels=self.labels)
            index["val"] = (vurls, [c.total for c in vcounts], "all", 0.0)
            counts = counts + vcounts
        max_label = max((c.max_label for c in counts), default=-1)
        if max_label >= len(names):
            raise ValueError(f"shard labels go up to {max_label} but there are {len(names)} classes ({names[:5]}...)")
        for split, (_, counts_, _, _) in index.items():
            log.info("%s: %s split has %d samples in %d shards", type(self).__name__, split, sum(counts_), len(counts_))
        return index

    def dataset(
        self,
        split: Literal["train", "val"] = "train",
        rank: int | None = None,
        world_size: int | None = None,
        decode: bool = True,
    ) -> ShardStream | None:
        """One rank's stream of `split` (None for val when there is no validation data), in whole-batch
        worker pieces of the per-device batch. rank/world_size default to the trainer's or
        torch.distributed's. `decode=False` yields (key, label) only."""
        index = self._index
        if split not in index:
            return None
        urls, counts, part, vf = index[split]
        ws = self.world_size if world_size is None else world_size
        train = split == "train"
        return ShardStream(
            urls, counts, part=part, val_fraction=vf,
            rank=self.global_rank if rank is None else rank, world_size=ws,
            batch_size=per_device_batch(self.batch_size, ws),
            shuffle=train, shuffle_buffer=self.shuffle_buffer, seed=self.seed,
            decoder=ShardDecoder(self.train_decoder() if train else self.eval_decoder(), self.labels)
            if decode else None,
            num_classes=self.num_classes, skip_bad_images=self.skip_bad_images, labels=self.labels,
        )  # fmt: skip

    def prepare_data(self) -> None:
        """Count the shards into their index where it is missing or out of date: Lightning runs this on
        local rank 0 while the other ranks wait, so their `setup` reads the index, not the shards."""
        _ = self._index

    def _setup_datasets(self, stage: str | None) -> None:
        make = self.memory_dataset if self.in_memory else self.dataset
        self.train_dataset, self.val_dataset = make("train"), make("val")

    def memory_dataset(self, split: Literal["train", "val"]) -> MemoryImages | None:
        """All of `split` decoded into a MemoryImages (every rank holds all of it; the sampler splits).

        Train images are stored as they are (augmented per batch later); val images go through the
        evaluation resize and crop now. On a CUDA trainer the tensors move to the device.
        """
        stream = self.dataset(split, rank=0, world_size=1, decode=False)
        if stream is None:
            return None
        stream.shuffle, stream.decoder = False, ShardDecoder(None, self.labels, keyed=True)  # file order, keys kept
        # eval_transform's ToRGB, Resize, CenterCrop: the streaming path's preprocessing up to the float conversion
        preprocess = None if split == "train" else v2.Compose(eval_transform(self._preprocessing()).transforms[:3])
        data = decode_into_memory(stream, stream.total, transform=preprocess)
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return data.to(device) if device is not None and device.type == "cuda" else data

    def _loader(self, dataset: Any, train: bool) -> DataLoader:
        if isinstance(dataset, MemoryImages):  # whole batches indexed in place; pinned only while on the host
            return super()._loader(dataset, train, batch_collate, 0, pin_memory=dataset.images.device.type == "cpu")
        return super()._loader(dataset, train)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """In-memory batches arrive as uint8: augment (training) or normalise them here, on the device."""
        if not self.in_memory:
            return super().on_after_batch_transfer(batch, dataloader_idx)
        images, labels = batch
        trainer = self.trainer
        if trainer is not None and trainer.training:
            if self._augment is None:
                self._augment = BatchAugment(self.img_size, self.train_crop, self.scale_min, self.hflip, self.mean,
                                             self.std, self.train_collate().mix)  # fmt: skip
            return self._augment(images, labels, size=self.img_size_at(trainer.current_epoch))
        return normalise_batch(images, self.mean, self.std), labels


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
