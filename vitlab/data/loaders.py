"""DataLoader machinery the DataModules share: the epoch hand-off for streamed data, worker set-up,
equal evaluation batch counts over ranks, and the CPU count that sizes the worker pool."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import Dataset, DistributedSampler, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader


class EpochLoader(StatefulDataLoader):
    """DataLoader that hands an iterable dataset its epoch (`dataset.set_epoch`) before each pass.

    Lightning sets epochs only on samplers, which an IterableDataset has none of; `epoch_fn` (the
    trainer's current epoch) or else a count of passes provides it. The dataset must keep the epoch
    in shared memory so persistent workers see it.
    """

    def __init__(self, dataset: Any, *args: Any, epoch_fn: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.epoch_fn, self.passes = epoch_fn, 0

    def __iter__(self) -> Any:
        epoch = self.epoch_fn() if self.epoch_fn is not None else self.passes
        self.passes += 1
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return super().__iter__()


class WorkerInit:
    """DataLoader `worker_init_fn`: workers ignore SIGTERM and SIGUSR1, then seed themselves as
    Lightning would under `seed_everything(workers=True)` (which it skips when a loader has its own).

    `timeout`, SLURM and `kill -- -PGID` signal the whole process group, workers included; a worker
    killed by the signal would crash its rank ("DataLoader worker is killed by signal") before the
    rank stops cleanly and saves. The main process decides when to stop, and ends its workers.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        for name in ("SIGTERM", "SIGUSR1"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
        if int(os.environ.get("PL_SEED_WORKERS", "0")):
            pl_worker_init_function(worker_id, rank=self.rank)


class EqualBatchSampler(DistributedSampler):
    """Evaluation sampler that gives every rank the same number of batches without repeating an image.

    Rank r takes images r, r+W, r+2W, ... (as `UnrepeatedDistributedSampler`), so counts differ by at
    most one, and yields them as index lists: whole batches of `batch_size`, then the rest spread so
    that every rank yields ceil(ceil(N / W) / batch_size) batches (a rank short of images makes its last
    batch smaller, or splits it in two). Nothing is padded, so no metric needs masking. It is a
    DistributedSampler so that Lightning keeps it instead of injecting its own.
    """

    def __init__(self, num_items: int, num_replicas: int, rank: int, batch_size: int) -> None:
        super().__init__(range(num_items), num_replicas=num_replicas, rank=rank, shuffle=False)
        self.indices = list(range(rank, num_items, num_replicas))
        self.batch_size = batch_size
        self.num_batches = math.ceil(math.ceil(num_items / num_replicas) / batch_size)
        if len(self.indices) < self.num_batches:
            raise ValueError(
                f"{num_items} evaluation images cannot give each of {num_replicas} processes the same number of "
                f"batches ({self.num_batches}, per-device batch {batch_size}) without repeating images: rank {rank} "
                f"has only {len(self.indices)}. Use a per-device batch of at least 2 and at least {num_replicas} images"
            )

    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]
        start = 0
        for b in range(self.num_batches):
            take = min(self.batch_size, len(self.indices) - start - (self.num_batches - b - 1))
            yield self.indices[start : start + take]
            start += take

    def __len__(self) -> int:
        return self.num_batches


class BatchedDataset(Dataset):
    """`dataset` read a batch at a time: an index list gives the collated batch."""

    def __init__(self, dataset: Dataset, collate_fn: Callable | None = None) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: list[int]) -> Any:  # type: ignore[override]
        getitems = getattr(self.dataset, "__getitems__", None)  # a batch in one read, as DataLoader does
        return self.collate_fn(getitems(index) if getitems else [self.dataset[i] for i in index])


def available_cpus() -> int:
    """The CPUs this process may run on (taskset/cgroup pinning respected, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
