"""vitlab's main job on real data: Tiny-ImageNet-200 pretraining, Imagenette fine-tuning at a higher
resolution, the shard-folder layouts DATA= takes (their errors on generated shards, without ../shared),
and the in-memory data path behind both recipes."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from vitlab.cli import VitlabCLI
from vitlab.recipe import data_args
from vitlab.data import ShardDataModule
from vitlab.data.memory import BatchAugment, crop_resize, sample_crop_boxes
from vitlab.data.shards import _raw_samples, expand_shards

from helpers import shard_tree

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "recipes/pretrain/tinyimagenet_vit_cpu.yaml"
SCRATCH = REPO / "recipes/pretrain/imagenette_scratch_cpu.yaml"
CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1"]


def lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]


# ---- DATA= layouts ---------------------------------------------------------------------------------


def test_train_and_val_shard_folders_give_both_splits_and_the_class_names(
    tinyimagenet_shards: Path, tmp_path: Path
) -> None:
    args = ["--config", str(PRETRAIN), *CPU, "--data_path", str(tinyimagenet_shards), "--run_dir", str(tmp_path)]
    dm = VitlabCLI(args=args, run=False).datamodule
    assert isinstance(dm, ShardDataModule)
    assert Path(dm.train_shards) == tinyimagenet_shards / "train"
    assert Path(dm.val_shards) == tinyimagenet_shards / "val"
    names = lines(tinyimagenet_shards / "train/classes.txt")
    assert len(names) == 200 and dm.class_names == names
    train, val = dm.dataset("train", decode=False), dm.dataset("val", decode=False)
    assert (len(train), len(val)) == (60_000, 10_000)  # the README's counts, the official val split whole


@pytest.fixture
def tin_layout(tmp_path: Path) -> Path:
    """Tiny-ImageNet's layout, generated: train/ and val/ shard folders, each with the same classes.txt."""
    names = ["goldfish", "European fire salamander", "bullfrog"]  # the first lines of the real classes.txt
    for split in ("train", "val"):
        shard_tree(tmp_path / "tin" / split, names, num_shards=1, per_shard=6)
    return tmp_path / "tin"


def link_shards(src: Path, dst: Path, n: int = 1) -> Path:
    dst.mkdir(parents=True)
    for shard in sorted(src.glob("*.tar.gz"))[:n]:
        (dst / shard.name).symlink_to(shard)
    if (src / "classes.txt").exists():
        shutil.copy(src / "classes.txt", dst / "classes.txt")
    return dst


def test_bad_shard_layouts_name_what_was_expected(tin_layout: Path, tmp_path: Path) -> None:
    # val/ without shards
    root = tmp_path / "no_val_shards"
    link_shards(tin_layout / "train", root / "train")
    (root / "val").mkdir()
    with pytest.raises(SystemExit, match=r"holds shards but .*val does not; put the validation shards there"):
        data_args(str(root))
    # val/classes.txt naming other classes: the labels would index a different list
    root = tmp_path / "mismatch"
    link_shards(tin_layout / "train", root / "train")
    link_shards(tin_layout / "val", root / "val")
    names = lines(root / "val/classes.txt")
    (root / "val/classes.txt").write_text("\n".join([names[1], names[0], *names[2:]]) + "\n")
    with pytest.raises(SystemExit, match=r"classes.txt differ \(line 1: 'goldfish' vs 'European fire salamander'\)"):
        data_args(str(root))
    # a folder that is neither shards nor class folders
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no class folders"):
        args = [
            "--config",
            str(PRETRAIN),
            *CPU,
            "--data_path",
            str(tmp_path / "empty"),
            "--run_dir",
            str(tmp_path / "r"),
        ]
        VitlabCLI(args=args, run=False).datamodule.setup("fit")
    # a held-out split when there is no val/ folder: train/ alone is taken, val_fraction applies
    root = tmp_path / "train_only"
    link_shards(tin_layout / "train", root / "train")
    assert data_args(str(root)) == [
        "--data=vitlab.data.ShardDataModule", f"--data.train_shards={root / 'train'}", "--data.val_shards=null"
    ]  # fmt: skip


def test_offline_default_fails_fast_naming_data(tmp_path: Path) -> None:
    """`make pretrain` without DATA on a machine without the data: one message, nothing fetched."""
    env = {**os.environ, "VITLAB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "vitlab.cli", "fit", "--config", str(PRETRAIN), "--run_dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "tinyimagenet is not in data/tinyimagenet-200/ and cannot be fetched (offline" in out.stderr
    assert "DATA=<folder> with train/ and val/ folders of webdataset shards" in out.stderr
    assert not list(tmp_path.glob("data/**/*.tar*")), "nothing may be downloaded"


# ---- the in-memory path ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imagenette_dm(imagenette_shards: Path) -> ShardDataModule:
    """The fine-tune recipe's data, decoded into memory once for the module (setup, as Lightning calls it)."""
    dm = ShardDataModule(
        str(imagenette_shards / "train"), val_fraction=0.1, in_memory=True, auto_augment=None, img_size=64,
        crop_pct=0.875, batch_size=64,
    )  # fmt: skip
    dm.setup("fit")
    return dm


def test_in_memory_split_matches_the_stream_key_for_key(
    imagenette_dm: ShardDataModule, imagenette_shards: Path
) -> None:
    for split, mem in (("train", imagenette_dm.train_dataset), ("val", imagenette_dm.val_dataset)):
        stream = dict(imagenette_dm.dataset(split, decode=False))  # key -> label, read from the .cls files
        assert len(mem) == len(stream) and set(mem.keys) == set(stream)
        assert {k: int(y) for k, y in zip(mem.keys, mem.labels, strict=True)} == stream
        assert Counter(mem.labels.tolist()) == Counter(stream.values())
    assert 900 < len(imagenette_dm.val_dataset) < 1000  # a tenth of 9,469
    # pixels: the stored train image of a key is that sample's JPEG, decoded independently here
    train = imagenette_dm.train_dataset
    where = {k: i for i, k in enumerate(train.keys)}
    checked = 0
    for sample in _raw_samples(expand_shards(str(imagenette_shards / "train"))[0]):
        if sample["__key__"] in where and checked < 20:
            ref = TF.pil_to_tensor(Image.open(io.BytesIO(sample["jpg"])).convert("RGB"))
            assert torch.equal(train.images[where[sample["__key__"]]], ref)
            assert int(train.labels[where[sample["__key__"]]]) == int(sample["cls"])
            checked += 1
    assert checked == 20


def test_in_memory_validation_batches_equal_the_streaming_transform(imagenette_dm: ShardDataModule) -> None:
    mem = imagenette_dm.val_dataset
    stream = imagenette_dm.dataset("val")  # decoded through eval_transform, image by image
    got = {}
    for i, (x, y) in enumerate(stream):
        got[i] = (x, y)
        if i == 31:
            break
    keys = [k for k, _ in imagenette_dm.dataset("val", decode=False)][:32]
    where = {k: i for i, k in enumerate(mem.keys)}
    batch = torch.stack([mem.images[where[k]] for k in keys])
    x, y = imagenette_dm.on_after_batch_transfer((batch, mem.labels[[where[k] for k in keys]]), 0)
    ref = torch.stack([got[i][0] for i in range(32)])
    assert x.shape == ref.shape == (32, 3, 64, 64)
    torch.testing.assert_close(x, ref, rtol=0, atol=1e-5)
    assert y.tolist() == [got[i][1] for i in range(32)]


def test_crop_boxes_stay_inside_the_image_with_rrc_scales_and_ratios() -> None:
    g = torch.Generator().manual_seed(0)
    cx, cy, w, h = sample_crop_boxes(100_000, "rrc", scale_min=0.25, generator=g).unbind(1)
    assert bool(((cx - w / 2) >= -1e-6).all() and ((cx + w / 2) <= 1 + 1e-6).all())
    assert bool(((cy - h / 2) >= -1e-6).all() and ((cy + h / 2) <= 1 + 1e-6).all())
    ratio = w / h
    assert ratio.min() >= 3 / 4 - 1e-5 and ratio.max() <= 4 / 3 + 1e-5
    # area ~ U(0.25, 1); a box sticking out is shrunk keeping its ratio, to no less than 3/4 of its area
    area = w * h
    assert area.min() >= 0.75 * 0.25 - 1e-6 and area.max() <= 1 + 1e-6
    assert abs(float((area >= 0.25).float().mean()) - 1.0) < 0.1  # shrinking is the exception
    mid = float(((area > 0.4) & (area < 0.6)).float().mean())
    assert abs(mid - 0.2 / 0.75) < 0.01  # uniform over [0.25, 1] where nothing was shrunk
    shifts = sample_crop_boxes(10_000, "pad", generator=g)
    assert bool((shifts[:, 2:] == 1).all()) and shifts[:, :2].sub(0.5).abs().max() <= 1 / 8


def test_crop_resize_against_slicing_on_real_images(imagenette_dm: ShardDataModule) -> None:
    images = imagenette_dm.train_dataset.images[:8].float() / 255  # 128x128 photos
    n = images.shape[0]
    whole = torch.tensor([[0.5, 0.5, 1.0, 1.0]]).repeat(n, 1)
    torch.testing.assert_close(crop_resize(images, whole, (128, 128)), images, rtol=0, atol=1e-5)
    flip = torch.tensor([True, False] * 4)
    flipped = crop_resize(images, whole, (128, 128), flip)
    torch.testing.assert_close(flipped[flip], images[flip].flip(-1), rtol=0, atol=1e-5)
    # rows 32:96 and columns 16:80 at their own scale are exactly those pixels
    box = torch.tensor([[(16 + 32) / 128, (32 + 32) / 128, 0.5, 0.5]]).repeat(n, 1)
    torch.testing.assert_close(crop_resize(images, box, (64, 64)), images[..., 32:96, 16:80], rtol=0, atol=1e-5)
    # the pad crop: a shift of 8 pixels right reads zeros in the first 8 columns
    shifted = torch.tensor([[0.5 - 8 / 128, 0.5, 1.0, 1.0]]).repeat(n, 1)
    out = crop_resize(images, shifted, (128, 128))
    assert float(out[..., :8].abs().max()) == 0.0
    torch.testing.assert_close(out[..., 8:], images[..., :-8], rtol=0, atol=1e-5)


def test_batch_augment_on_real_images(imagenette_dm: ShardDataModule) -> None:
    images, labels = imagenette_dm.train_dataset.__getitems__(list(range(64)))
    aug = BatchAugment(64, "rrc", 0.25, True, imagenette_dm.mean, imagenette_dm.std)
    x, y = aug(images, labels)
    assert x.shape == (64, 3, 64, 64) and x.dtype == torch.float32 and torch.equal(y, labels)
    # every image gets its own crop: no two outputs alike, and none is the plain resize
    plain = TF.normalize(torch.nn.functional.interpolate(images.float() / 255, size=64, mode="bilinear"),
                         imagenette_dm.mean, imagenette_dm.std)  # fmt: skip
    assert (x - plain).flatten(1).abs().mean(1).min() > 1e-3
    lo = (0 - torch.tensor(imagenette_dm.mean)) / torch.tensor(imagenette_dm.std)
    hi = (1 - torch.tensor(imagenette_dm.mean)) / torch.tensor(imagenette_dm.std)
    assert bool((x >= lo.view(1, 3, 1, 1) - 1e-4).all() and (x <= hi.view(1, 3, 1, 1) + 1e-4).all())


# ---- the recipes through make -----------------------------------------------------------------------


def make(target: str, *variables: str) -> subprocess.CompletedProcess:
    if not shutil.which("make"):
        pytest.fail("make is not installed; `make test` needs it")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    venv = Path(sys.executable).parent.parent
    out = subprocess.run(["make", "--no-print-directory", target, f"VENV={venv}", *variables], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


FEW_STEPS = (
    "ARGS=--trainer.max_steps=3 --trainer.limit_val_batches=2 --trainer.enable_progress_bar=false --loggers=[csv]"
)


@pytest.mark.slow
def test_pretrain_then_finetune_at_72px_through_make(
    tinyimagenet_shards: Path, imagenette_shards: Path, tmp_path: Path
) -> None:
    make("pretrain", f"DATA={tinyimagenet_shards}", f"RUN={tmp_path / 'pre'}", FEW_STEPS)
    pre = torch.load(tmp_path / "pre/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert pre["vitlab"]["data_config"]["class_names"] == lines(tinyimagenet_shards / "train/classes.txt")
    assert pre["state_dict"]["model.pos_embed"].shape == (1, 16, 192)  # 4x4 tokens at 32px
    assert pre["state_dict"]["model.head.weight"].shape == (200, 192)

    make("finetune", f"DATA={imagenette_shards}", f"RUN={tmp_path / 'ft'}", f"CKPT={tmp_path / 'pre/checkpoints/last.ckpt'}",
         FEW_STEPS, "RESOLUTION_ARGS=--limit-batches 1")  # fmt: skip
    # make finetune ends with the resolution sweep: source and fine-tuned model, around both sizes
    rows = json.loads((tmp_path / "ft/resolution/resolution.json").read_text())["rows"]
    assert {r["trained_img_size"] for r in rows} == {32, 72}  # the source and the fine-tuned model
    assert {32, 72, 88} <= {r["img_size"] for r in rows} and all(0 <= r["acc1"] <= 1 for r in rows if r["acc1"] is not None)
    ft = torch.load(tmp_path / "ft/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert ft["vitlab"]["data_config"]["class_names"] == lines(imagenette_shards / "train/classes.txt")
    assert ft["vitlab"]["model_config"]["img_size"] == [72, 72]
    assert ft["state_dict"]["model.pos_embed"].shape == (1, 81, 192)  # 9x9 tokens at 72px
    assert ft["state_dict"]["model.head.weight"].shape == (10, 192)
    # the encoder came from the pretraining: three small steps moved the tokenizer only a little
    w0, w1 = (
        pre["state_dict"]["model.patch_embed.convs.0.0.weight"],
        ft["state_dict"]["model.patch_embed.convs.0.0.weight"],
    )
    assert (w1 - w0).norm() < 0.1 * w0.norm()


@pytest.mark.slow
def test_scratch_recipe_through_make(imagenette_shards: Path, tmp_path: Path) -> None:
    make(
        "pretrain",
        f"RECIPE={SCRATCH.relative_to(REPO)}",
        f"DATA={imagenette_shards}",
        f"RUN={tmp_path / 's'}",
        FEW_STEPS,
    )
    ckpt = torch.load(tmp_path / "s/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["vitlab"]["data_config"]["class_names"] == lines(imagenette_shards / "train/classes.txt")
    assert ckpt["state_dict"]["model.pos_embed"].shape == (1, 64, 192)
