"""Shared fixtures. Real data lives in ../shared/data (see its README); tests that need it skip
when it is absent, except under CI (CI=true), where a missing data folder is a failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("VITLAB_SHARED_DATA", REPO.parent / "shared" / "data"))

torch.set_num_threads(min(2, os.cpu_count() or 1))


def _need(path: Path) -> Path:
    if path.exists():
        return path
    msg = f"real test data missing: {path} (set VITLAB_SHARED_DATA to the folder holding cifar10-subset/)"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def cifar_subset() -> Path:
    """ImageFolder tree: train/<class>/*.png (500 per class), val/<class>/*.png (100 per class)."""
    return _need(SHARED_DATA / "cifar10-subset")


@pytest.fixture(scope="session")
def cifar_shards() -> Path:
    """The whole CIFAR-10 train split as 10 webdataset shards of 5,000 samples each."""
    return _need(SHARED_DATA / "cifar10-train-shards")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tinyimagenet_shards() -> Path:
    """Tiny-ImageNet-200 as train/ (60,000) and val/ (10,000) webdataset shard folders, classes.txt."""
    return _need(SHARED_DATA / "tinyimagenet-200-shards")


@pytest.fixture(scope="session")
def imagenette_shards() -> Path:
    """Imagenette at 128px: train/ only (9,469 samples in 2 shards), classes.txt."""
    return _need(SHARED_DATA / "imagenette-128-shards")


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated ImageFolder tree, no real data needed: 3 classes, 8 train and 4 val 32x32 PNGs each."""
    from helpers import image_tree

    return image_tree(tmp_path_factory.mktemp("generated") / "images", ["red", "green", "blue"], 8, 4)
