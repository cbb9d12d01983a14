"""What a run tells its reader before training: every callback it runs (log and config.yaml) and the
model's FLOPs, against a count written out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from cli_probe import run_cli
from helpers import image_tree

pytestmark = pytest.mark.slow


def test_summary_counts_flops_and_the_record_lists_the_callbacks(tmp_path: Path) -> None:
    root = image_tree(tmp_path / "images", ["a", "b"], n_train=4, n_val=2)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 1, "limit_val_batches": 1, "enable_progress_bar": False},
        "model": {"arch": "vit_tiny_patch16",
                  "model_args": {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(root), "img_size": 32, "batch_size": 4, "num_workers": 0}},
    }))  # fmt: skip
    run = tmp_path / "run"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    code, output, _, _ = run_cli(["fit", "--config", str(recipe), "--run_dir", str(run), "--loggers=[csv]"], cwd, 300)
    assert code == 0, output

    # One image's forward pass, written out: the patch convolution; per block the qkv projection, the two
    # attention products, the output projection and the MLP; the last block computes its query, attention,
    # projection and MLP for the class token alone (keys and values for every token); the head.
    tokens, dim, hidden, cells, patch_in, classes = 17, 32, 64, 16, 3 * 8 * 8, 2
    block = (2 * tokens * dim * 3 * dim + 2 * 2 * tokens * tokens * dim + 2 * tokens * dim * dim
             + 2 * 2 * tokens * dim * hidden)
    last = 2 * tokens * dim * 3 * dim + 2 * 2 * tokens * dim + 2 * dim * dim + 2 * 2 * dim * hidden
    expected = 2 * cells * dim * patch_in + block + last + 2 * dim * classes
    assert f"Total FLOPs: {get_human_readable_count(expected)}" in output.replace("Total Flops", "Total FLOPs")

    first = (run / "config.yaml").read_text().splitlines()[0]
    assert first.startswith("# callbacks in this run: ")
    listed = first.removeprefix("# callbacks in this run: ").split(", ")
    for name in ("NonFiniteGuard", "LastCheckpoint", "ModelCheckpoint", "PerfMonitor", "ExactResume"):
        assert name in listed
    assert f"callbacks: {', '.join(listed)}" in output
