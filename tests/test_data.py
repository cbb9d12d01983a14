"""vitlab.data on files: folder layouts, bad images, shard splitting over ranks x workers, HF, transforms.

Generated images (helpers.image_tree, helpers.shard_tree) in the shared data's layouts: the checks here
hold for any pixels, so they run without ../shared."""

from __future__ import annotations

import collections
import io
import math
import pickle
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vitlab.data import (
    BadImageError,
    CIFARDataModule,
    HFDataModule,
    ImageFolderDataModule,
    ShardDataModule,
    eval_transform,
    mixup_cutmix_collate,
    per_device_batch,
    train_transform,
)
from vitlab.data.loaders import EpochLoader, EqualBatchSampler
from vitlab.data.shard_stream import ShardStream, split_range
from vitlab.data.split import key_in_val

from helpers import image_tree, shard_tree

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
SMALL = dict(img_size=32, batch_size=4, num_workers=0, train_crop="pad", crop_pct=1.0)


def link_files(src: Path, dst: Path, n: int, offset: int = 0) -> list[Path]:
    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for f in sorted(src.iterdir())[offset : offset + n]:
        (dst / f.name).symlink_to(f)
        out.append(dst / f.name)
    return out


def make_tree(
    subset: Path, root: Path, classes: list[str], n_train: int, n_val: int | None, train: str = "train",
    val: str = "val",
) -> Path:  # fmt: skip
    """A small class-per-folder tree of symlinks into `subset` (val=None: flat 21k layout)."""
    for c in classes:
        link_files(subset / "train" / c, root / train / c if train else root / c, n_train)
        if n_val:
            link_files(subset / "val" / c, root / val / c, n_val)
    return root


@pytest.fixture(scope="module")
def subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CIFAR subset's layout, generated: train/<class> 20 and val/<class> 5 32x32 PNGs per class."""
    return image_tree(tmp_path_factory.mktemp("subset"), CLASSES, 20, 5)


SHARDS, PER_SHARD = 10, 100  # the CIFAR shards' layout (10 equal shards, classes mixed), 1,000 samples
N = SHARDS * PER_SHARD


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated webdataset shards as the CIFAR train shards: `KEY.jpg` + `KEY.cls`, classes.txt, .tar.gz."""
    root = tmp_path_factory.mktemp("shards") / "shards"
    shard_tree(root, CLASSES, SHARDS, PER_SHARD)
    return root


def batches(loader: DataLoader) -> list:
    return list(loader)


# ---- image folders ---------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [("train", "val"), ("imagenet21k_train", "imagenet21k_val")])
def test_folder_split_layouts(subset: Path, tmp_path: Path, names: tuple[str, str]) -> None:
    classes = ["cat", "airplane", "dog"]
    root = make_tree(subset, tmp_path / "d", classes, 5, 2, *names)
    dm = ImageFolderDataModule(str(root), **SMALL)
    assert dm.class_names == ["airplane", "cat", "dog"]  # sorted folder names, before setup
    assert dm.num_classes == 3
    dm.setup("fit")
    assert len(dm.train_dataset) == 15 and len(dm.val_dataset) == 6
    assert [t for _, t in dm.val_dataset.samples] == [0, 0, 1, 1, 2, 2]
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    xs = torch.cat([b[0] for b in batches(dm.val_dataloader())])
    assert xs.shape == (6, 3, 32, 32) and -1.0 <= xs.min() and xs.max() <= 1.0
    cfg = dm.data_config
    assert cfg == dict(img_size=[32, 32], mean=[0.5] * 3, std=[0.5] * 3, interpolation="bicubic", crop_pct=1.0,
                       class_names=["airplane", "cat", "dog"])  # fmt: skip


def test_folder_test_split_is_what_vitlab_test_scores(subset: Path, tmp_path: Path) -> None:
    """root/test beside root/train: kept out of fit (val stays val/), scored by test_dataloader."""
    classes = ["cat", "dog"]
    root = make_tree(subset, tmp_path / "d", classes, 4, 2)
    for c in classes:
        link_files(subset / "val" / c, root / "test" / c, 3, offset=2)  # files val/ does not hold
    dm = ImageFolderDataModule(str(root), **SMALL)
    dm.setup("fit")
    test_files = sorted(str(p) for p in (root / "test").rglob("*.png"))
    assert len(test_files) == 6
    assert sorted(p for p, _ in dm.test_dataset.samples) == test_files
    assert not set(test_files) & {p for p, _ in dm.train_dataset.samples + dm.val_dataset.samples}
    assert sorted(torch.cat([b[1] for b in dm.test_dataloader()]).tolist()) == [0, 0, 0, 1, 1, 1]
    assert sorted(torch.cat([b[1] for b in dm.val_dataloader()]).tolist()) == [0, 0, 1, 1]

    # Without a train folder, "test" is a class of the flat layout, not a split.
    flat = tmp_path / "flat"
    link_files(subset / "train" / "cat", flat / "test", 5)
    link_files(subset / "train" / "ship", flat / "ship", 5)
    fdm = ImageFolderDataModule(str(flat), val_fraction=0.2, **SMALL)
    fdm.setup("fit")
    assert fdm.class_names == ["ship", "test"] and fdm.test_dataset is None

    link_files(subset / "val" / "ship", root / "test" / "ship", 1)
    with pytest.raises(ValueError, match=r"test classes in .*test differ.*only in test: \['ship'\]"):
        ImageFolderDataModule(str(root), **SMALL).setup("fit")


def test_folder_flat_21k_heldout_is_deterministic(subset: Path, tmp_path: Path) -> None:
    root = make_tree(subset, tmp_path / "flat", ["bird", "frog", "ship"], 20, None, train="")
    splits = []
    for _ in range(2):
        dm = ImageFolderDataModule(str(root), val_fraction=0.2, **SMALL)
        dm.setup("fit")
        splits.append(([p for p, _ in dm.train_dataset.samples], [p for p, _ in dm.val_dataset.samples]))
    (train, val), (train2, val2) = splits
    assert (train, val) == (train2, val2)  # stable across instantiations
    assert not set(train) & set(val) and len(set(train) | set(val)) == 60
    per_class = collections.Counter(Path(p).parent.name for p in val)
    assert per_class == {"bird": 4, "frog": 4, "ship": 4}
    # hash order, not listing order: removing a training file leaves the held-out files as they were
    Path(next(p for p in train if Path(p).parent.name == "bird")).unlink()
    dm = ImageFolderDataModule(str(root), val_fraction=0.2, **SMALL)
    dm.setup("fit")
    assert [p for p, _ in dm.val_dataset.samples] == val and len(dm.train_dataset) == 47
    nov = ImageFolderDataModule(str(root), val_fraction=0.0, **SMALL)
    nov.setup("fit")
    assert nov.val_dataset is None and nov.val_dataloader() == []


def test_folder_image_modes_load_as_rgb(subset: Path, tmp_path: Path) -> None:
    src = sorted((subset / "train" / "cat").iterdir())[:6]
    root = tmp_path / "modes"
    (root / "train" / "cat").mkdir(parents=True)
    modes = {"L": "png", "P": "png", "RGBA": "png", "LA": "png", "1": "png", "CMYK": "jpg"}
    for f, (mode, ext) in zip(src, modes.items()):
        Image.open(f).convert(mode).save(root / "train" / "cat" / f"{mode}.{ext}")
    pal = Image.open(src[0]).convert("P")
    pal.info["transparency"] = 0
    pal.save(root / "train" / "cat" / "P_transparent.png", transparency=0)
    dm = ImageFolderDataModule(str(root), val_fraction=0.0, **SMALL)
    dm.setup("fit")
    assert len(dm.train_dataset) == 7
    for i in range(7):
        x, y = dm.train_dataset[i]
        assert x.shape == (3, 32, 32) and y == 0


def test_folder_errors(subset: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=rf"{missing}.*does not exist.*train/<class>"):
        ImageFolderDataModule(str(missing), **SMALL).setup("fit")

    empty = make_tree(subset, tmp_path / "empty", ["cat", "dog"], 3, 1)
    (empty / "train" / "emu").mkdir()
    (empty / "val" / "emu").mkdir()
    (empty / "train" / "emu" / "notes.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError, match="without images.*emu"):
        ImageFolderDataModule(str(empty), **SMALL).setup("fit")

    mism = make_tree(subset, tmp_path / "mism", ["cat", "dog"], 3, 1)
    shutil.rmtree(mism / "val" / "dog")
    link_files(subset / "val" / "ship", mism / "val" / "ship", 1)
    with pytest.raises(ValueError, match=r"missing from val: \['dog'\]; only in val: \['ship'\]"):
        ImageFolderDataModule(str(mism), **SMALL).setup("fit")

    ok = make_tree(subset, tmp_path / "ok", ["cat", "dog"], 3, 1)
    with pytest.raises(ValueError, match=r"num_classes=5 .* 2 classes"):
        ImageFolderDataModule(str(ok), num_classes=5, **SMALL).setup("fit")
    assert ImageFolderDataModule(str(ok), num_classes=2, **SMALL).num_classes == 2


def test_folder_bad_images(subset: Path, tmp_path: Path) -> None:
    root = make_tree(subset, tmp_path / "bad", ["cat"], 4, None)
    d = root / "train" / "cat"
    good = sorted(d.iterdir())[0].read_bytes()
    (d / "a_zero.png").write_bytes(b"")
    (d / "b_truncated.png").write_bytes(good[: len(good) // 2])
    (d / "c_text.jpg").write_text("this is not a jpeg")
    bad = {"a_zero.png", "b_truncated.png", "c_text.jpg"}

    dm = ImageFolderDataModule(str(root), val_fraction=0.0, **SMALL)
    dm.setup("fit")
    for i, (path, _) in enumerate(dm.train_dataset.samples):
        if Path(path).name in bad:
            with pytest.raises(BadImageError, match=Path(path).name):
                dm.train_dataset[i]

    dm = ImageFolderDataModule(str(root), val_fraction=0.0, skip_bad_images=True, **{**SMALL, "batch_size": 7})
    dm.setup("fit")
    (x, y), = batches(dm.train_dataloader())  # length kept: bad slots refilled by the next good file
    assert x.shape == (7, 3, 32, 32) and dm.bad_image_count == 3


# ---- shards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [None, 7, 256])
def test_shard_split_arithmetic(world_size: int, num_workers: int, batch_size: int | None) -> None:
    """Uneven shards: rank x worker pieces tile [0, world*L) once; equal batch counts per rank."""
    counts = [5, 1000, 37, 0, 800, 3, 2500]
    total, per_rank = sum(counts), sum(counts) // world_size
    for epoch in (0, 1):
        covered, nbatches = [], []
        for rank in range(world_size):
            s = ShardStream([f"s{i}" for i in range(len(counts))], counts, rank=rank, world_size=world_size,
                            batch_size=batch_size, shuffle=True, seed=3)  # fmt: skip
            order = s.shard_order(epoch)
            starts = {sh: sum(counts[o] for o in order[: order.index(sh)]) for sh in order}
            n = 0
            for w in range(num_workers):
                a, b = split_range(total, rank, world_size, w, num_workers, batch_size)
                pieces = s.pieces(epoch, w, num_workers)
                got = [starts[sh] + i for sh, lo, hi in pieces for i in range(lo, hi)]
                assert got == list(range(a, b))
                covered += got
                n += -(-(b - a) // batch_size) if batch_size else 0
            nbatches.append(n)
            assert len(s) == per_rank
        assert sorted(covered) == list(range(world_size * per_rank))
        assert total - len(covered) == total % world_size  # only the remainder is dropped
        if batch_size:
            assert nbatches == [-(-per_rank // batch_size)] * world_size


def test_shards_every_sample_once_over_2_ranks_x_2_workers(shards: Path) -> None:
    """Two simulated ranks, each with 2 persistent workers, two epochs; keys and labels only (no decoding)."""
    dm = ShardDataModule(str(shards), val_fraction=0.0, img_size=32, batch_size=10, num_workers=2)
    assert dm.class_names == CLASSES  # from classes.txt, no scan
    loaders = []
    for rank in range(2):
        stream = dm.dataset("train", rank=rank, world_size=2, decode=False)
        loaders.append(EpochLoader(stream, batch_size=stream.batch_size, num_workers=2, persistent_workers=True))
        assert len(stream) == N // 2 and len(loaders[-1]) == 100  # 500 per rank, 5 per device
    rank0_keys = []
    for epoch in range(2):
        seen: collections.Counter = collections.Counter()
        labels: dict[str, int] = {}
        per_rank = []
        for rank, loader in enumerate(loaders):
            n = 0
            for keys, ys in loader:
                n += 1
                seen.update(keys)
                labels.update(zip(keys, ys.tolist()))
                if rank == 0:
                    rank0_keys.append(set(keys))
            per_rank.append(n)
        assert per_rank == [100, 100]
        assert len(seen) == N and set(seen.values()) == {1}
        assert collections.Counter(labels.values()) == {c: N // 10 for c in range(10)}
        assert all(k.startswith(CLASSES[y]) for k, y in labels.items())  # keys are "<class>_<n>"
    # the persistent workers saw the new epoch: rank 0 read other shards, in another order
    assert set().union(*rank0_keys[:100]) != set().union(*rank0_keys[100:])


def test_shards_num_samples_is_checked(shards: Path) -> None:
    """num_samples skips counting; a wrong value is caught while reading, not silently mis-split."""
    def read(num_samples: int) -> int:
        dm = ShardDataModule(str(shards), val_fraction=0.0, num_samples=num_samples, img_size=32, batch_size=8)
        stream = dm.dataset("train", rank=0, world_size=8, decode=False)
        return sum(1 for _ in stream)

    assert read(N) == N // 8
    with pytest.raises(RuntimeError, match=r"holds more than the 96 samples"):
        read(N - 40)  # 10 shards assumed to hold 96 each
    with pytest.raises(RuntimeError, match=r"ended after 100 samples but was indexed with 140"):
        read(N + 400)


def test_shards_reshuffle_per_epoch_and_heldout(shards: Path) -> None:
    dm = ShardDataModule(str(shards), img_size=32, batch_size=64, num_workers=0, shuffle_buffer=64,
                         train_crop="pad", crop_pct=1.0)  # fmt: skip
    train, val = dm.dataset("train", decode=False), dm.dataset("val", decode=False)
    keys = [n.removesuffix(".cls") for f in sorted(shards.glob("*.tar.gz")) for n in tarfile.open(f).getnames()
            if n.endswith(".cls")]  # fmt: skip
    assert len(val) == sum(key_in_val(k, 0.02) for k in keys) and len(train) + len(val) == N
    assert 0.01 * N < len(val) < 0.03 * N  # ~2% by key hash
    first = [s for s, _, _ in train.pieces(0)]
    assert first != [s for s, _, _ in train.pieces(1)] and sorted(first) == list(range(10))
    it = iter(val)
    val_keys = {next(it)[0] for _ in range(10)}
    train_head = [k for k, _ in zip((k for k, _ in iter(train)), range(N // 2))]
    assert all(key_in_val(k, 0.02) for k in val_keys) and not any(key_in_val(k, 0.02) for k in train_head)
    train.set_epoch(1)
    assert [k for k, _ in zip((k for k, _ in iter(train)), range(50))] != train_head[:50]

    dm = ShardDataModule(str(shards), img_size=32, batch_size=8, num_workers=0, shuffle_buffer=16,
                         mixup_alpha=0.8, train_crop="pad", crop_pct=1.0)  # fmt: skip
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and y.shape == (8, 10)
    torch.testing.assert_close(y.sum(1), torch.ones(8))
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (8, 3, 32, 32) and y.dtype == torch.int64


def _write_shard(path: Path, samples: list[tuple[str, str, bytes, int]]) -> None:
    with tarfile.open(path, "w") as tf:
        for key, ext, data, label in samples:
            for name, payload in ((f"{key}.{ext}", data), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))


def test_shards_bad_images(subset: Path, tmp_path: Path) -> None:
    files = sorted((subset / "train" / "dog").iterdir())[:6]
    good = [(f"k{i}", "png", f.read_bytes(), 5) for i, f in enumerate(files)]
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    _write_shard(shard_dir / "s-000000.tar", good[:3] + [("k_zero", "jpg", b"", 5)])
    _write_shard(shard_dir / "s-000001.tar", [("k_junk", "jpg", b"\xff\xd8 junk", 5)] + good[3:])
    (shard_dir / "classes.txt").write_text("\n".join(CLASSES) + "\n")

    dm = ShardDataModule(str(shard_dir / "s-{000000..000001}.tar"), val_fraction=0.0, **{**SMALL, "batch_size": 8})
    dm.setup("fit")
    with pytest.raises(BadImageError, match=r"s-00000[01]\.tar:k_(zero|junk)"):
        batches(dm.train_dataloader())

    dm = ShardDataModule(str(shard_dir), val_fraction=0.0, skip_bad_images=True, **{**SMALL, "batch_size": 8})
    dm.setup("fit")
    (x, y), = batches(dm.train_dataloader())  # both bad slots refilled: still 8 samples
    assert x.shape == (8, 3, 32, 32) and y.tolist() == [5] * 8 and dm.bad_image_count == 2

    with pytest.raises(ValueError, match="num_classes=3 .* 10 classes"):
        ShardDataModule(str(shard_dir), num_classes=3, **SMALL).num_classes


# ---- HF datasets -----------------------------------------------------------------------------------


def test_hf_imagefolder(subset: Path, tmp_path: Path) -> None:
    root = make_tree(subset, tmp_path / "hf", ["cat", "dog", "ship"], 6, 2, "train", "validation")
    dm = HFDataModule("imagefolder", data_dir=str(root), cache_dir=str(tmp_path / "cache"), **SMALL)
    assert dm.class_names == ["cat", "dog", "ship"]
    dm.setup("fit")
    assert len(dm.train_dataset) == 18 and len(dm.val_dataset) == 6
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and set(y.tolist()) <= {0, 1, 2}
    assert sorted(torch.cat([b[1] for b in dm.val_dataloader()]).tolist()) == [0, 0, 1, 1, 2, 2]
    assert dm.test_dataset is None  # no test split: `vitlab test` scores the validation data
    assert sorted(torch.cat([b[1] for b in dm.test_dataloader()]).tolist()) == [0, 0, 1, 1, 2, 2]

    # A test split is what `vitlab test` scores, and model selection never sees it.
    for c in ["cat", "dog", "ship"]:
        link_files(subset / "val" / c, tmp_path / "hf_test" / "test" / c, 3, offset=2)
        shutil.copytree(root / "train" / c, tmp_path / "hf_test" / "train" / c, symlinks=True)
        shutil.copytree(root / "validation" / c, tmp_path / "hf_test" / "validation" / c, symlinks=True)
    with_test = HFDataModule("imagefolder", data_dir=str(tmp_path / "hf_test"), cache_dir=str(tmp_path / "cache"),
                             **SMALL)  # fmt: skip
    with_test.setup("fit")
    assert len(with_test.val_dataset) == 6 and len(with_test.test_dataset) == 9
    assert sorted(torch.cat([b[1] for b in with_test.test_dataloader()]).tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]

    held = HFDataModule("imagefolder", data_dir=str(root / "train"), cache_dir=str(tmp_path / "cache"),
                        val_split=None, val_fraction=0.33, **SMALL)  # fmt: skip
    held.setup("fit")
    assert len(held.train_dataset) + len(held.val_dataset) == 18 and len(held.val_dataset) == 6
    with pytest.raises(ValueError, match="no column 'img'"):
        HFDataModule("imagefolder", data_dir=str(root), cache_dir=str(tmp_path / "cache"), image_column="img",
                     **SMALL).setup("fit")  # fmt: skip


@pytest.mark.parametrize("num_workers", [0, 2])
def test_hf_streaming_gives_every_rank_the_same_batches(subset: Path, tmp_path: Path, num_workers: int) -> None:
    """17 train and 7 validation images streamed over 2 ranks (neither divides): every rank must yield
    the same number of batches (8 images: 4 of the per-device 2), or DDP waits forever at the epoch's end;
    no image on two ranks, at most world_size - 1 dropped."""
    root = tmp_path / "hf"
    link_files(subset / "train" / "cat", root / "train" / "cat", 9)
    link_files(subset / "train" / "dog", root / "train" / "dog", 8)
    link_files(subset / "val" / "cat", root / "validation" / "cat", 4)
    link_files(subset / "val" / "dog", root / "validation" / "dog", 3)
    kw = {**SMALL, "num_workers": num_workers, "auto_augment": None}
    train_sizes, val_images = [], []
    for rank in (0, 1):
        dm = HFDataModule("imagefolder", data_dir=str(root), streaming=True, cache_dir=str(tmp_path / "cache"), **kw)
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, num_devices=2, current_epoch=0)
        dm.setup("fit")
        train_sizes.append([len(y) for _, y in dm.train_dataloader()])
        val_images.append(torch.cat([x for x, _ in dm.val_dataloader()]))
    assert train_sizes == [[2, 2, 2, 2], [2, 2, 2, 2]]
    assert [len(v) for v in val_images] == [3, 3]
    flat = torch.cat(val_images).flatten(1)
    assert len({tuple(r.tolist()) for r in flat}) == 6  # 6 distinct images: none on both ranks


# ---- transforms, collate, batch arithmetic, CIFAR --------------------------------------------------


def test_eval_transform_pil_and_tensor(subset: Path) -> None:
    from vitlab.models import VisionTransformer

    model = VisionTransformer(img_size=48, patch_size=16, num_classes=10, embed_dim=32, depth=1, num_heads=2)
    t = eval_transform(model)
    img = Image.open(sorted((subset / "val" / "cat").iterdir())[0])
    for x in (img, img.convert("L"), img.convert("RGBA"), img.convert("P")):
        out = t(x)
        assert out.shape == (3, 48, 48) and out.dtype == torch.float32
    white = torch.full((3, 40, 60), 255, dtype=torch.uint8)
    torch.testing.assert_close(t(white), torch.ones(3, 48, 48))  # (1 - 0.5) / 0.5
    for c in (1, 4):
        assert t(torch.zeros(c, 40, 60, dtype=torch.uint8)).shape == (3, 48, 48)
    torch.testing.assert_close(t(torch.zeros(1, 40, 60, dtype=torch.uint8)), -torch.ones(3, 48, 48))

    cfg = dict(img_size=224, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], crop_pct=0.875)
    t = eval_transform(cfg)
    assert [type(op).__name__ for op in t.transforms][1:3] == ["Resize", "CenterCrop"]
    assert t.transforms[1].size == [256]  # 224 / 0.875
    x = t(img)
    assert x.shape == (3, 224, 224)
    grey = eval_transform({**cfg, "mean": [0.5] * 3, "std": [0.5] * 3})(Image.new("L", (50, 70), 128))
    torch.testing.assert_close(grey, torch.full((3, 224, 224), 128 / 255 * 2 - 1))


def test_train_transform_modes(subset: Path) -> None:
    img = Image.open(sorted((subset / "train" / "cat").iterdir())[0])
    variants = (
        dict(train_crop="rrc"), dict(train_crop="pad"), dict(auto_augment="trivialaugment"), dict(auto_augment=None),
    )  # fmt: skip
    for kw in variants:
        assert train_transform(64, **kw)(img).shape == (3, 64, 64)
    pad = train_transform(32, train_crop="pad", hflip=False, auto_augment=None)
    assert pad(img).shape == (3, 32, 32)
    with pytest.raises(ValueError, match="train_crop"):
        train_transform(32, train_crop="center")
    with pytest.raises(ValueError, match="interpolation"):
        ImageFolderDataModule("x", interpolation="cubic")


def check_mixed(x: torch.Tensor, y: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Checks a mixed batch of constant images (image k is filled with k + 1, class k) against its
    soft targets; returns ("mixup" | "cutmix", each image's own-class weight).

    Each target row must put weight w on its own class and 1 - w on one partner class p; MixUp then
    makes every pixel w (k + 1) + (1 - w) (p + 1), CutMix pastes a box of image p, so that a fraction
    1 - w of the pixels is p + 1 and the rest k + 1.
    """
    n = len(y)
    assert y.shape == (n, n) and y.dtype == torch.float32 and (y >= 0).all()
    torch.testing.assert_close(y.sum(1), torch.ones(n))
    own = y.diagonal().clone()
    others = y.clone()
    others.fill_diagonal_(0)
    partner = others.argmax(1)
    mixed = own < 1 - 1e-6
    assert (others.gt(1e-6).sum(1) <= 1).all(), y  # at most one partner per image
    kinds = set()
    for k in range(n):
        img, w, p = x[k], float(own[k]), int(partner[k]) if mixed[k] else k
        if torch.allclose(img, torch.full_like(img, w * (k + 1) + (1 - w) * (p + 1)), atol=1e-5):
            kinds.add("mixup" if 1e-6 < w < 1 - 1e-6 else "none")
            continue
        from_self, from_partner = img.eq(k + 1), img.eq(p + 1)
        assert (from_self | from_partner).all(), f"image {k}: pixels neither its own nor its partner's"
        assert from_self.float().mean().item() == pytest.approx(w, abs=1e-6), f"image {k}: area != target weight"
        kinds.add("cutmix")
    assert len(kinds - {"none"}) <= 1, kinds  # one operation per batch
    return (kinds - {"none"} or {"none"}).pop(), own


@pytest.mark.parametrize("mixup,cutmix", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_mixup_cutmix_mixes_images_and_targets_in_the_same_proportions(mixup: float, cutmix: float) -> None:
    n = 8
    batch = [(torch.full((3, 32, 32), float(k + 1)), k) for k in range(n)]
    collate = mixup_cutmix_collate(n, mixup, cutmix)
    kinds, weights = [], []
    for _ in range(20):
        kind, own = check_mixed(*collate(batch))
        kinds.append(kind)
        weights.append(own)
    w = torch.cat(weights)
    # Mixing happens: Beta(alpha, alpha) weights, strictly inside (0, 1) and spread around 1/2.
    assert (w < 0.99).float().mean() > 0.5 and w.min() < 0.5 < w.max(), w
    want = {"mixup"} if cutmix == 0 else {"cutmix"} if mixup == 0 else {"mixup", "cutmix"}
    assert set(kinds) == want, kinds
    x, y = mixup_cutmix_collate(5)(batch[:5] + batch[:3])
    assert y.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert torch.equal(x[:, 0, 0, 0], torch.tensor([1.0, 2, 3, 4, 5, 1, 2, 3]))


def test_global_batch_per_device(subset: Path, tmp_path: Path) -> None:
    assert per_device_batch(256, 4) == 64 and per_device_batch(256, 1) == 256
    with pytest.raises(ValueError, match=r"batch_size=250 is the GLOBAL batch.*world_size=4.*248 or 252"):
        per_device_batch(250, 4)
    root = make_tree(subset, tmp_path / "b", ["cat", "dog"], 8, 2)
    dm = ImageFolderDataModule(str(root), **{**SMALL, "batch_size": 8})
    dm.trainer = SimpleNamespace(world_size=4, global_rank=1, num_devices=4, current_epoch=0)
    dm.setup("fit")
    assert dm.per_device_batch_size == dm.batch_size_per_device == 2
    assert next(iter(dm.train_dataloader()))[0].shape[0] == 2
    dm = ImageFolderDataModule(str(root), **{**SMALL, "batch_size": 6})
    dm.trainer = SimpleNamespace(world_size=4, global_rank=0, num_devices=4, current_epoch=0)
    with pytest.raises(ValueError, match="GLOBAL batch"):
        dm.setup("fit")


def test_cifar_missing_names_the_folder(tmp_path: Path) -> None:
    dm = CIFARDataModule(root=str(tmp_path / "data"), download=False)
    assert dm.class_names == CLASSES and dm.data_config["crop_pct"] == 1.0
    with pytest.raises(RuntimeError, match=r"cifar-10-batches-py.*DATA=<ImageFolder path>.*ImageFolderDataModule"):
        dm.setup("fit")
    dm.prepare_data()  # download=False: never touches the network


def fake_cifar10(subset: Path, root: Path, n_train: int, n_test: int) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's CIFAR-10 python layout under `root`, from the subset's images: `n_train` per class
    in data_batch_1 (batches 2-5 empty) and `n_test` per class (from the subset's val/) in test_batch.
    Returns (train pixels [N, 3072], test pixels) in file order."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    out = []
    for name, split, n in (("data_batch_1", "train", n_train), ("test_batch", "val", n_test)):
        pixels, labels = [], []
        for label, c in enumerate(CLASSES):
            for f in sorted((subset / split / c).iterdir())[:n]:
                pixels.append(np.asarray(Image.open(f).convert("RGB")).transpose(2, 0, 1).reshape(-1))
                labels.append(label)
        data = np.stack(pixels).astype(np.uint8)
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": data, "labels": labels}, fh)
        out.append(data)
    for i in range(2, 6):
        with open(folder / f"data_batch_{i}", "wb") as fh:
            pickle.dump({"data": np.zeros((0, 3072), np.uint8), "labels": []}, fh)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": CLASSES}, fh)
    return out[0], out[1]


def raw_pixels(loader: DataLoader) -> np.ndarray:
    """Pixels of every image a loader yields, back as the uint8 rows of a CIFAR file (eval transform with
    mean 0, std 1 and crop_pct 1: a plain /255)."""
    x = torch.cat([b[0] for b in loader])
    return (x * 255).round().to(torch.uint8).flatten(1).numpy()


def test_cifar_selects_models_on_held_out_train_images_and_tests_on_the_test_split(
    subset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchvision.datasets.cifar

    # The files are ours, not the release: skip torchvision's md5 checks.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    train_px, test_px = fake_cifar10(subset, tmp_path / "data", n_train=20, n_test=5)
    kw = dict(root=str(tmp_path / "data"), download=False, batch_size=16, num_workers=0, mean=(0, 0, 0),
              std=(1, 1, 1), auto_augment=None, hflip=False)  # fmt: skip
    dm = CIFARDataModule(**kw)
    dm.setup("fit")
    val = raw_pixels(dm.val_dataloader())
    test = raw_pixels(dm.test_dataloader())
    # Validation: 10% of each class of the TRAIN split (2 of 20), none of them trained on.
    assert len(val) == 20 and len(dm.train_dataset) == 180
    train_rows = {r.tobytes(): i for i, r in enumerate(train_px)}
    val_idx = sorted(train_rows[r.tobytes()] for r in val)
    assert collections.Counter(i // 20 for i in val_idx) == {c: 2 for c in range(10)}
    assert not set(val_idx) & set(dm.train_dataset.indices)
    assert sorted(val_idx + list(dm.train_dataset.indices)) == list(range(200))
    assert not {r.tobytes() for r in test_px} & set(train_rows)
    # Test: exactly the test split, in order.
    np.testing.assert_array_equal(test, test_px)
    # The same images are held out every time (every run, every rank).
    again = CIFARDataModule(**kw)
    again.setup("fit")
    np.testing.assert_array_equal(raw_pixels(again.val_dataloader()), val)
    # The old behaviour on request: validate on the test split, train on all of the train split.
    on_test = CIFARDataModule(**kw, validate_on_test=True)
    on_test.setup("fit")
    np.testing.assert_array_equal(raw_pixels(on_test.val_dataloader()), test_px)
    assert len(on_test.train_dataset) == 200
    with pytest.raises(ValueError, match="val_fraction.*validate_on_test"):
        CIFARDataModule(**kw, val_fraction=0.0)


def test_fit_with_lightning(subset: Path, shards: Path, tmp_path: Path) -> None:
    """The DataModules under a real Trainer: loaders, lengths and the epoch hand-off."""
    import lightning as L

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3 * 32 * 32, 10)
            self.epochs_seen: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 0:
                ds = self.trainer.train_dataloader.dataset
                self.epochs_seen.append(ds.epoch if hasattr(ds, "epoch") else -1)
            return torch.nn.functional.cross_entropy(self.lin(x.flatten(1)), y)

        def validation_step(self, batch, _):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    root = make_tree(subset, tmp_path / "f", CLASSES, 2, 1)
    shards = ShardDataModule(str(shards), img_size=32, batch_size=16, num_workers=0, shuffle_buffer=32,
                             train_crop="pad", crop_pct=1.0, mixup_alpha=0.5)  # fmt: skip
    for dm in (ImageFolderDataModule(str(root), **SMALL), shards):
        probe = Probe()
        trainer = L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=1, accelerator="cpu", devices=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(tmp_path))  # fmt: skip
        trainer.fit(probe, datamodule=dm)
        assert trainer.global_step == 4
        if dm is shards:
            assert probe.epochs_seen == [0, 1]
            assert trainer.num_training_batches == 2


def test_equal_batch_sampler_splits_without_repeats_into_equal_counts() -> None:
    for n, world, batch in [(33, 2, 4), (9, 2, 4), (100, 8, 4), (7, 3, 2)]:
        ranks = [[list(b) for b in EqualBatchSampler(n, world, r, batch)] for r in range(world)]
        want = math.ceil(math.ceil(n / world) / batch)
        assert {len(r) for r in ranks} == {want}, (n, world, batch, ranks)
        assert all(1 <= len(b) <= batch for r in ranks for b in r)
        assert sorted(i for r in ranks for b in r for i in b) == list(range(n))  # each image once
    assert [len(b) for b in EqualBatchSampler(9, 2, 1, 4)] == [3, 1]  # 4 images in the 2 batches rank 0 runs
    with pytest.raises(ValueError, match="per-device batch of at least 2"):
        EqualBatchSampler(3, 2, 1, 1)


def test_in_memory_loaders_use_the_distributed_samplers(shards: Path) -> None:
    """In-memory shards on 2 ranks: under a collective-forward strategy (FSDP) every rank runs the same
    number of validation batches and each held-out image is scored once; training takes the
    (seed, epoch) DistributedSampler, disjoint between ranks, that a resumed rank replays exactly."""
    from torch.utils.data import DistributedSampler

    shard = str(shards / "shards-000000.tar.gz")
    loaders = []
    for rank in range(2):
        # 17 held-out images, 4 per device: an unpadded split would give rank 0 3 batches, rank 1 2
        dm = ShardDataModule(shard, val_fraction=0.15, in_memory=True, img_size=32, batch_size=8, num_workers=0,
                             auto_augment=None, crop_pct=1.0)  # fmt: skip
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank, strategy=object(), training=False)
        dm.setup("fit")
        loaders.append((dm, dm.val_dataloader(), dm.train_dataloader()))
    n_val = len(loaders[0][0].val_dataset)
    val_batches = [list(val) for _, val, _ in loaders]  # uint8, as decoded (normalised on the device later)
    assert n_val == 17 and len(val_batches[0]) == len(val_batches[1]) == 3
    seen = torch.cat([x for rank in val_batches for x, _ in rank])
    assert seen.shape[0] == n_val  # every held-out image once over both ranks, none padded
    whole = loaders[0][0].val_dataset
    pixel_sums = lambda x: torch.sort(x.flatten(1).long().sum(1)).values  # noqa: E731
    assert torch.equal(pixel_sums(seen), pixel_sums(whole.images))
    samplers = [train.sampler for _, _, train in loaders]
    assert all(isinstance(s, DistributedSampler) for s in samplers)
    orders = [list(s) for s in samplers]
    n_train = len(loaders[0][0].train_dataset)
    assert len(orders[0]) == len(orders[1]) == math.ceil(n_train / 2)  # 83 images: one repeated to pad
    assert len(set(orders[0]) | set(orders[1])) == n_train and len(set(orders[0]) & set(orders[1])) <= 1
    for s in samplers:
        s.set_epoch(1)
    assert [list(s) for s in samplers] != orders  # reshuffled per epoch, from (seed, epoch) alone
    x, y = next(iter(loaders[0][2]))
    assert x.dtype == torch.uint8 and x.shape == (4, 3, 32, 32) and y.shape == (4,)
