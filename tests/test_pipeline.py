"""The two stages end to end through the real CLI: pretrain, then fine-tune from the checkpoint at twice
the resolution on a task with a different number of classes. Generated images (the mechanics hold for any
pixels), except the check that a short run learns real photos (../shared)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torchvision
import yaml

import vitlab

from vitlab import load_pretrained, resample_pos_embed
from vitlab.cli import VitlabCLI, main
from helpers import image_tree, subset_tree

pytestmark = pytest.mark.slow

TINY = {"patch_size": 4, "depth": 2, "embed_dim": 64, "num_heads": 2, "stem": "conv", "pool": "seq",
        "class_token": False, "mlp_ratio": 2}  # fmt: skip


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


def test_pretrain_then_finetune_at_twice_the_resolution(tmp_path: Path) -> None:
    pre_data = image_tree(tmp_path / "pre", ["airplane", "automobile", "bird", "cat"], 40, 10)
    ft_data = image_tree(tmp_path / "ft", ["deer", "frog", "ship"], 30, 10, seed=1)

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


def test_explicit_num_classes_must_match_the_data(tmp_path: Path) -> None:
    data = image_tree(tmp_path / "data", ["cat", "dog"], 4, 2)
    r = recipe(tmp_path / "r.yaml", data, 32, 1)
    with pytest.raises(ValueError, match="num_classes"):
        main(["fit", "--config", str(r), "--run_dir", str(tmp_path / "run"), "--data.num_classes", "5"])


def test_bad_fine_tune_sources_and_sizes_are_named(tmp_path: Path) -> None:
    data = image_tree(tmp_path / "data", ["cat", "dog"], 4, 2)
    src = tmp_path / "src"
    vitlab.save_pretrained(vitlab.create_model("vit_tiny_patch16", img_size=32, num_classes=4, **TINY), src)

    def finetune(img_size: int, init_from: Path, **model: object) -> None:
        r = recipe(tmp_path / "ft.yaml", data, img_size, 1, **model)
        main(["fit", "--config", str(r), "--run_dir", str(tmp_path / "run"), "--model.init_from", str(init_from)])

    with pytest.raises(ValueError, match=r"img_size 70x70 is not a multiple of patch_size 4; use e.g. 68x68 or 72x72"):
        finetune(70, src)
    deeper = {**TINY, "depth": 3}
    with pytest.raises(ValueError, match=r"(?s)do not fit the ViT built from it.*missing: blocks.2.norm1.weight"):
        finetune(64, src, model_args=deeper)
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), tmp_path / "resnet.pth")
    with pytest.raises(ValueError, match=r"conv1\.weight|not a ViT|no ViT"):
        finetune(64, tmp_path / "resnet.pth")


def test_missing_data_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"DATA path '.*nowhere' does not exist; give an image folder"):
        r = recipe(tmp_path / "r.yaml", tmp_path, 32, 1)
        main(["fit", "--config", str(r), "--data_path", str(tmp_path / "nowhere")])
