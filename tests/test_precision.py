"""bf16 mixed precision on the CPU through the real command line: pretrain a few steps on real images,
then fine-tune from that checkpoint at a new resolution with a new head."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from cli_probe import csv_rows
from helpers import subset_tree
from vitlab.cli import main

pytestmark = pytest.mark.slow

TINY = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}
BF16 = ["--trainer.precision=bf16-mixed", "--trainer.accelerator=cpu", "--loggers=[csv]"]


def _recipe(path: Path, root: Path, img_size: int) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_steps": 3, "log_every_n_steps": 1, "limit_val_batches": 2, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "model": {"arch": "vit_tiny_patch16", "model_args": TINY, "lr": 1e-3},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(root), "img_size": img_size, "batch_size": 4, "num_workers": 0,
                               "train_crop": "pad", "auto_augment": None}},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(run: Path) -> list[float]:
    return [float(r["train/loss"]) for r in csv_rows(run) if r.get("train/loss")]


def test_bf16_mixed_pretrain_then_finetune(cifar_subset: Path, tmp_path: Path) -> None:
    pre_data = subset_tree(cifar_subset, tmp_path / "pre_data", ["airplane", "frog", "truck"], 8, 4)
    ft_data = subset_tree(cifar_subset, tmp_path / "ft_data", ["cat", "dog"], 8, 4)
    pre, ft = tmp_path / "pre", tmp_path / "ft"
    pretrain = ["fit", "--config", str(_recipe(tmp_path / "pre.yaml", pre_data, 32)), "--run_dir", str(pre), *BF16]
    assert main(pretrain) == 0
    source = pre / "checkpoints" / "last.ckpt"
    args = ["fit", "--config", str(_recipe(tmp_path / "ft.yaml", ft_data, 48)), "--run_dir", str(ft),
            "--model.init_from", str(source), *BF16]  # fmt: skip
    assert main(args) == 0

    for run in (pre, ft):
        assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["precision"] == "bf16-mixed"
        losses = _losses(run)
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses
    tuned = torch.load(ft / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert tuned["model.head.weight"].shape == (2, 32)  # the new head, trained in bf16 autocast
    assert tuned["model.head.weight"].dtype == torch.float32  # mixed precision keeps float32 weights
    assert tuned["model.pos_embed"].shape == (1, 1 + 6 * 6, 32)  # 4x4 grid at 32 px -> 6x6 at 48 px
    assert tuned["model.head.weight"].abs().sum() > 0  # it moved from its zero init
