"""ShardDataModule: image classification from webdataset shards (`.tar` / `.tar.gz`).

Its parts: shard file access (vitlab.data.shard_files), per-shard sample counts and `vitlab
index-shards` (vitlab.data.shard_counts), and one rank's stream with its split over ranks and workers
(vitlab.data.shard_stream).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Literal

from torch.utils.data import DataLoader
from torchvision.transforms import v2

from vitlab.data.base import ImageDataModule, per_device_batch
from vitlab.data.memory import BatchAugment, MemoryImages, batch_collate, decode_into_memory, normalise_batch
from vitlab.data.public import ensure_public
from vitlab.data.shard_counts import assumed_counts, index_shards, index_shards_main
from vitlab.data.shard_files import SHARD_SUFFIXES, _is_remote, _raw_samples, expand_shards, read_classes_txt
from vitlab.data.shard_index import ShardCounts
from vitlab.data.shard_stream import Part, ShardDecoder, ShardStream
from vitlab.data.transforms import eval_transform
from vitlab.data.unlabelled import LabelsOption

# Re-exported for importers outside vitlab/data: vitlab/cli.py (index_shards_main), vitlab/recipe.py
# (SHARD_SUFFIXES, read_classes_txt), tests/test_transfer.py (_raw_samples, expand_shards).
__all__ = ["SHARD_SUFFIXES", "ShardDataModule", "_raw_samples", "expand_shards", "index_shards_main",
           "read_classes_txt"]  # fmt: skip

log = logging.getLogger("vitlab.data")

SplitIndex = tuple[list[str], list[int], Part, float]  # urls, per-shard counts, part of each shard, val_fraction


class ShardDataModule(LabelsOption, ImageDataModule):
    """Image classification from webdataset shards: `KEY.jpg|jpeg|png|webp` + `KEY.cls` per sample.

    `train_shards` / `val_shards`: a folder, glob or brace pattern (several joined with '::').
    Class names come from `classes.txt` beside the train shards, else `num_classes` or the labels.
    Without `val_shards`, `val_fraction` of the train samples (by key hash) is held out. Shards are counted
    once into `shardindex.json` (`prepare_data`; `vitlab index-shards` ahead of time), or `num_samples`
    (train samples in all shards) stands for the count; see vitlab.data.shard_stream. `source` names the
    public dataset (vitlab.data.public) to fetch into the parent of `train_shards` when that folder is missing.
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
