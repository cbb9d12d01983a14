"""What a run tells its reader before training: every callback and plugin it runs (log and config.yaml),
the model's FLOPs, against a count written out by hand, and no library warning the user cannot act on."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from cli_probe import run_cli
from helpers import image_tree, shard_tree
from vitlab.train.run.quiet import KNOWN_HARMLESS, silence_known_warnings



@pytest.mark.slow
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
    assert f"FLOPs per image: {get_human_readable_count(expected)} forward" in output

    config = yaml.safe_load((run / "config.yaml").read_text())
    listed = [cb["class_path"].rpartition(".")[2] for cb in config["trainer"]["callbacks"]]
    for name in ("NonFiniteGuard", "LastCheckpoint", "BestCheckpoint", "PerfMonitor", "ExactResume"):
        assert name in listed
    assert [p["class_path"] for p in config["trainer"]["plugins"]] == [
        "vitlab.train.reliability.checkpoint_io.AtomicCheckpointIO"]
    assert "# callbacks" not in (run / "config.yaml").read_text()  # the list itself is the record
    logged = output.split("\ncallbacks: ", 1)[1].splitlines()[0].split(", ")  # the log line: all that ran
    assert set(listed) < set(logged) and "ValidationFigures" in logged  # ViTClassifier.configure_callbacks


def test_known_harmless_warnings_are_silenced_and_only_those() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_known_warnings()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`")
        warnings.warn("Your `IterableDataset` has `__len__` defined. In combination with multi-process ...")
        warnings.warn("The number of training batches (4) is smaller than the logging interval")
    assert [str(w.message) for w in caught] == ["The number of training batches (4) is smaller than the logging interval"]


@pytest.mark.slow
def test_a_shard_fit_prints_no_known_harmless_warning_but_a_real_one(tmp_path: Path) -> None:
    """A tiny fit on shards (an IterableDataset with __len__, torchdata's loader, Lightning's pytree helper)
    prints none of `KNOWN_HARMLESS`; Lightning's warning about a logging interval longer than the epoch,
    which a user can act on, is still printed."""
    shard_tree(tmp_path / "shards" / "train", ["a", "b"], 2, 8)
    shard_tree(tmp_path / "shards" / "val", ["a", "b"], 1, 8, seed=1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "trainer": {"max_epochs": 1, "limit_val_batches": 1, "enable_progress_bar": False, "log_every_n_steps": 50},
        "model": {"arch": "vit_tiny_patch16",
                  "model_args": {"patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}},
        "data": {"class_path": "vitlab.data.ShardDataModule",
                 "init_args": {"train_shards": str(tmp_path / "shards" / "train"),
                               "val_shards": str(tmp_path / "shards" / "val"), "img_size": 32, "batch_size": 4,
                               "num_workers": 0}},
    }))  # fmt: skip
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = ["fit", "--config", str(recipe), "--run_dir", str(tmp_path / "run"), "--loggers=[csv]"]
    code, output, _, _ = run_cli(args, cwd, 300)
    assert code == 0, output
    assert "is smaller than the logging interval" in output, output
    for pattern, _ in KNOWN_HARMLESS:
        assert not re.search(pattern, output), (pattern, output)
