"""Progressive resizing (`data.img_size_schedule`): the sizes the model trains at per epoch through
`vitlab fit` (image folder, streamed and in-memory shards, HF dataset, CIFAR files), the same switch
step on 2 DDP ranks, the schedule continued by a resumed run, position embeddings resampled from the
full grid every time (checked against timm), and a size the patch cannot divide refused before training."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import tarfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from cli_probe import run_cli
from helpers import image_tree
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from timm.layers import resample_abs_pos_embed

from vitlab.cli import main
from vitlab.data import ImageFolderDataModule
from vitlab.models import create_model

TINY = {"patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}
CLASSES = ["a", "b", "c"]
SCHEDULE = [[0, 16], [2, 24], [3, 32]]
EXPECTED = {0: 16, 1: 16, 2: 24, 3: 32}  # epoch -> train size; 8 images a class, batch 8: 3 steps an epoch
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--loggers=[csv]"]


class RecordSizes(Callback):
    """Writes, per rank and process, (epoch, step, image side, model input size) of every train batch
    and (epoch, image side, model input size) of every validation batch after the sanity check."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.record: dict[str, list] = {"train": [], "val": []}
        self.name = f"{os.getpid()}-{time.time_ns()}"  # two runs in one process: two files

    def _write(self, trainer: L.Trainer) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{trainer.global_rank}-{self.name}.json"
        path.write_text(json.dumps(self.record))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        size = pl_module.model.input_size
        self.record["train"].append([trainer.current_epoch, trainer.global_step, batch[0].shape[-1],
                                     size and list(size)])  # fmt: skip
        self._write(trainer)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        if not trainer.sanity_checking:
            self.record["val"].append([trainer.current_epoch, batch[0].shape[-1], pl_module.model.input_size])
            self._write(trainer)


class TermAtStep(Callback):
    """Sends this process SIGTERM (a preemption) after optimizer step `step`: the run saves and stops."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def records(out: Path, rank: int = 0) -> dict[str, list]:
    """The records of every process of `rank` under `out`, in the order the processes ran."""
    merged: dict[str, list] = {"train": [], "val": []}
    for path in sorted(out.glob(f"rank{rank}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1])):
        for key, rows in json.loads(path.read_text()).items():
            merged[key] += rows
    return merged


def write_shards(tree: Path, dst: Path) -> Path:
    """The generated train tree as two webdataset shards (`KEY.png` + `KEY.cls`)."""
    dst.mkdir()
    files = sorted((tree / "train").glob("*/*.png"))
    for s in range(2):
        with tarfile.open(dst / f"train-{s:06d}.tar", "w") as tf:
            for f in files[s::2]:
                for name, payload in ((f"{f.stem}.png", f.read_bytes()),
                                      (f"{f.stem}.cls", str(CLASSES.index(f.parent.name)).encode())):  # fmt: skip
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tf.addfile(info, io.BytesIO(payload))
    (dst / "classes.txt").write_text("\n".join(CLASSES))
    return dst


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_tree(tmp_path_factory.mktemp("tree"), CLASSES, 8, 2)


def recipe(path: Path, data: dict, out: Path, epochs: int = 4) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_epochs": epochs, "log_every_n_steps": 1, "accelerator": "cpu", "devices": 1,
                    "callbacks": [{"class_path": "test_img_size_schedule.RecordSizes",
                                   "init_args": {"out_dir": str(out)}}]},
        "model": {"arch": "vit_tiny_patch16", "model_args": TINY, "lr": 1e-3, "warmup_steps": 0},
        "data": data,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


def folder_data(root: Path, **extra: Any) -> dict:
    args = {"root": str(root), "img_size": 32, "batch_size": 8, "num_workers": 1, "train_crop": "rrc",
            "auto_augment": "randaugment", "crop_pct": 1.0, "img_size_schedule": SCHEDULE, **extra}  # fmt: skip
    return {"class_path": "vitlab.data.ImageFolderDataModule", "init_args": args}


def shard_data(shards: Path, val: Path, in_memory: bool) -> dict:
    args = {"train_shards": str(shards), "val_shards": str(val), "in_memory": in_memory, "auto_augment": None,
            "img_size": 32, "batch_size": 8, "num_workers": 0 if in_memory else 1, "crop_pct": 1.0,
            "img_size_schedule": SCHEDULE}  # fmt: skip
    return {"class_path": "vitlab.data.ShardDataModule", "init_args": args}


def hf_data(root: Path, cache: Path) -> dict:
    args = {"path": "imagefolder", "data_dir": str(root), "cache_dir": str(cache), "img_size": 32, "batch_size": 8,
            "num_workers": 1, "train_crop": "rrc", "auto_augment": None, "crop_pct": 1.0,
            "img_size_schedule": SCHEDULE}  # fmt: skip
    return {"class_path": "vitlab.data.HFDataModule", "init_args": args}


def cifar_data(root: Path) -> dict:
    """torchvision's CIFAR-10 files, generated: 24 train images (3 steps of 8) and 10 test images, on which
    it validates (`validate_on_test`), so the step count does not hang on the held-out split's rounding."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for name, n in (("data_batch_1", 24), ("test_batch", 10), *((f"data_batch_{i}", 0) for i in range(2, 6))):
        pixels = torch.randint(0, 256, (n, 3 * 32 * 32), generator=gen, dtype=torch.uint8).numpy()
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": pixels, "labels": [i % 10 for i in range(n)]}, fh)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, fh)
    args = {"root": str(root), "download": False, "validate_on_test": True, "img_size": 32, "batch_size": 8,
            "num_workers": 1, "train_crop": "rrc", "auto_augment": None, "img_size_schedule": SCHEDULE}  # fmt: skip
    return {"class_path": "vitlab.data.CIFARDataModule", "init_args": args}


def sizes_by_epoch(rows: list) -> dict[int, set]:
    out: dict[int, set] = {}
    for epoch, _, side, model_size in rows:
        out.setdefault(epoch, set()).add((side, tuple(model_size) if model_size else None))
    return out


def expected_by_epoch() -> dict[int, set]:
    return {e: {(s, None if s == 32 else (s, s))} for e, s in EXPECTED.items()}


@pytest.mark.parametrize("path", ["folder", "memory", "stream", "hf", "cifar"])
def test_schedule_switches_at_the_listed_epochs(
    path: str, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every train batch of an epoch, and the model, at the scheduled size; validation at the full 32.
    Image folder, HF dataset, CIFAR files and streamed shards: a persistent DataLoader worker crops;
    in-memory shards: the batch augmentation on the device."""
    if path == "folder":
        data = folder_data(tree)
    elif path == "hf":
        data = hf_data(tree, tmp_path / "hf_cache")
    elif path == "cifar":
        import torchvision.datasets.cifar

        # The files are generated, not the release: skip torchvision's md5 checks.
        monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
        data = cifar_data(tmp_path / "cifar")
    else:
        shards, val = write_shards(tree, tmp_path / "shards"), write_shards(tree, tmp_path / "val")
        data = shard_data(shards, val, in_memory=path == "memory")
    out, run = tmp_path / "out", tmp_path / "run"
    assert main(["fit", "--config", str(recipe(tmp_path / "r.yaml", data, out)), "--run_dir", str(run), *QUIET]) == 0
    rec = records(out)
    assert sizes_by_epoch(rec["train"]) == expected_by_epoch()
    assert [r[0] for r in rec["train"]] == [e for e in range(4) for _ in range(3)]
    assert rec["val"] and {(side, size) for _, side, size in rec["val"]} == {(32, None)}
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["hyper_parameters"]["img_size"] == 32  # the model (and its checkpoint) are the final size
    assert ckpt["state_dict"]["model.pos_embed"].shape == (1, 1 + 4 * 4, 32)
    assert [list(p) for p in ckpt["datamodule_hyper_parameters"]["img_size_schedule"]] == SCHEDULE


def test_ddp_ranks_switch_at_the_same_step(tree: Path, tmp_path: Path) -> None:
    """2 gloo ranks: the same (epoch, step, size) sequence, switching at the scheduled epochs."""
    out = tmp_path / "out"
    cfg = recipe(tmp_path / "r.yaml", folder_data(tree), out)  # the global batch of 8: 3 steps of 4 a rank
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ddp = ["--trainer.devices=2", "--trainer.strategy=ddp"]
    rc, log, _, _ = run_cli(["fit", "--config", str(cfg), "--run_dir", str(tmp_path / "run"), *ddp, *QUIET], cwd,
                            timeout=300)  # fmt: skip
    assert rc == 0, log[-4000:]
    r0, r1 = records(out, 0)["train"], records(out, 1)["train"]
    assert r0 == r1
    assert sizes_by_epoch(r0) == expected_by_epoch()
    assert len(r0) == 12


def test_resumed_run_continues_the_schedule(tree: Path, tmp_path: Path) -> None:
    """Preempted (SIGTERM) after step 7, the first batch of epoch 2 and the first at 24 px, and resumed with
    --ckpt_path last: the resumed steps train at the sizes of an uninterrupted run, to the same weights."""
    data = folder_data(tree)
    exact = ["--trainer.deterministic=true", "--trainer.num_sanity_val_steps=0", *QUIET]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["fit", "--config", str(recipe(tmp_path / "a.yaml", data, whole / "out")),
                 "--run_dir", str(whole / "run"), *exact]) == 0  # fmt: skip
    cfg = recipe(tmp_path / "b.yaml", data, cut / "out")
    term = '{"class_path": "test_img_size_schedule.TermAtStep", "init_args": {"step": 7}}'
    with pytest.raises(SIGTERMException):  # the preempted run saves last.ckpt and stops
        main(["fit", "--config", str(cfg), "--run_dir", str(cut / "run"), f"--trainer.callbacks+={term}", *exact])
    first = records(cut / "out")["train"]
    assert [r[1] for r in first] == list(range(7)) and first[-1][:3] == [2, 6, 24]
    assert main(["fit", "--config", str(cfg), "--run_dir", str(cut / "run"), "--ckpt_path", "last", *exact]) == 0
    resumed = records(cut / "out")["train"]
    assert resumed == records(whole / "out")["train"]
    a, b = (torch.load(p / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
            for p in (whole, cut))  # fmt: skip
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_pos_embed_resampled_from_the_full_grid_every_time() -> None:
    """After 16 -> 24 -> 32 px forwards, the parameter is still the full 4x4 grid; a forward at 24 adds
    timm's resample of that parameter; the gradients of a 16 px forward reach the full grid as timm's
    resample passes them back; a sin-cos model draws its table for the grid."""
    model = create_model("vit_tiny_patch16", img_size=32, num_classes=3, **TINY).train()
    full = model.pos_embed.detach().clone()
    x24 = torch.randn(2, 3, 24, 24)
    for size in (16, 24, 32):
        model.use_input_size(size)
        model(torch.randn(2, 3, size, size)).sum().backward()
    assert model.pos_embed.shape == (1, 17, 32)
    torch.testing.assert_close(model.pos_embed.detach(), full, rtol=0, atol=0)
    model.zero_grad()

    model.use_input_size(24)
    tokens = model.patch_embed.tokenize(x24)
    cls = model.cls_token.expand(2, -1, -1)
    want = torch.cat([cls, tokens], 1) + resample_abs_pos_embed(full, [3, 3], num_prefix_tokens=1)
    torch.testing.assert_close(model.embed(x24), want)

    model.use_input_size(16)
    weights = torch.randn(2, 5, 32)
    (model.embed(torch.randn(2, 3, 16, 16)) * weights).sum().backward()
    leaf = full.clone().requires_grad_(True)
    (resample_abs_pos_embed(leaf, [2, 2], num_prefix_tokens=1) * weights.sum(0, keepdim=True)).sum().backward()
    torch.testing.assert_close(model.pos_embed.grad, leaf.grad)

    sincos = create_model("vit_tiny_patch16", img_size=32, num_classes=3, pos_embed="sincos", **TINY)
    sincos.use_input_size(24)
    native = create_model("vit_tiny_patch16", img_size=24, num_classes=3, pos_embed="sincos", **TINY)
    got = sincos.embed(x24) - torch.cat([sincos.cls_token.expand(2, -1, -1), sincos.patch_embed.tokenize(x24)], 1)
    torch.testing.assert_close(got, native.pos_embed.expand(2, -1, -1))

    model.use_input_size(None)
    with pytest.raises(ValueError, match="24x24 differs from the model's img_size 32x32"):
        model(x24)


def test_compiled_model_recompiles_once_per_size() -> None:
    """Under torch.compile (dynamo's guards; the eager backend keeps it fast) a schedule 16 -> 24 -> 32 and
    back to 16 compiles one graph per size, and each gives the uncompiled model's logits."""
    from torch._dynamo.utils import counters

    model = create_model("vit_tiny_patch16", img_size=32, num_classes=3, **TINY).eval()
    images = {s: torch.randn(2, 3, s, s) for s in (16, 24, 32)}
    want = {}
    for s, x in images.items():
        model.use_input_size(s)
        want[s] = model(x)
    counters.clear()
    model.compile(backend="eager")
    for s in (16, 16, 24, 32, 16):
        model.use_input_size(s)
        torch.testing.assert_close(model(images[s]), want[s])
    assert counters["stats"]["unique_graphs"] == 3


def test_a_size_the_patch_cannot_divide_fails_before_training(tree: Path, tmp_path: Path) -> None:
    data = folder_data(tree, img_size_schedule=[[0, 20], [2, 32]])
    out, run = tmp_path / "out", tmp_path / "run"
    with pytest.raises(ValueError) as err:
        main(["fit", "--config", str(recipe(tmp_path / "r.yaml", data, out)), "--run_dir", str(run), *QUIET])
    msg = str(err.value)
    assert "size 20" in msg and "patch size 8" in msg and "use 16 or 24" in msg and "\n" not in msg
    assert not out.exists() and not (run / "checkpoints" / "last.ckpt").exists()


@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        ([[0, 16], [2, 24]], r"must end at img_size=32 .* set img_size: 24 or end the schedule with \[2, 32\]"),
        ([[1, 16], [2, 32]], "epochs must start at 0 and increase"),
        ([[0, 16], [2, 24], [2, 32]], "epochs must start at 0 and increase"),
        ([[0, 0], [2, 32]], "sizes must be >= 1"),
        ([16, 32], "list of \\[epoch, size\\] pairs"),
    ],
)
def test_bad_schedules_fail_when_the_data_module_is_built(tree: Path, schedule: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ImageFolderDataModule(str(tree), img_size=32, img_size_schedule=schedule)
