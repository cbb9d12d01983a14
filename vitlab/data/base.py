"""The DataModule base every vitlab data source shares: transforms, batch arithmetic, class names, loaders.

Subclasses supply `_discover_class_names()` (cheap: folder names, classes.txt, a ClassLabel) and
`_setup_datasets(stage)`; the base turns them into loaders with the global-batch/per-device split,
MixUp/CutMix on train batches, and the `data_config` a checkpoint stores for inference.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, default_collate

from vitlab.data.device_prep import DeviceBatchPrep, EncodedBatch, KeepEncoded, check_decode, encoded_collate
from vitlab.data.fast_decode import FastEvalDecode, FastTrainDecode
from vitlab.data.loaders import BatchedDataset, EpochLoader, EqualBatchSampler, WorkerInit, available_cpus
from vitlab.data.random_state import WorkerRandomState
from vitlab.data.transforms import (
    DEFAULT_MEAN,
    DEFAULT_STD,
    AutoAugment,
    MixupCutmixCollate,
    SizedTransform,
    TrainCrop,
    eval_transform,
    train_transform,
)


def per_device_batch(batch_size: int, world_size: int) -> int:
    """The global batch split over `world_size` processes; it must divide exactly."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size % world_size:
        lo = max(world_size, batch_size // world_size * world_size)
        raise ValueError(
            f"batch_size={batch_size} is the GLOBAL batch and must divide evenly over world_size={world_size} "
            f"processes (devices x nodes); use a multiple of {world_size}, e.g. {lo} or {lo + world_size}"
        )
    return batch_size // world_size


def check_img_size_schedule(schedule: Sequence[Sequence[int]] | None, img_size: int) -> list[tuple[int, int]] | None:
    """`[[epoch, size], ...]` checked: from epoch 0, epochs increasing, sizes >= 1, ending at img_size
    (the size the model is built, validated and saved at). One ValueError line naming the fix."""
    if schedule is None:
        return None
    example = f"e.g. [[0, 16], [3, 24], [6, {img_size}]]; got {schedule!r}"
    try:
        pairs = [(int(e), int(s)) for e, s in schedule]
    except (TypeError, ValueError):
        raise ValueError(f"img_size_schedule must be a list of [epoch, size] pairs, {example}") from None
    epochs = [e for e, _ in pairs]
    if not pairs or epochs[0] != 0 or any(b <= a for a, b in itertools.pairwise(epochs)):
        raise ValueError(f"img_size_schedule epochs must start at 0 and increase, {example}")
    if any(s < 1 for _, s in pairs):
        raise ValueError(f"img_size_schedule sizes must be >= 1, got {schedule!r}")
    if pairs[-1][1] != img_size:
        raise ValueError(
            f"img_size_schedule must end at img_size={img_size} (the size the model is built, validated and saved "
            f"at), but its last size is {pairs[-1][1]}; set img_size: {pairs[-1][1]} or end the schedule with "
            f"[{pairs[-1][0]}, {img_size}]"
        )
    return pairs


class ImageDataModule(L.LightningDataModule):
    """Base image-classification DataModule; see the module docstring.

    `batch_size` is the global batch: each process loads `batch_size // world_size`. Eval preprocessing
    is Resize(img_size / crop_pct) + CenterCrop(img_size). For 32px sources set crop_pct=1.0 (a plain
    resize; `CIFARDataModule` does so by default): cropping a tiny picture loses a tenth of it.

    `img_size_schedule` (`[[epoch, size], ...]`, ending at img_size) is progressive resizing: from each
    listed epoch on, train images are cropped to that size, set from the trainer's epoch as each epoch's
    loader starts (the `ImgSizeSchedule` callback moves the model along); validation stays at img_size.

    `decode` (image folders and shards): `"pil"` decodes and augments each image in the workers into a
    normalised float tensor; `"cpu"` is the fast path (vitlab.data.fast_decode): the workers decode at a
    reduced JPEG scale where the crop allows, crop before resizing and hand over uint8 crops, and the
    float conversion, normalisation and MixUp/CutMix run batched on the training device; `"device"`
    (vitlab.data.device_prep): the workers hand over the encoded bytes and the training device decodes
    (nvJPEG on a GPU), crops, flips and normalises. Both need train_crop="rrc".
    """

    supports_decode = False  # whether the datasets take `train_decoder()` / `eval_decoder()` (encoded input)

    def __init__(
        self,
        img_size: int = 224,
        batch_size: int = 256,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        train_crop: TrainCrop = "rrc",
        scale_min: float = 0.08,
        hflip: bool = True,
        auto_augment: AutoAugment | None = "randaugment",
        randaugment_magnitude: int = 9,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mean: tuple[float, float, float] = DEFAULT_MEAN,
        std: tuple[float, float, float] = DEFAULT_STD,
        interpolation: str = "bicubic",
        crop_pct: float = 0.9,
        num_classes: int | None = None,
        skip_bad_images: bool = False,
        seed: int = 0,
        eval_equal_batches: bool | None = None,
        img_size_schedule: list[tuple[int, int]] | None = None,
        decode: Literal["pil", "cpu", "device"] = "pil",
    ) -> None:
        super().__init__()
        check_decode(decode, train_crop)
        if decode != "pil" and not self.supports_decode:
            raise ValueError(f"decode={decode!r} is for image folders and shards; {type(self).__name__} takes decode: pil")
        if decode == "device" and skip_bad_images:
            raise ValueError("skip_bad_images needs the workers to decode; set decode: cpu, or skip_bad_images: false")
        if img_size < 1:
            raise ValueError(f"img_size must be >= 1, got {img_size}")
        self.img_size_schedule = check_img_size_schedule(img_size_schedule, img_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 or None (auto), got {num_workers}")
        if mixup_alpha < 0 or cutmix_alpha < 0:
            raise ValueError(f"mixup_alpha/cutmix_alpha must be >= 0, got {mixup_alpha}/{cutmix_alpha}")
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"num_classes must be >= 1 or None (from the data), got {num_classes}")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std need 3 values (RGB), got {mean} and {std}")
        self.img_size, self.batch_size, self.num_workers = img_size, batch_size, num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.train_crop, self.scale_min, self.hflip = train_crop, scale_min, hflip
        self.auto_augment, self.randaugment_magnitude = auto_augment, randaugment_magnitude
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.interpolation, self.crop_pct = interpolation, crop_pct
        self.skip_bad_images, self.seed, self.eval_equal_batches = skip_bad_images, seed, eval_equal_batches
        self.decode = decode
        self._prep: DeviceBatchPrep | None = None
        self._num_classes_arg = num_classes
        # The size train images are cropped to now: shared memory, so DataLoader workers (persistent
        # ones too) see what `set_train_size` wrote for the epoch (vitlab.train.run.img_size_schedule).
        self._train_size = torch.tensor(img_size, dtype=torch.int64).share_memory_()
        self.train_transform(), self.eval_transform()  # bad crop/augment/interpolation fail here, not in a worker
        self._class_names: list[str] | None = None
        self._class_where = ""  # where the names came from, for error messages
        self.train_dataset: Any = None
        self.val_dataset: Any = None
        self.test_dataset: Any = None  # a separate test split, where the source has one
        # num_classes is logged by the model (linked from here), where it is always resolved.
        self.save_hyperparameters(ignore=["num_classes"])

    # ---- what subclasses provide ------------------------------------------------------------------

    def _discover_class_names(self) -> list[str]:
        """Class names in label order, found cheaply (no full scan where avoidable)."""
        raise NotImplementedError

    def _setup_datasets(self, stage: str | None) -> None:
        """Build `self.train_dataset` / `self.val_dataset` (None when there is no validation data), and
        `self.test_dataset` where the source has a test split kept apart from model selection; `setup`
        calls it once (fit, validate and test share the datasets)."""
        raise NotImplementedError

    # ---- classes and configuration ----------------------------------------------------------------

    @property
    def class_names(self) -> list[str]:
        if self._class_names is None:
            names, where = [str(n) for n in self._discover_class_names()], self._class_where
            if not names:
                raise ValueError(f"no classes found{' in ' + where if where else ''}")
            n = self._num_classes_arg
            if n is not None and n != len(names):
                raise ValueError(
                    f"num_classes={n} was given but the data has {len(names)} classes{' in ' + where if where else ''} "
                    f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}); drop num_classes or fix the data"
                )
            self._class_names = names
        return list(self._class_names)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def _preprocessing(self) -> dict[str, Any]:
        return {"img_size": [self.img_size, self.img_size], "mean": list(self.mean), "std": list(self.std),
                "interpolation": self.interpolation, "crop_pct": self.crop_pct}  # fmt: skip

    @property
    def data_config(self) -> dict[str, Any]:
        """Preprocessing the trained model expects (same keys and format as VisionTransformer.data_config):
        img_size [h, w], mean, std, interpolation, crop_pct, class_names."""
        return {**self._preprocessing(), "class_names": self.class_names}

    @property
    def bad_image_count(self) -> int:
        """Bad images skipped so far (train + val) by this rank's loaders; see `skip_bad_images`."""
        return sum(getattr(ds, "bad_image_count", 0) for ds in (self.train_dataset, self.val_dataset) if ds is not None)

    # ---- distribution -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        if self.trainer is not None:
            return int(self.trainer.world_size)
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def global_rank(self) -> int:
        if self.trainer is not None:
            return int(self.trainer.global_rank)
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def per_device_batch_size(self) -> int:
        return per_device_batch(self.batch_size, self.world_size)

    @property
    def resolved_num_workers(self) -> int:
        """`num_workers`, or when None: the CPUs per local device less one for the main process, at most 8."""
        if self.num_workers is not None:
            return self.num_workers
        local = max(1, int(getattr(self.trainer, "num_devices", 1) or 1))
        return max(0, min(8, available_cpus() // local - 1))

    # ---- transforms -------------------------------------------------------------------------------

    def set_train_size(self, size: int) -> None:
        """Crop train images to `size` from now on (progressive resizing), in DataLoader workers too."""
        self._train_size.fill_(int(size))

    def img_size_at(self, epoch: int) -> int:
        """The train size `img_size_schedule` gives `epoch` (img_size without a schedule)."""
        sizes = [size for start, size in self.img_size_schedule or [] if start <= epoch]
        return sizes[-1] if sizes else self.img_size

    def train_transform(self) -> Any:
        build = functools.partial(
            train_transform, train_crop=self.train_crop, scale_min=self.scale_min, hflip=self.hflip,
            auto_augment=self.auto_augment, randaugment_magnitude=self.randaugment_magnitude,
            mean=self.mean, std=self.std, interpolation=self.interpolation,
        )  # fmt: skip
        full = build(self.img_size)  # built even under a schedule: checks the settings
        return SizedTransform(self._train_size, build) if self.img_size_schedule else full

    def eval_transform(self) -> Any:
        return eval_transform(self._preprocessing())

    def train_decoder(self) -> Any:
        """What the datasets apply to each train image: `train_transform()` on a decoded image for
        decode="pil"; for "cpu" and "device" a transform of the encoded image (bytes or path)."""
        if self.decode == "pil":
            return self.train_transform()
        if self.decode == "device":
            return KeepEncoded()
        build = functools.partial(
            FastTrainDecode, scale_min=self.scale_min, hflip=self.hflip, auto_augment=self.auto_augment,
            randaugment_magnitude=self.randaugment_magnitude, interpolation=self.interpolation,
        )  # fmt: skip
        full = build(self.img_size)
        return SizedTransform(self._train_size, build) if self.img_size_schedule else full

    def eval_decoder(self) -> Any:
        """The evaluation counterpart of `train_decoder`: the same pixels as `eval_transform()`, as uint8
        for decode="cpu" (normalised on the device), encoded for "device"."""
        if self.decode == "pil":
            return self.eval_transform()
        if self.decode == "device":
            return KeepEncoded()
        return FastEvalDecode(self.img_size, self.crop_pct, self.interpolation)

    def train_collate(self) -> Callable:
        if self.decode == "device":
            return encoded_collate
        if self.decode == "cpu":
            return default_collate  # uint8 crops: mixed on the device (on_after_batch_transfer)
        return MixupCutmixCollate(self.num_classes, self.mixup_alpha, self.cutmix_alpha)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """decode="cpu"/"device": the batch, on the device, made float, normalised (and mixed) here."""
        if self.decode == "pil":
            return batch
        images, labels = batch
        if not isinstance(images, EncodedBatch) and images.dtype != torch.uint8:
            return batch
        if self._prep is None:
            self._prep = DeviceBatchPrep(
                self.img_size, self.scale_min, self.hflip, self.mean, self.std, self.crop_pct, self.interpolation,
                MixupCutmixCollate(self.num_classes, self.mixup_alpha, self.cutmix_alpha).mix,
                FastTrainDecode(self.img_size, self.scale_min, False, self.auto_augment, self.randaugment_magnitude,
                                self.interpolation).augment,
            )  # fmt: skip
        trainer = self.trainer
        train = trainer is not None and bool(trainer.training)
        return self._prep(images, labels, train, self.img_size_at(trainer.current_epoch) if train else None)

    # ---- Lightning hooks --------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        self.batch_size_per_device = self.per_device_batch_size  # fail fast on an indivisible batch
        if self.train_dataset is None:
            self._setup_datasets(stage)
        _ = self.class_names  # resolves and checks num_classes

    def eval_sampler(self, dataset: Dataset) -> Sampler | None:
        """Validation/test sampler under DDP: rank r reads images r, r+W, r+2W, ... and none is repeated.

        Lightning's default DistributedSampler pads with repeated images so every rank gets the same
        count, which biases validation metrics. Unequal counts are safe for evaluation under DDP: no
        gradients are synced, torchmetrics sums the per-rank states, and Lightning keeps a distributed
        sampler. Strategies whose forward is itself collective need `equal_eval_batches` instead.
        """
        if self.world_size < 2:
            return None
        return UnrepeatedDistributedSampler(dataset, num_replicas=self.world_size, rank=self.global_rank, shuffle=False)

    def train_sampler(self, dataset: Dataset) -> Sampler | None:
        """Under DDP, a DistributedSampler of our own, which Lightning keeps: its order depends on
        (seed, epoch) alone, so a resumed rank fast-forwards to exactly where it was. (Lightning's
        wrapper around a RandomSampler draws each epoch's order from a generator whose state a resume
        does not reproduce at that moment.) None for one process: the loader shuffles itself."""
        if self.world_size < 2:
            return None
        return DistributedSampler(dataset, num_replicas=self.world_size, rank=self.global_rank, shuffle=True,
                                  seed=self.seed)  # fmt: skip

    @property
    def equal_eval_batches(self) -> bool:
        """Whether every rank must run the same number of evaluation batches: `eval_equal_batches`, or
        when None, whether the strategy's forward is collective (FSDP, DeepSpeed, model parallel: each
        forward all-gathers weights, so a rank with an extra batch would wait forever)."""
        if self.world_size < 2:
            return False
        if self.eval_equal_batches is not None:
            return self.eval_equal_batches
        strategy = getattr(self.trainer, "strategy", None)
        return strategy is not None and not (
            isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy)
        )

    def _loader(
        self, dataset: Dataset, train: bool, collate_fn: Callable | None = None, num_workers: int | None = None,
        pin_memory: bool = True,
    ) -> DataLoader:
        """Training or streamed data: a StatefulDataLoader, whose position Lightning checkpoints (and
        WorkerRandomState its workers' random streams) so that a mid-epoch resume continues exactly; a
        streamed dataset learns each epoch from it (`EpochLoader`). Map-style evaluation data: every image
        once over all ranks, by `EqualBatchSampler` when `equal_eval_batches`, else by `eval_sampler`.
        `pin_memory=False` turns pinning off for data already on the device."""
        workers = self.resolved_num_workers if num_workers is None else num_workers
        collate_fn = collate_fn or (None if train else self._eval_collate())
        common: dict[str, Any] = {
            "num_workers": workers, "pin_memory": self.pin_memory and pin_memory, "persistent_workers": workers > 0,
            "worker_init_fn": WorkerInit(self.global_rank) if workers > 0 else None,
        }  # fmt: skip
        stream = isinstance(dataset, torch.utils.data.IterableDataset)
        if train or stream:
            sampler = None if stream else self.train_sampler(dataset)
            return EpochLoader(
                dataset if stream else WorkerRandomState(dataset), batch_size=self.per_device_batch_size,
                shuffle=not stream and sampler is None, sampler=sampler,
                collate_fn=collate_fn or (self.train_collate() if train else None),
                generator=None if stream else torch.Generator().manual_seed(self.seed), epoch_fn=self._epoch_fn(),
                **common,
            )  # fmt: skip
        if not self.equal_eval_batches:
            sampler = self.eval_sampler(dataset)
            return DataLoader(dataset, self.per_device_batch_size, sampler=sampler, collate_fn=collate_fn, **common)
        sampler = EqualBatchSampler(len(dataset), self.world_size, self.global_rank, self.per_device_batch_size)
        # The sampler yields whole batches (index lists): no automatic batching, the dataset collates.
        return DataLoader(BatchedDataset(dataset, collate_fn), batch_size=None, sampler=sampler, **common)

    def _eval_collate(self) -> Callable | None:
        return encoded_collate if self.decode == "device" else None

    def _epoch_fn(self) -> Callable[[], int] | None:
        """What a loader calls as it starts an epoch: the trainer's epoch, after setting the schedule's
        train size for it. Then, before any worker crops an image of the epoch, and also when a resumed
        run restarts its loader, the size follows the epoch alone: the same on every rank."""
        trainer = self.trainer
        if trainer is None:
            return None

        def epoch() -> int:
            e = int(getattr(trainer, "current_epoch", 0))  # 0 for a stand-in trainer without epochs
            self.set_train_size(self.img_size_at(e))
            return e

        return epoch

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> DataLoader | list:
        """An empty list when there is no validation data (Lightning then skips validation)."""
        if self.train_dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        return [] if self.val_dataset is None else self._loader(self.val_dataset, train=False)

    def test_dataloader(self) -> DataLoader | list:
        """The test split where the source has one (`test_dataset`), else the validation data."""
        if self.test_dataset is None:
            return self.val_dataloader()
        return self._loader(self.test_dataset, train=False)
