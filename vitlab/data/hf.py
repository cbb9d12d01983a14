"""Any Hugging Face `datasets` dataset with an image column and a label column.

Local (`imagefolder` with data_dir, `parquet` / `arrow` with data_files, a saved dataset's builder)
or from the hub when online. Map-style datasets get Lightning's DistributedSampler under DDP.
Streaming (iterable) ones are split over ranks by `split_dataset_by_node` and cut by
`HFIterableImageDataset` so that every rank yields the same number of samples (and so batches): a
rank whose epoch ran out first would otherwise leave the others waiting forever in their next
all-reduce. The cut needs the rows of each shard, counted once (label column only) into an index in
the user's cache folder (vitlab.data.shard_index) by `prepare_data`.
`datasets` is imported lazily: it is slow to import and only this module needs it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from itertools import islice
from typing import Any

from PIL import Image
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from vitlab.data.base import ImageDataModule
from vitlab.data.decode import BadImageError, load_rgb
from vitlab.data.shard_index import indexed_rows
from vitlab.data.transforms import pil_to_rgb

log = logging.getLogger("vitlab.data")


def to_pil(value: Any, name: str) -> Image.Image:
    """An image cell (decoded PIL, `{"bytes", "path"}` dict, raw bytes or a path) -> RGB PIL image."""
    if isinstance(value, Image.Image):
        return pil_to_rgb(value)
    if isinstance(value, dict):
        if value.get("bytes"):
            return load_rgb(value["bytes"], value.get("path") or name)
        if value.get("path"):
            return load_rgb(value["path"])
    if isinstance(value, (bytes, bytearray)):
        return load_rgb(bytes(value), name)
    if isinstance(value, str):
        return load_rgb(value)
    raise BadImageError(f"{name}: cannot make an image of a {type(value).__name__}")


class HFImageDataset(Dataset):
    """Map-style adapter: row i -> (transformed image, label)."""

    def __init__(self, ds: Any, image_column: str, label_column: str, transform: Any, name: str) -> None:
        self.ds = ds.select_columns([image_column, label_column])
        self.image_column, self.label_column = image_column, label_column
        self.transform, self.name = transform, name

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        where = f"{self.name} row {index}"
        try:
            row = self.ds[int(index)]
        except Exception as exc:  # the Image feature decodes on access
            raise BadImageError(f"cannot read {where}: {type(exc).__name__}: {exc}") from exc
        img = to_pil(row[self.image_column], where)
        return self.transform(img), int(row[self.label_column])


def worker_quota(shard_rows: list[int], world_size: int, worker: int = 0, num_workers: int = 1) -> int:
    """Rows one DataLoader worker of any rank yields per epoch from a stream split by `split_dataset_by_node`.

    HF gives each rank whole shards when their number divides by world_size (else every W-th row of
    the stream), and each worker of a rank whole shards round-robin. Which shards changes each epoch,
    so the quota is what no assignment falls short of: the rows of the k smallest shards, k the number
    of shards the worker gets (a W-th of that for every-W-th rows). It is the same on every rank.
    """
    n = len(shard_rows)
    whole_shards = n % world_size == 0
    k = len(range(worker, n // world_size if whole_shards else n, num_workers))
    rows = sum(sorted(shard_rows)[:k])
    return rows if whole_shards else rows // world_size


class HFIterableImageDataset(IterableDataset):
    """Streaming adapter: this rank's share of the stream (`split_dataset_by_node`), each worker stopping
    at `worker_quota` rows (see the module doc); what a share holds beyond the quota (shards of unequal
    size) is dropped that epoch. One process (world_size 1) reads everything."""

    def __init__(
        self, ds: Any, image_column: str, label_column: str, transform: Any, name: str, rank: int = 0,
        world_size: int = 1, shard_rows: list[int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        ds = ds.select_columns([image_column, label_column])
        if world_size > 1:
            from datasets.distributed import split_dataset_by_node

            ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        self.ds = ds
        self.image_column, self.label_column = image_column, label_column
        self.transform, self.name = transform, name
        self.rank, self.world_size, self.shard_rows = rank, world_size, shard_rows

    def set_epoch(self, epoch: int) -> None:
        self.ds.set_epoch(epoch)  # HF keeps it in shared memory for persistent workers

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        rows: Iterator[dict[str, Any]] = iter(self.ds)
        if self.shard_rows is not None and self.world_size > 1:
            info = get_worker_info()
            worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
            rows = islice(rows, worker_quota(self.shard_rows, self.world_size, worker, num_workers))
        for i, row in enumerate(rows):
            img = to_pil(row[self.image_column], f"{self.name} item {i} of rank {self.rank}")
            yield self.transform(img), int(row[self.label_column])


class HFDataModule(ImageDataModule):
    """Image classification from a Hugging Face dataset.

    `path`/`name`/`data_dir`/`data_files`/`cache_dir` go to `datasets.load_dataset`. Class names come
    from the label column's ClassLabel feature (else `num_classes`, else the largest label + 1).
    When `val_split` is None or absent, `val_fraction` of the train split is held out (stratified by
    label when possible, seeded by `seed`). Streaming needs a real `val_split` (or `val_fraction=0`).
    `test_split`, where the dataset has it, is what `vitlab test` scores (else the validation data).
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        image_column: str = "image",
        label_column: str = "label",
        train_split: str = "train",
        val_split: str | None = "validation",
        test_split: str | None = "test",
        data_dir: str | None = None,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        cache_dir: str | None = None,
        streaming: bool = False,
        val_fraction: float = 0.02,
        shuffle_buffer: int = 1000,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.path, self.name = path, name
        self.image_column, self.label_column = image_column, label_column
        self.train_split, self.val_split, self.test_split = train_split, val_split, test_split
        self.data_dir, self.data_files, self.cache_dir = data_dir, data_files, cache_dir
        self.streaming, self.val_fraction, self.shuffle_buffer = streaming, val_fraction, shuffle_buffer

    def _describe(self) -> str:
        return self.path + (f"/{self.name}" if self.name else "") + (f" ({self.data_dir})" if self.data_dir else "")

    @functools.cached_property
    def _dd(self) -> Any:
        import datasets

        return datasets.load_dataset(self.path, self.name, data_dir=self.data_dir, data_files=self.data_files,
                                     cache_dir=self.cache_dir, streaming=self.streaming)  # fmt: skip

    def prepare_data(self) -> None:
        """Download / build the arrow cache, and for a stream over several ranks count its shards' rows
        into the index; Lightning runs this once per node while the other ranks wait."""
        dd = self._dd
        if self.streaming and self.world_size > 1:
            for split in {self.train_split, self.val_split, self.test_split} & set(dd):
                self._shard_rows(dd[split], split)

    def _shard_rows(self, ds: Any, split: str) -> list[int]:
        """Rows in each shard of a streamed split, counted once (label column only) into the index."""
        files = self.data_files if isinstance(self.data_files, dict) else {"": self.data_files or []}
        local = [self.data_dir or "", *(f for v in files.values() for f in ([v] if isinstance(v, str) else v))]
        mtimes = {p: os.stat(p).st_mtime_ns for p in local if os.path.exists(p)}  # a changed local dataset: new index
        key = {"path": self.path, "name": self.name, "data_dir": self.data_dir, "data_files": self.data_files,
               "split": split, "num_shards": ds.num_shards, "mtimes": mtimes}  # fmt: skip

        def count() -> list[int]:
            labels = ds.select_columns([self.label_column])
            return [sum(1 for _ in labels.shard(num_shards=ds.num_shards, index=i)) for i in range(ds.num_shards)]

        return indexed_rows(key, count)

    @functools.cached_property
    def _splits(self) -> tuple[Any, Any]:
        """(train, val or None) as HF datasets, the held-out split applied."""
        dd = self._dd
        if self.train_split not in dd:
            raise ValueError(f"{self._describe()} has no split {self.train_split!r}; it has {sorted(dd)}")
        train = dd[self.train_split]
        features = train.features or {}
        for col in (self.image_column, self.label_column):
            if features and col not in features:
                raise ValueError(f"{self._describe()} has no column {col!r}; its columns are {sorted(features)}")
        if self.val_split is not None and self.val_split in dd:
            val = dd[self.val_split]
        elif self.val_fraction == 0:
            val = None
        elif self.streaming:
            raise ValueError(
                f"{self._describe()} has no split {self.val_split!r} (has {sorted(dd)}) and a streaming dataset "
                "cannot be held out from; set val_split to an existing split or val_fraction=0"
            )
        else:
            log.info("%s: no %r split, holding out %.1f%% of %r", self._describe(), self.val_split,
                     100 * self.val_fraction, self.train_split)  # fmt: skip
            kw: dict[str, Any] = dict(test_size=self.val_fraction, seed=self.seed)
            stratify = self.label_column if self._label_feature_names() is not None else None
            try:
                parts = train.train_test_split(stratify_by_column=stratify, **kw)
            except ValueError:  # too few samples per class to stratify
                parts = train.train_test_split(**kw)
            train, val = parts["train"], parts["test"]
        return train, val

    def _label_feature_names(self) -> list[str] | None:
        train = self._dd[self.train_split]
        feature = (train.features or {}).get(self.label_column)
        return list(feature.names) if hasattr(feature, "names") else None

    def _discover_class_names(self) -> list[str]:
        self._class_where = self._describe()
        names = self._label_feature_names()
        if names is not None:
            return names
        if self._num_classes_arg is not None:
            return [str(i) for i in range(self._num_classes_arg)]
        if self.streaming:
            raise ValueError(
                f"{self._describe()}: label column {self.label_column!r} is not a ClassLabel; give num_classes"
            )
        labels = self._dd[self.train_split][self.label_column]
        return [str(i) for i in range(int(max(labels)) + 1)]

    def _wrap(self, ds: Any, train: bool, split: str | None = None) -> Any:
        transform = self.train_transform() if train else self.eval_transform()
        split = split or (self.train_split if train else (self.val_split or "held-out"))
        label = f"{self._describe()}[{split}]"
        if not self.streaming:
            return HFImageDataset(ds, self.image_column, self.label_column, transform, label)
        import datasets

        feature = (ds.features or {}).get(self.image_column)
        if isinstance(feature, datasets.Image) and feature.decode:
            # Bytes here, decoded by to_pil: only the rows this rank keeps are decoded.
            ds = ds.cast_column(self.image_column, datasets.Image(decode=False))
        ws = self.world_size
        rows = self._shard_rows(ds, split) if ws > 1 else None
        if train:
            ds = ds.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
        return HFIterableImageDataset(
            ds, self.image_column, self.label_column, transform, label, rank=self.global_rank, world_size=ws,
            shard_rows=rows,
        )  # fmt: skip

    def _setup_datasets(self, stage: str | None) -> None:
        train, val = self._splits
        self.train_dataset = self._wrap(train, train=True)
        self.val_dataset = None if val is None else self._wrap(val, train=False)
        dd = self._dd
        if self.test_split is not None and self.test_split in dd and self.test_split != self.val_split:
            self.test_dataset = self._wrap(dd[self.test_split], train=False, split=self.test_split)
