"""Experiment tracking: what a short run leaves in TensorBoard, the CSV and an offline wandb run, read
back with each tool's own reader, and that all of it stays inside the run folder.

The wandb runs go through a subprocess, as `vitlab fit` does: Lightning's WandbLogger attaches to a
wandb run already open in the process, so two in-process fits would share one wandb run.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from cli_probe import csv_rows, run_cli
from helpers import subset_tree
from vitlab.cli import main
from vitlab.models import create_model
from vitlab.train.figures import last_layer_attention
from vitlab.train.run import WANDB_ID_KEY

TINY = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}
SCALARS = {"train/loss", "val/acc1", "val/acc5", "val/loss", "lr", "train/images_per_sec",
           "train/samples_seen", "perf/epoch_time_s", "perf/peak_mem_mb"}  # fmt: skip
IMAGES = {"val/predictions", "val/attention", "val/confusion_matrix"}
CALLBACKS = [
    {"class_path": "vitlab.train.PerfMonitor"},
    {"class_path": "vitlab.train.figures.ValidationFigures", "init_args": {"num_images": 6, "sample": "spread"}},
    {"class_path": "vitlab.train.figures.FinetuneSource"},
]


def write_recipe(path: Path, root: Path, img_size: int = 32) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_epochs": 1, "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False, "callbacks": CALLBACKS},
        "model": {"arch": "vit_tiny_patch16", "model_args": TINY, "lr": 1e-3, "warmup_steps": 0},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(root), "img_size": img_size, "batch_size": 16, "num_workers": 0,
                               "train_crop": "pad", "auto_augment": None}},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---- readers ---------------------------------------------------------------------------------------


def tensorboard_events(folder: Path) -> Any:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0, ea.IMAGES: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a `.wandb` run file (wandb keeps no Python reader for it: the file is
    a LevelDB-style log of 32 KiB blocks, each record in FULL or FIRST/MIDDLE/LAST chunks behind a
    7-byte header: crc32 (4), length (2, little-endian), chunk type (1))."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, parts, records = 32768, 7, [], []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += room
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def _top_key(item: Any) -> str:
    # A media value (an image) arrives as nested keys [key, "_type"], [key, "filenames"], ...
    return item.key or item.nested_key[0]


def wandb_run(run_dir: Path) -> dict[str, Any]:
    """{dir, id, history keys, config keys, exited} of each offline wandb run under run_dir/wandb."""
    out = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (file,) = folder.glob("run-*.wandb")
        history, config, run_id, exited = set(), set(), None, False
        for r in wandb_records(file):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
            elif kind == "history":
                history |= {_top_key(i) for i in r.history.item}
            elif kind == "config":
                config |= {_top_key(i) for i in r.config.update}
            elif kind == "exit":
                exited = True
        out.append({"dir": folder, "id": run_id, "history": history, "config": config, "exited": exited})
    return out


# ---- one tracked run (and its resumption) -----------------------------------------------------------


@pytest.fixture(scope="module")
def tracked(cifar_subset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tracked")
    data = subset_tree(cifar_subset, tmp / "data", ["airplane", "frog", "truck"], 16, 6)
    recipe = write_recipe(tmp / "recipe.yaml", data)
    run, cwd = tmp / "run", tmp / "cwd"
    cwd.mkdir()
    args = ["fit", "--config", str(recipe), "--run_dir", str(run), "--loggers", "[tensorboard,csv,wandb]"]
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "vitlab-test"}
    rc, out, _, _ = run_cli(args, cwd, timeout=180, env=env)
    assert rc == 0, out[-4000:]
    first = wandb_run(run)
    ckpt_id = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)[WANDB_ID_KEY]
    first_top = {p.name for p in run.iterdir()}
    rc, out2, _, _ = run_cli([*args, "--ckpt_path", "last", "--trainer.max_epochs", "2"], cwd, timeout=180, env=env)
    assert rc == 0, out2[-4000:]
    return {"tmp": tmp, "data": data, "run": run, "cwd": cwd, "first": first, "ckpt_id": ckpt_id,
            "first_top": first_top, "out": out}  # fmt: skip


def test_tensorboard_holds_scalars_and_figures(tracked: dict[str, Any]) -> None:
    acc = tensorboard_events(tracked["run"] / "tensorboard")
    tags = acc.Tags()
    assert SCALARS <= set(tags["scalars"]), SCALARS - set(tags["scalars"])
    assert IMAGES <= set(tags["images"]), IMAGES - set(tags["images"])
    for tag in IMAGES:
        img = acc.Images(tag)[-1]
        assert img.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" and img.width >= 200 and img.height >= 200
    # Figures after every validation epoch (2 after the resume), the confusion matrix at each fit's end.
    assert len(acc.Images("val/predictions")) == 2
    steps = [e.step for e in acc.Scalars("val/acc1")]
    assert len(steps) == 2 and steps[0] < steps[1]


def test_csv_has_the_metric_columns(tracked: dict[str, Any]) -> None:
    rows = csv_rows(tracked["run"])
    assert SCALARS <= set(rows[0]), SCALARS - set(rows[0])
    assert [float(r["val/acc1"]) for r in rows if r.get("val/acc1")]


def test_offline_wandb_run_has_the_same_keys(tracked: dict[str, Any]) -> None:
    (first,) = tracked["first"]
    assert first["dir"].name.startswith("offline-run-") and first["exited"]
    assert SCALARS <= first["history"], SCALARS - first["history"]
    assert IMAGES <= first["history"], IMAGES - first["history"]
    assert {"lr", "arch", "model_args"} <= first["config"]
    assert first["id"] and tracked["ckpt_id"] == first["id"]


def test_resuming_continues_the_same_wandb_run(tracked: dict[str, Any]) -> None:
    runs = wandb_run(tracked["run"])
    assert len(runs) == 2  # one offline folder per process
    assert {r["id"] for r in runs} == {tracked["first"][0]["id"]}
    assert "val/acc1" in runs[1]["history"]


def test_everything_stays_in_the_run_folder(tracked: dict[str, Any]) -> None:
    assert not any(tracked["cwd"].iterdir()), list(tracked["cwd"].iterdir())
    expected = {"checkpoints", "config.yaml", "csv", "figures", "tensorboard", "wandb"}
    assert expected <= tracked["first_top"], expected - tracked["first_top"]
    assert "lightning_logs" not in tracked["first_top"] and "wandb" not in {p.name for p in tracked["tmp"].iterdir()}
    figures = {p.name for p in (tracked["run"] / "figures").iterdir()}
    assert figures == {"predictions.png", "attention.png", "confusion_matrix.png"}


def test_finetune_run_records_its_source(
    tracked: dict[str, Any], cifar_subset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = subset_tree(cifar_subset, tmp_path / "data", ["cat", "dog"], 8, 4)
    recipe = write_recipe(tmp_path / "ft.yaml", data, img_size=48)
    source = tracked["run"] / "checkpoints" / "last.ckpt"
    run, cwd = tmp_path / "run", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    main(["fit", "--config", str(recipe), "--run_dir", str(run), "--model.init_from", str(source)])
    acc = tensorboard_events(run / "tensorboard")
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("finetune/source")]  # add_text appends a suffix
    text = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert str(source) in text and "4x4 -> 6x6" in text and "3 -> 2" in text
    hparams = yaml.safe_load((run / "csv" / "hparams.yaml").read_text())
    assert hparams["finetune/init_from"] == str(source)
    assert hparams["finetune/pos_embed_grid"] == "4x4 -> 6x6" and hparams["finetune/num_classes"] == "3 -> 2"
    assert not any(cwd.iterdir())


@pytest.mark.parametrize("pool", ["token", "avg", "seq"])
def test_last_layer_attention_reads_the_pooled_query(pool: str) -> None:
    """Class-token row for class-token models, the mean of the patch rows for GAP / sequence pooling."""
    args = {"class_token": pool == "token", "pool": pool}
    model = create_model("vit_tiny_patch16", **TINY, **args, img_size=32, num_classes=3).eval()
    x = torch.randn(2, 3, 32, 32)
    logits, heat = last_layer_attention(model, x)
    _, attn = model.forward_attention(x)
    a = attn[-1].mean(dim=1)
    p = model.num_prefix_tokens
    row = a[:, 0, p:] if pool == "token" else a[:, p:, p:].mean(dim=1)
    expected = row.reshape(2, 4, 4)
    torch.testing.assert_close(heat, expected)
    torch.testing.assert_close(logits, model(x))
