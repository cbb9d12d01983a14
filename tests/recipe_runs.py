"""Helpers for tests/test_recipes.py: small data of each recipe's kind and size, built in a temporary
folder from the shared real data, and `RecordRun`, a callback that writes down what a `vitlab fit`
run really did (precision, clipping, optimizer, compilation, strategy, steps, losses) so that the
test can compare it with the recipe's YAML. It is loaded by class_path (`--trainer.callbacks+=
recipe_runs.RecordRun`): the DDP ranks import it through the PYTHONPATH `cli_probe.run_cli` sets."""

from __future__ import annotations

import io
import json
import math
import pickle
import tarfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from PIL import Image

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# ---- what a run did ------------------------------------------------------------------------------


class RecordRun(Callback):
    """Writes `<run_dir>/record-rank<R>.json` at the end of fit: the trainer's precision, clipping,
    strategy and process group, the optimizer and its settings, whether the model was compiled,
    the training losses and target shapes of every step, and the validation batches run."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.targets: list[list[int]] = []
        self.val_batches = 0
        self.sanity_batches = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.targets.append(list(batch[1].shape))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()))

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.sanity_checking:
            self.sanity_batches += 1
        else:
            self.val_batches += 1

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.optimizers[0]
        decayed = [g for g in opt.param_groups if g["weight_decay"] > 0]
        model = pl_module.model
        blocks_compiled = all(b._compiled_call_impl is not None for b in model.blocks)
        record = {
            "precision": trainer.precision,
            "precision_plugin": type(trainer.precision_plugin).__name__,
            "gradient_clip_val": trainer.gradient_clip_val,
            "gradient_clip_algorithm": str(trainer.gradient_clip_algorithm),
            "accelerator": type(trainer.accelerator).__name__,
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "optimizer": type(opt).__name__,
            "fused": bool(opt.defaults.get("fused")),
            "lr": opt.defaults["lr"],
            "betas": list(opt.defaults["betas"]) if "betas" in opt.defaults else None,
            "momentum": opt.defaults.get("momentum"),
            "weight_decay": decayed[0]["weight_decay"] if decayed else 0.0,
            "schedulers": [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs],
            "model_compiled": model._compiled_call_impl is not None,
            "blocks_compiled": blocks_compiled,
            "module": type(pl_module).__name__,
            "hparams": _plain(dict(pl_module.hparams)),
            "model_config": _plain(model.config),
            "datamodule": type(trainer.datamodule).__name__,
            "data_hparams": _plain(dict(trainer.datamodule.hparams)),
            "teacher": type(pl_module.teacher).__name__ if hasattr(pl_module, "teacher") else None,
            "init_summary": getattr(pl_module, "init_summary", None),
            "global_step": trainer.global_step,
            "losses": self.losses,
            "targets": self.targets,
            "val_batches": self.val_batches,
            "sanity_batches": self.sanity_batches,
        }
        Path(trainer.default_root_dir, f"record-rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def read_records(run_dir: Path, world_size: int) -> list[dict[str, Any]]:
    missing = [r for r in range(world_size) if not (run_dir / f"record-rank{r}.json").is_file()]
    assert not missing, f"no record from rank(s) {missing}: the run did not reach the end of fit"
    return [json.loads((run_dir / f"record-rank{r}.json").read_text()) for r in range(world_size)]


def finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


# ---- small data of each recipe's kind ------------------------------------------------------------


def _shard_members(src: Path, n: int) -> tuple[list[tuple[str, bytes]], list[str]]:
    """The members of the first `n` samples of the first shard in `src` (raw bytes, as stored), and
    the keys of those samples."""
    shard = sorted(p for p in src.iterdir() if p.name.endswith((".tar", ".tar.gz")))[0]
    members: list[tuple[str, bytes]] = []
    keys: list[str] = []
    with tarfile.open(shard) as tar:
        for info in tar:
            key = info.name.split(".", 1)[0]
            if key not in keys:
                if len(keys) == n:
                    break
                keys.append(key)
            members.append((info.name, tar.extractfile(info).read()))  # type: ignore[union-attr]
    return members, keys


def small_shards(src: Path, dst: Path, n: int) -> Path:
    """`dst/<name>-000000.tar` holding the first `n` samples (image + label, original bytes) of the first
    shard of `src`, and `src`'s classes.txt: a shard folder of the real format and classes, small."""
    dst.mkdir(parents=True)
    members, _ = _shard_members(src, n)
    with tarfile.open(dst / f"{src.parent.name}-000000.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (dst / "classes.txt").write_text((src / "classes.txt").read_text())
    return dst


def shard_images(src: Path, n: int) -> list[tuple[Image.Image, int]]:
    """The first `n` (image, label) pairs of the first shard of `src`."""
    members, keys = _shard_members(src, n)
    data = dict(members)
    return [(Image.open(io.BytesIO(data[f"{k}.jpg"])).convert("RGB"), int(data[f"{k}.cls"])) for k in keys]


def image_tree(src: Path, dst: Path, size: int, classes: int, n_train: int, n_val: int) -> Path:
    """An ImageFolder tree `dst/{train,val}/<class>/*.jpg` of real photos (from the shards in `src`)
    resized to `size` x `size`: an ImageNet-style folder at the recipe's resolution."""
    images = shard_images(src, classes * (n_train + n_val))
    for i, (img, _) in enumerate(images):
        c, j = i % classes, i // classes
        split = "train" if j < n_train else "val"
        folder = dst / split / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        img.resize((size, size), Image.BICUBIC).save(folder / f"{i:04d}.jpg", quality=90)
    return dst


def fake_cifar(subset: Path, root: Path, variant: str, per_class: int, per_class_test: int = 1) -> Path:
    """torchvision's python-version CIFAR layout (cifar-10-batches-py/ or cifar-100-python/) under
    `root`, from real CIFAR-10 images of the shared subset: `per_class` train images of each of its
    10 classes (labels 0-9, also for CIFAR-100, whose meta file lists 100 names) and
    `per_class_test` test images. torchvision's md5 checks must be switched off to read it."""
    pixels: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    labels: dict[str, list[int]] = {"train": [], "val": []}
    for split, n in (("train", per_class), ("val", per_class_test)):
        for label, c in enumerate(CIFAR10_CLASSES):
            for f in sorted((subset / split / c).iterdir())[:n]:
                pixels[split].append(np.asarray(Image.open(f).convert("RGB")).transpose(2, 0, 1).reshape(-1))
                labels[split].append(label)

    def write(path: Path, split: str, label_key: str) -> None:
        with open(path, "wb") as fh:
            pickle.dump({"data": np.stack(pixels[split]).astype(np.uint8), label_key: labels[split]}, fh)

    if variant == "cifar10":
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        write(folder / "data_batch_1", "train", "labels")
        for i in range(2, 6):
            with open(folder / f"data_batch_{i}", "wb") as fh:
                pickle.dump({"data": np.zeros((0, 3072), np.uint8), "labels": []}, fh)
        write(folder / "test_batch", "val", "labels")
        with open(folder / "batches.meta", "wb") as fh:
            pickle.dump({"label_names": CIFAR10_CLASSES}, fh)
    else:
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True)
        write(folder / "train", "train", "fine_labels")
        write(folder / "test", "val", "fine_labels")
        names = CIFAR10_CLASSES + [f"class{i}" for i in range(10, 100)]
        with open(folder / "meta", "wb") as fh:
            pickle.dump({"fine_label_names": names, "coarse_label_names": [f"super{i}" for i in range(20)]}, fh)
    return root


def resnet18_teacher(path: Path, num_classes: int) -> Path:
    """A torchvision ResNet-18 state dict (random weights), as bench/bench_distill.py saves its teacher."""
    import torchvision

    torch.save(torchvision.models.resnet18(num_classes=num_classes).state_dict(), path)
    return path


# The hub recipes' sources, as tiny random models under the recipes' own repo names (the arch check
# takes the test's small model_args); the commit is huggingface_hub's 40-hex layout.
HUB_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
HUB_TINY = {"embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 5}


def hub_cache(cache: Path) -> Path:
    """A Hugging Face cache holding the two hub recipes' `init_from` repos: timm's ViT-Ti/16 layout and
    transformers' ViT-B/16 layout, each a small random model of the same patch size and input size."""
    import timm
    import transformers
    from timm.models._hub import save_for_hf

    from test_hub import put_repo

    timm_model = timm.create_model("vit_tiny_patch16_224", **HUB_TINY)
    folder = cache.parent / "timm_export"
    save_for_hf(timm_model, str(folder), model_args=HUB_TINY, safe_serialization=True)
    put_repo(cache, "timm/vit_tiny_patch16_224.augreg_in21k", folder, HUB_COMMIT)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=128, image_size=224, patch_size=16, num_labels=5)  # fmt: skip
    folder = cache.parent / "hf_export"
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(folder)
    put_repo(cache, "google/vit-base-patch16-224-in21k", folder, HUB_COMMIT)
    return cache
