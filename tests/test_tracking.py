"""Experiment tracking: what a short run leaves in TensorBoard, the CSV and an offline wandb run, read
back with each tool's own reader (and from the server `make dashboard` starts), and that all of it
stays inside the run folder; the validation figures, their images and the weights they are drawn
from; the throughput meter's FLOPs.

The wandb runs go through a subprocess, as `vitlab fit` does: Lightning's WandbLogger attaches to a
wandb run already open in the process, so two in-process fits would share one wandb run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from cli_probe import csv_rows, run_cli
from helpers import image_tree
from vitlab.cli import main
from vitlab.data import ImageFolderDataModule
from vitlab.models import create_model
from vitlab.train import EMA, ViTClassifier, flops_per_image
from vitlab.train.run import figures as figures_module
from vitlab.train.run.figures import ValidationFigures, last_layer_attention
from vitlab.train.run.loggers import WANDB_ID_KEY

REPO = Path(__file__).resolve().parents[1]
TINY = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}
# Throughput under the names Lightning's ThroughputMonitor writes (one device: the per-device rates).
THROUGHPUT = {"train/device/samples_per_sec", "train/device/flops_per_sec"}
SCALARS = {"train/loss", "val/acc1", "val/loss", "lr", "train/samples_seen", "perf/epoch_time_s",
           "perf/peak_mem_mb"} | THROUGHPUT  # fmt: skip
IMAGES = {"val/predictions", "val/attention", "val/confusion_matrix"}
# TensorBoard keeps loss and accuracy under their names and shows every other scalar under `vitals/`.
HEADLINE = {"train/loss", "train/acc1", "val/loss", "val/acc1"}
TB_SCALARS = HEADLINE | {f"vitals/{key}" for key in SCALARS - HEADLINE}
CALLBACKS = [
    {"class_path": "vitlab.train.PerfMonitor", "init_args": {"window": 2}},  # 3 steps an epoch
    {"class_path": "vitlab.train.run.figures.ValidationFigures", "init_args": {"num_images": 6}},
    {"class_path": "vitlab.train.run.figures.FinetuneSource"},
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
    """{dir, id, history keys, config keys, summary keys, exited} of each offline wandb run under run_dir/wandb."""
    out = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (file,) = folder.glob("run-*.wandb")
        history, config, summary, run_id, exited = set(), set(), set(), None, False
        for r in wandb_records(file):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
            elif kind == "history":
                history |= {_top_key(i) for i in r.history.item}
            elif kind == "config":
                config |= {_top_key(i) for i in r.config.update}
            elif kind == "summary":
                summary |= {_top_key(i) for i in r.summary.update}
            elif kind == "exit":
                exited = True
        out.append({"dir": folder, "id": run_id, "history": history, "config": config, "summary": summary,
                    "exited": exited})  # fmt: skip
    return out


# ---- one tracked run (and its resumption) -----------------------------------------------------------


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tracked")
    data = image_tree(tmp / "data", ["airplane", "frog", "truck"], 16, 6)
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
    # A second run beside it, for the dashboard's one row per run.
    other = tmp / "other"
    rc, out3, _, _ = run_cli(["fit", "--config", str(recipe), "--run_dir", str(other), "--model.lr", "5e-4"], cwd,
                             timeout=180)  # fmt: skip
    assert rc == 0, out3[-4000:]
    return {"tmp": tmp, "data": data, "run": run, "other": other, "cwd": cwd, "first": first, "ckpt_id": ckpt_id,
            "first_top": first_top, "out": out, "recipe": recipe}  # fmt: skip


def test_tensorboard_holds_scalars_and_figures(tracked: dict[str, Any]) -> None:
    acc = tensorboard_events(tracked["run"])
    tags = acc.Tags()
    assert TB_SCALARS <= set(tags["scalars"]), TB_SCALARS - set(tags["scalars"])
    assert IMAGES <= set(tags["images"]), IMAGES - set(tags["images"])
    assert not {"epoch", "lr"} & set(tags["scalars"])  # no epoch staircase; the learning rate is vitals/lr
    assert "hp_metric" not in tags["scalars"]  # no -1 placeholder in the dashboard
    assert "val/acc5" not in tags["scalars"]  # 3 classes: top-5 would always be 100%
    assert "vitals/train/device/mfu" not in tags["scalars"]  # a CPU has no known peak FLOPs
    for tag in IMAGES:
        img = acc.Images(tag)[-1]
        assert img.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" and img.width >= 200 and img.height >= 200
    # Figures after every validation epoch (2 after the resume), the confusion matrix at each fit's end.
    assert len(acc.Images("val/predictions")) == 2
    steps = [e.step for e in acc.Scalars("val/acc1")]
    assert len(steps) == 2 and steps[0] < steps[1]


def test_csv_has_the_metric_columns(tracked: dict[str, Any]) -> None:
    rows = csv_rows(tracked["run"])
    columns = SCALARS | {"epoch"}  # Lightning's names and its epoch column: the TensorBoard layout is not here
    assert columns <= set(rows[0]), columns - set(rows[0])
    assert [float(r["val/acc1"]) for r in rows if r.get("val/acc1")]
    # FLOPs/s is FLOPs per image times images/s: both from the same window of batches
    (flops,) = {flops_per_image(create_model("vit_tiny_patch16", **TINY, img_size=32, num_classes=3))["train"]}
    rates = [(float(r["train/device/samples_per_sec"]), float(r["train/device/flops_per_sec"]))
             for r in rows if r.get("train/device/flops_per_sec")]  # fmt: skip
    assert rates and all(f == pytest.approx(flops * n, rel=1e-6) and n > 0 for n, f in rates)


# ---- make dashboard ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _compare_tags(a: str, b: str) -> int:
    """TensorBoard's `compareTagNames` (webapp/metrics/utils.ts), numbers read as digit runs (it also
    reads decimals and exponents; the tags here have none): digit runs compare as numbers, `/` and
    digits sort before every other character, other characters by code point, a prefix first."""
    digits, i, j = "0123456789", 0, 0
    while i < len(a) and j < len(b):
        if a[i] in digits and b[j] in digits:
            m, n = i, j
            while m < len(a) and a[m] in digits:
                m += 1
            while n < len(b) and b[n] in digits:
                n += 1
            if int(a[i:m]) != int(b[j:n]):
                return -1 if int(a[i:m]) < int(b[j:n]) else 1
            i, j = m, n
            continue
        a_break, b_break = a[i] in "/" + digits, b[j] in "/" + digits
        if a_break != b_break:
            return -1 if a_break else 1
        if not a_break and a[i] != b[j]:
            return -1 if a[i] < b[j] else 1
        i, j = i + 1, j + 1
    return (i < len(a)) - (j < len(b))


def time_series_groups(tags: list[str]) -> dict[str, list[str]]:
    """The card groups of TensorBoard's Time Series tab, in the order shown (`groupCardIdWithMetdata`):
    the cards sorted by tag, grouped by the tag's first segment. On first load the tab expands the first
    two groups and collapses the rest (metrics_reducers.ts: `cardGroups.slice(0, 2)`)."""
    from functools import cmp_to_key

    groups: dict[str, list[str]] = {}
    for tag in sorted(tags, key=cmp_to_key(_compare_tags)):
        groups.setdefault(tag.split("/", 1)[0], []).append(tag)
    return groups


def test_time_series_order_follows_tensorboard() -> None:
    """The port of TensorBoard's order on its own documented cases (a10b after a2b; a/a before a+/a)."""
    assert _compare_tags("a2b", "a10b") == -1 and _compare_tags("a/a", "a+/a") == -1
    groups = time_series_groups(["vitals/lr", "val/acc5", "train/loss", "val/acc10", "validate/time", "epoch"])
    assert list(groups) == ["epoch", "train", "val", "validate", "vitals"]
    assert groups["val"] == ["val/acc5", "val/acc10"]


def _get_json(url: str, deadline: float, post: Any = None) -> Any:
    data = None if post is None else json.dumps(post).encode()
    while True:
        try:
            request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_make_dashboard_serves_the_run(tracked: dict[str, Any]) -> None:
    """`make dashboard` on a free port: TensorBoard's HTTP data API answers with the run's scalar and
    image tags and values, and the tab it opens on (Time Series) expands the train and val groups,
    which hold loss, accuracy and the validation figures; the server is stopped at the end."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    venv = Path(sys.executable).parent.parent
    log = tracked["tmp"] / "dashboard.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            ["make", "--no-print-directory", "dashboard", f"VENV={venv}", f"PORT={port}", f"LOGDIR={tracked['tmp']}"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}/data/plugin"
    try:
        scalars = _get_json(f"{base}/scalars/tags", time.monotonic() + 120)
        images = _get_json(f"{base}/images/tags", time.monotonic() + 30)
        query = urllib.parse.urlencode({"run": "run", "tag": "val/acc1"})
        acc1 = _get_json(f"{base}/scalars/scalars?{query}", time.monotonic() + 30)
        plugins = _get_json(f"http://127.0.0.1:{port}/data/plugins_listing", time.monotonic() + 30)
        cards = _get_json(f"{base}/timeseries/tags", time.monotonic() + 30)
        groups_request = {"experimentName": "", "allowedStatuses": ["STATUS_SUCCESS", "STATUS_UNKNOWN"],
                          "colParams": [], "startIndex": 0, "sliceSize": 100}  # fmt: skip
        sessions = _get_json(f"{base}/hparams/session_groups", time.monotonic() + 30, groups_request)
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the session we started: make and its TensorBoard
        server.wait(timeout=30)
    assert {"train/loss", "val/acc1", "vitals/lr", "vitals/train/device/samples_per_sec"} <= set(scalars["run"])
    assert IMAGES <= set(images["run"]), images
    assert len(acc1) == 2  # one validation before the resume, one after
    csv_acc1 = [float(r["val/acc1"]) for r in csv_rows(tracked["run"]) if r.get("val/acc1")]
    assert acc1[-1][2] == pytest.approx(csv_acc1[-1])  # [wall time, step, value]
    # The frontend opens on the first enabled dashboard; Time Series shows scalar and image cards.
    assert next(name for name, plugin in plugins.items() if plugin["enabled"]) == "timeseries"
    groups = time_series_groups([*cards["scalars"]["runTagInfo"]["run"], *cards["images"]["tagRunSampledInfo"]])
    first, second, *collapsed = groups.items()
    assert first == ("train", ["train/acc1", "train/acc1_epoch", "train/loss", "train/loss_epoch"])
    assert second == ("val", ["val/acc1", "val/acc1_best", "val/attention", "val/confusion_matrix", "val/loss",
                              "val/predictions"])  # fmt: skip
    assert [name for name, _ in collapsed] == ["vitals"] and "vitals/lr" in groups["vitals"]
    # The HParams tab: one row per run, named by its run folder, its hyperparameters beside its metrics.
    rows = {group["name"]: group for group in sessions["sessionGroups"]}
    assert set(rows) == {"run", "other"}, rows.keys()
    run = rows["run"]
    assert run["hparams"] == {"recipe": str(tracked["recipe"]), "init_from": "scratch", "epochs": 2.0, "img_size": 32.0,
                              "size_schedule": "none", "lr": 1e-3, "batch_size": 16.0, "precision": "32-true"}  # fmt: skip
    assert rows["other"]["hparams"]["lr"] == 5e-4 and rows["other"]["hparams"]["epochs"] == 1.0
    metrics = {m["name"]["tag"]: m["value"] for m in run["metricValues"]}
    assert metrics["val/acc1"] == pytest.approx(csv_acc1[-1], abs=1e-6)
    assert metrics["val/acc1_best"] == pytest.approx(max(csv_acc1), abs=1e-6)
    # Minutes add up over the resume: both fits' training time, less than the test's whole wall time.
    assert 0 < metrics["vitals/minutes"] < 6


def test_offline_wandb_run_has_the_same_keys(tracked: dict[str, Any]) -> None:
    (first,) = tracked["first"]
    assert first["dir"].name.startswith("offline-run-") and first["exited"]
    assert SCALARS <= first["history"], SCALARS - first["history"]
    assert IMAGES <= first["history"], IMAGES - first["history"]
    assert {"lr", "arch", "model_args"} <= first["config"]
    assert {"recipe", "init_from", "epochs", "size_schedule", "batch_size", "precision"} <= first["config"]
    assert {"val/acc1_best", "minutes"} <= first["history"]
    assert first["id"] and tracked["ckpt_id"] == first["id"]


def test_resuming_continues_the_same_wandb_run(tracked: dict[str, Any]) -> None:
    runs = wandb_run(tracked["run"])
    assert len(runs) == 2  # one offline folder per process
    assert {r["id"] for r in runs} == {tracked["first"][0]["id"]}
    assert "val/acc1" in runs[1]["history"]


def test_everything_stays_in_the_run_folder(tracked: dict[str, Any]) -> None:
    assert not any(tracked["cwd"].iterdir()), list(tracked["cwd"].iterdir())
    expected = {"checkpoints", "config.yaml", "csv", "figures", "wandb"}
    assert expected <= tracked["first_top"], expected - tracked["first_top"]
    assert "lightning_logs" not in tracked["first_top"] and "wandb" not in {p.name for p in tracked["tmp"].iterdir()}
    # TensorBoard's events lie in the run folder itself (the dashboard names the run by it), alone.
    assert any(name.startswith("events.out.tfevents.") for name in tracked["first_top"])
    assert "hparams.yaml" not in tracked["first_top"]
    figures = {p.name for p in (tracked["run"] / "figures").iterdir()}
    assert figures == {"predictions.png", "attention.png", "confusion_matrix.png"}


def test_test_size_joins_the_run_row(tracked: dict[str, Any], tmp_path: Path) -> None:
    """What `vitlab resolution` adds (`log_test_size`) lands in the run's own TensorBoard run, beside the
    hparams record that declares it, and in the summary of the wandb run its checkpoint names."""
    run = tmp_path / "run"
    shutil.copytree(tracked["run"], run)
    before = {p.name for p in (run / "wandb").glob("offline-run-*")}
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "vitlab-test", "WANDB_SILENT": "true"}
    code = f"from vitlab.train.run.loggers import log_test_size; log_test_size({str(run)!r}, 40, 0.625, 7)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, **env})
    acc = tensorboard_events(run)
    assert [(e.step, e.value) for e in acc.Scalars("vitals/val/test_size")] == [(7, 40.0)]
    assert [e.value for e in acc.Scalars("vitals/val/test_size_acc1")] == [0.625]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
    (added,) = [r for r in wandb_run(run) if r["dir"].name not in before]
    assert added["id"] == tracked["ckpt_id"] and {"val/test_size", "val/test_size_acc1"} <= added["summary"]


def test_finetune_run_records_its_source(
    tracked: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = image_tree(tmp_path / "data", ["cat", "dog"], 8, 4)
    recipe = write_recipe(tmp_path / "ft.yaml", data, img_size=48)
    source = tracked["run"] / "checkpoints" / "last.ckpt"
    run, cwd = tmp_path / "run", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    main(["fit", "--config", str(recipe), "--run_dir", str(run), "--model.init_from", str(source)])
    acc = tensorboard_events(run)
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("finetune/source")]  # add_text appends a suffix
    text = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert str(source) in text and "4x4 -> 6x6" in text and "3 -> 2" in text
    hparams = yaml.safe_load((run / "csv" / "hparams.yaml").read_text())
    assert hparams["finetune/init_from"] == str(source)
    assert hparams["finetune/pos_embed_grid"] == "4x4 -> 6x6" and hparams["finetune/num_classes"] == "3 -> 2"
    assert not any(cwd.iterdir())


@pytest.mark.parametrize("pool", ["token", "avg", "seq"])
def test_last_layer_attention_reads_the_pooled_query(pool: str) -> None:
    """Class-token row for class-token models, the mean of the patch rows for GAP, and for sequence
    pooling the rows weighted by the learned pooling weights w = softmax_n(tokens_n . v + b)."""
    args = {"class_token": pool == "token", "pool": pool}
    model = create_model("vit_tiny_patch16", **TINY, **args, img_size=32, num_classes=3).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        for param in model.parameters():  # far from the near-uniform attention and pooling of the init
            param.normal_(0.0, 0.5)
        logits, heat = last_layer_attention(model, x)
        _, attn = model.forward_attention(x)
        tokens = model.forward_features(x)
    a = attn[-1].mean(dim=1)
    p = model.num_prefix_tokens
    if pool == "token":
        row = a[:, 0, p:]
    elif pool == "avg":
        row = a[:, p:, p:].mean(dim=1)
    else:
        scores = torch.einsum("bnd,d->bn", tokens, model.attn_pool.weight[0]) + model.attn_pool.bias
        w = scores.softmax(dim=1)
        row = torch.einsum("bn,bnm->bm", w, a)[:, p:]
        assert not torch.allclose(row, a[:, p:, p:].mean(dim=1), atol=1e-2)  # the weights matter here
    expected = row.reshape(2, 4, 4)
    torch.testing.assert_close(heat, expected)
    torch.testing.assert_close(logits, model(x))


# ---- the validation figures' images and weights --------------------------------------------------------


def _fit_with(root: Path, tmp_path: Path, callbacks: list[Callback], epochs: int = 1) -> ViTClassifier:
    L.seed_everything(0)
    dm = ImageFolderDataModule(root=str(root), img_size=32, batch_size=4, num_workers=0, train_crop="pad",
                               auto_augment=None)  # fmt: skip
    dm.setup("fit")
    module = ViTClassifier(arch="vit_tiny_patch16", model_args=TINY, num_classes=3, img_size=32, lr=5e-3,
                           schedule="constant")  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=callbacks)  # fmt: skip
    trainer.fit(module, datamodule=dm)
    return module


def test_figure_images_are_spread_over_the_classes(tmp_path: Path) -> None:
    """A class-sorted validation folder (6 images per class): the first image of each class, then the
    second of each; not the first 6 files, which are all one class."""
    root = image_tree(tmp_path / "data", ["airplane", "frog", "truck"], 4, 6)
    figures = ValidationFigures(num_images=6, save_png=False, confusion_matrix=False)
    _fit_with(root, tmp_path, [figures])
    dm = ImageFolderDataModule(root=str(root), img_size=32, batch_size=4, num_workers=0)
    dm.setup("fit")
    labels = [int(dm.val_dataset[i][1]) for i in range(18)]
    assert labels == [0] * 6 + [1] * 6 + [2] * 6  # the folder is class-sorted
    picks = [0, 6, 12, 1, 7, 13]  # first of airplane, frog, truck; then the second of each
    assert figures.targets.tolist() == [0, 1, 2, 0, 1, 2]
    torch.testing.assert_close(figures.images, torch.stack([dm.val_dataset[i][0] for i in picks]))


class HeadAtValidationEnd(Callback):
    """Records the head weights the module holds when its `on_validation_epoch_end` hook runs."""

    def __init__(self) -> None:
        self.heads: list[torch.Tensor] = []

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.heads.append(pl_module.model.head.weight.detach().clone())


def test_figures_are_drawn_from_the_validated_ema_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMA swaps its weights in for validation and back at the validation epoch's end; the figures
    callback sits after EMA (so EMA's swap-back runs first) and must still draw from the EMA weights."""
    root = image_tree(tmp_path / "data", ["airplane", "frog", "truck"], 8, 2)
    drawn: list[torch.Tensor] = []

    def spy(model: Any, x: torch.Tensor) -> Any:
        drawn.append(model.head.weight.detach().clone())
        return last_layer_attention(model, x)

    monkeypatch.setattr(figures_module, "last_layer_attention", spy)
    validated, raw = HeadAtValidationEnd(), HeadAtValidationEnd()  # before EMA's swap-back, after it
    figures = ValidationFigures(num_images=3, confusion_matrix=False)  # PNGs: the figures are drawn
    _fit_with(root, tmp_path, [validated, EMA(decay=0.9), figures, raw], epochs=2)
    assert len(drawn) == len(validated.heads) == len(raw.heads) == 2
    for figure_head, ema_head, raw_head in zip(drawn, validated.heads, raw.heads):
        assert not torch.allclose(ema_head, raw_head)  # the two sets of weights differ
        torch.testing.assert_close(figure_head, ema_head, rtol=0, atol=0)


# ---- FLOPs ------------------------------------------------------------------------------------------


def test_flops_per_image_match_the_formula() -> None:
    """A GAP ViT (every token through every block): forward FLOPs written out, 2 per multiply-add:
    patch projection, per block qkv + proj (4 D^2 per token), MLP (2 D H), attention scores and
    weighted sum (2 N^2 D), and the head; training is forward plus backward (twice the forward for
    every matrix product except the first layer's input gradient, which nothing needs)."""
    d, h, depth, patch, classes = 32, 64, 2, 8, 3
    model = create_model("vit_tiny_patch16", **{**TINY, "depth": depth}, img_size=32, num_classes=classes,
                         pool="avg", class_token=False)  # fmt: skip
    n = (32 // patch) ** 2
    embed = 2 * n * d * 3 * patch * patch
    block = 2 * n * (4 * d * d + 2 * d * h) + 2 * 2 * n * n * d
    head = 2 * d * classes
    forward = embed + depth * block + head
    flops = flops_per_image(model)
    assert flops["eval"] == forward
    assert flops["train"] == 3 * forward - embed  # no gradient for the input images

