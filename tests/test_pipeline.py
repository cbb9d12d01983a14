"""The two stages end to end through the real CLI: pretrain on real images, then fine-tune from the
checkpoint at twice the resolution on a task with a different number of classes."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml

from vitlab import load_pretrained, resample_pos_embed
from vitlab.cli import VitlabCLI, main

pytestmark = pytest.mark.slow

TINY = {"patch_size": 4, "depth": 2, "embed_dim": 64, "num_heads": 2, "stem": "conv", "pool": "seq",
        "class_token": False, "mlp_ratio": 2}  # fmt: skip


def subset_tree(src: Path, dst: Path, classes: list[str], n_train: int, n_val: int) -> Path:
    """A small ImageFolder tree of symlinks into the shared CIFAR subset."""
    for split, n in (("train", n_train), ("val", n_val)):
        for c in classes:
            (dst / split / c).mkdir(parents=True)
            for f in sorted((src / split / c).iterdir())[:n]:
                (dst / split / c / f.name).symlink_to(f)
    return dst


def recipe(path: Path, root: Path, img_size: int, epochs: int, **model: object) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_epochs": epochs, "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False, "gradient_clip_val": 1.0, "deterministic": True},
        "model": {"arch": "vit_tiny_patch16", "model_args": TINY, "lr": 2e-3, "warmup_steps": 0.1,
                  "label_smoothing": 0.1, **model},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(root), "img_size": img_size, "batch_size": 32, "num_workers": 0,
                               "train_crop": "pad", "auto_augment": None}},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


def metrics(run: Path) -> list[dict[str, str]]:
    with open(run / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


def test_pretrain_then_finetune_at_twice_the_resolution(cifar_subset: Path, tmp_path: Path) -> None:
    pre_data = subset_tree(cifar_subset, tmp_path / "pre", ["airplane", "automobile", "bird", "cat"], 40, 10)
    ft_data = subset_tree(cifar_subset, tmp_path / "ft", ["deer", "frog", "ship"], 30, 10)

    pre_run = tmp_path / "runs" / "pretrain"
    main(["fit", "--config", str(recipe(tmp_path / "pre.yaml", pre_data, 32, 1)), "--run_dir", str(pre_run)])
    pre_ckpt = pre_run / "checkpoints" / "last.ckpt"
    assert (pre_run / "config.yaml").is_file() and pre_ckpt.is_file()
    pretrained = load_pretrained(pre_ckpt)
    assert pretrained.patch_embed.grid_size == (8, 8) and pretrained.num_classes == 4
    assert pretrained.data_config["class_names"] == ["airplane", "automobile", "bird", "cat"]

    ft_recipe = recipe(tmp_path / "ft.yaml", ft_data, 64, 1, optimizer="sgd", lr=0.01)
    ft_run = tmp_path / "runs" / "finetune"
    args = ["--config", str(ft_recipe), "--run_dir", str(ft_run), "--model.init_from", str(pre_ckpt)]

    # Right after initialisation, before any step: resampled grid, zero head for the new classes.
    cli = VitlabCLI(args=args, run=False)
    model = cli.model.model
    assert model.patch_embed.grid_size == (16, 16) and model.num_classes == 3
    expected = resample_pos_embed(pretrained.pos_embed, (16, 16), num_prefix_tokens=0)
    torch.testing.assert_close(model.pos_embed.detach(), expected)
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.head.bias) == 0
    for name, p in pretrained.blocks.state_dict().items():
        torch.testing.assert_close(model.blocks.state_dict()[name], p)

    main(["fit", *args])
    rows = metrics(ft_run)
    assert column(rows, "val/acc1") and column(rows, "val/loss")
    tuned = load_pretrained(ft_run / "checkpoints" / "last.ckpt")
    assert tuned.patch_embed.grid_size == (16, 16) and tuned.num_classes == 3
    assert tuned.data_config["class_names"] == ["deer", "frog", "ship"]
    assert tuned.data_config["img_size"] == [64, 64]


def test_short_run_learns_real_images(cifar_subset: Path, tmp_path: Path) -> None:
    data = subset_tree(cifar_subset, tmp_path / "data", ["airplane", "frog", "truck"], 150, 40)
    run = tmp_path / "run"
    main(["fit", "--config", str(recipe(tmp_path / "r.yaml", data, 32, 6)), "--run_dir", str(run)])
    rows = metrics(run)
    losses = column(rows, "train/loss_epoch")
    assert losses[-1] < 0.85 * losses[0], losses
    acc = column(rows, "val/acc1")
    assert max(acc) > 0.55, acc  # chance is 1/3


def test_explicit_num_classes_must_match_the_data(cifar_subset: Path, tmp_path: Path) -> None:
    data = subset_tree(cifar_subset, tmp_path / "data", ["cat", "dog"], 4, 2)
    r = recipe(tmp_path / "r.yaml", data, 32, 1)
    with pytest.raises(ValueError, match="num_classes"):
        main(["fit", "--config", str(r), "--run_dir", str(tmp_path / "run"), "--data.num_classes", "5"])
