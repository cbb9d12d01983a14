"""Data: LightningDataModules for image folders, webdataset shards, HF datasets and CIFAR, plus transforms."""

from vitlab.data.base import ImageDataModule, per_device_batch
from vitlab.data.cifar import CIFARDataModule
from vitlab.data.decode import BadImageError
from vitlab.data.folder import ImageFolderDataModule
from vitlab.data.hf import HFDataModule
from vitlab.data.shard_stream import ShardStream
from vitlab.data.shards import ShardDataModule
from vitlab.data.transforms import eval_transform, mixup_cutmix_collate, train_transform

__all__ = [
    "BadImageError", "CIFARDataModule", "HFDataModule", "ImageDataModule", "ImageFolderDataModule",
    "ShardDataModule", "ShardStream", "eval_transform", "mixup_cutmix_collate", "per_device_batch",
    "train_transform",
]
