"""A checkpoint that knows its test size: recorded atomically by `vitlab resolution` (loads weights-only
after), used by default by `load_pretrained`, predict and every export format (against timm's
`resolve_data_config(use_test_size=True)`, transformers and ONNX Runtime), the trained size kept."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import timm
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image
from timm.layers import resample_abs_pos_embed
from torch.utils.data import DataLoader, TensorDataset

from vitlab.analysis.resolution import Row, choose_test_size, record_choice, run_limit
from vitlab.interop import EvalSize, export, load_pretrained, recorded_test_size
from vitlab.interop.eval_size import record_test_size
from vitlab.train import ViTClassifier

TRAINED, TEST, CROP = 32, 48, 0.875


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A tiny classifier trained one step at 32px (crop 0.875 in its data_config): its `last.ckpt`."""
    L.seed_everything(0)
    module = ViTClassifier(model_args=dict(img_size=TRAINED, patch_size=8, embed_dim=32, depth=2, num_heads=2),
                           num_classes=4, data_config={"crop_pct": CROP, "class_names": list("abcd")})  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, TRAINED, TRAINED, generator=g), torch.randint(4, (8,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)])  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=8))
    return tmp_path / "checkpoints" / "last.ckpt"


def _recorded(ckpt: Path) -> Path:
    record_test_size(ckpt, EvalSize((TEST, TEST), CROP), split="validation", acc1=0.5)
    return ckpt


def test_recording_is_atomic_loads_weights_only_and_keeps_the_weights(ckpt: Path, monkeypatch) -> None:
    before = torch.load(ckpt, weights_only=True)
    assert recorded_test_size(ckpt) is None  # a checkpoint from before: nothing recorded

    # A failure while writing leaves the checkpoint as it was, and no temporary file.
    original, files = ckpt.read_bytes(), sorted(os.listdir(ckpt.parent))
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        record_test_size(ckpt, EvalSize((TEST, TEST), CROP))
    assert ckpt.read_bytes() == original and sorted(os.listdir(ckpt.parent)) == files
    monkeypatch.undo()

    _recorded(ckpt)
    after = torch.load(ckpt, weights_only=True)
    assert recorded_test_size(ckpt) == EvalSize((TEST, TEST), CROP)
    assert after["vitlab"]["test_size"] == {"img_size": [TEST, TEST], "crop_pct": CROP, "split": "validation",
                                            "acc1": 0.5}  # fmt: skip
    assert after["vitlab"]["data_config"]["img_size"] == [TRAINED, TRAINED]  # the trained size stays
    assert after["state_dict"].keys() == before["state_dict"].keys()
    assert all(torch.equal(after["state_dict"][k], v) for k, v in before["state_dict"].items())
    assert sorted(os.listdir(ckpt.parent)) == files

    torch.save({"state_dict": {}}, ckpt.parent / "other.ckpt")
    with pytest.raises(ValueError, match="not a checkpoint written by `vitlab fit`"):
        record_test_size(ckpt.parent / "other.ckpt", EvalSize((TEST, TEST), CROP))


def test_load_pretrained_uses_the_recorded_size_says_so_and_keeps_the_trained_one(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trained = load_pretrained(ckpt)  # nothing recorded: as before
    assert trained.data_config["img_size"] == [TRAINED, TRAINED] and "train_img_size" not in trained.data_config
    _recorded(ckpt)
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        model = load_pretrained(ckpt)
    lines = [r.getMessage() for r in caplog.records if "recorded test size" in r.getMessage()]
    assert len(lines) == 1 and f"{TEST}x{TEST}, crop {CROP}" in lines[0] and f"trained at {TRAINED}x{TRAINED}" in lines[0]
    d = model.data_config
    assert (d["img_size"], d["crop_pct"]) == ([TEST, TEST], CROP)
    assert (d["train_img_size"], d["train_crop_pct"]) == ([TRAINED, TRAINED], CROP)
    assert model.patch_embed.grid_size == (TEST // 8, TEST // 8)
    # The position embeddings as timm resamples them (its rule: bicubic, antialias).
    want = resample_abs_pos_embed(trained.pos_embed, [6, 6], [4, 4], num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed, want, atol=1e-6, rtol=0)
    as_trained = load_pretrained(ckpt, use_test_size=False)
    assert as_trained.data_config["img_size"] == [TRAINED, TRAINED] and torch.equal(as_trained.pos_embed, trained.pos_embed)
    assert load_pretrained(ckpt, img_size=40).data_config["img_size"] == [40, 40]  # an explicit size wins


def _images(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(70, 90), (64, 64), (120, 50)]):
        paths.append(tmp_path / f"img{i}.png")
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def test_predict_prepares_images_as_timm_does_at_the_exported_test_size(ckpt: Path, tmp_path: Path) -> None:
    from timm.data import create_transform, resolve_data_config

    from vitlab.analysis.commands import load_model, preprocess

    out = export(_recorded(ckpt), "timm", tmp_path / "timm")
    peer = timm.create_model(f"local-dir:{out}", pretrained=True)
    cfg = resolve_data_config({}, model=peer, use_test_size=True)
    assert (cfg["input_size"], cfg["crop_pct"]) == ((3, TEST, TEST), CROP)
    theirs = create_transform(**cfg)
    files = _images(tmp_path)
    want = torch.stack([theirs(Image.open(f).convert("RGB")) for f in files])
    ours = preprocess(load_model(ckpt), files)
    assert ours.shape == (3, 3, TEST, TEST)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)


def test_the_recorded_size_round_trips_through_every_export_format(ckpt: Path, tmp_path: Path) -> None:
    import onnxruntime as ort
    from transformers import AutoImageProcessor, ViTForImageClassification

    _recorded(ckpt)
    at_test = load_pretrained(ckpt)
    x = torch.randn(2, 3, TEST, TEST)
    with torch.no_grad():
        want = at_test(x)

    def reloaded(folder: Path) -> None:  # vitlab reads the export back at the test size, the trained size kept
        again = load_pretrained(folder)
        d = again.data_config
        assert (d["img_size"], d["test_img_size"], d["train_img_size"]) == ([TEST] * 2, [TEST] * 2, [TRAINED] * 2)
        with torch.no_grad():
            torch.testing.assert_close(again(x), want, atol=1e-4, rtol=0)

    # vitlab: the trained weights, both sizes in config.json's data.
    folder = export(ckpt, "vitlab", tmp_path / "vitlab")
    data = json.loads((folder / "config.json").read_text())["data"]
    assert (data["img_size"], data["test_img_size"], data["test_crop_pct"]) == ([TRAINED] * 2, [TEST] * 2, CROP)
    reloaded(folder)

    # timm: input_size as trained, test_input_size / test_crop_pct beside it, as timm's own configs.
    folder = export(ckpt, "timm", tmp_path / "timm")
    pc = timm.create_model(f"local-dir:{folder}", pretrained=True).pretrained_cfg
    assert (tuple(pc["input_size"]), tuple(pc["test_input_size"]), pc["test_crop_pct"], pc["crop_pct"]) == (
        (3, TRAINED, TRAINED), (3, TEST, TEST), CROP, CROP)  # fmt: skip
    peer = timm.create_model(f"local-dir:{folder}", pretrained=True, img_size=TEST).eval()  # timm resamples on load
    with torch.no_grad():
        torch.testing.assert_close(peer(x), want, atol=1e-4, rtol=0)
    reloaded(folder)

    # hf: the model at the test size; the image processor's size is the test size.
    folder = export(ckpt, "hf", tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["image_size"] == TEST and config["vitlab_sizes"]["train_img_size"] == [TRAINED] * 2
    processor = AutoImageProcessor.from_pretrained(folder, use_fast=False)
    assert processor.crop_size == {"height": TEST, "width": TEST}
    assert processor.size == {"shortest_edge": int(TEST / CROP)}
    with torch.no_grad():
        torch.testing.assert_close(ViTForImageClassification.from_pretrained(folder)(pixel_values=x).logits, want,
                                   atol=1e-4, rtol=0)  # fmt: skip
    reloaded(folder)

    # onnx: the graph traced at the test size; config.json states both.
    folder = export(ckpt, "onnx", tmp_path / "onnx")
    config = json.loads((folder / "config.json").read_text())
    assert config["input"]["shape"] == ["batch", 3, TEST, TEST]
    assert (config["data"]["img_size"], config["data"]["train_img_size"]) == ([TEST] * 2, [TRAINED] * 2)
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    torch.testing.assert_close(torch.from_numpy(session.run(None, {"pixel_values": x.numpy()})[0]), want,
                               atol=1e-4, rtol=0)  # fmt: skip


def test_export_of_a_checkpoint_without_a_test_size_is_as_before(ckpt: Path, tmp_path: Path) -> None:
    pc = json.loads((export(ckpt, "timm", tmp_path / "timm") / "config.json").read_text())["pretrained_cfg"]
    assert "test_input_size" not in pc and pc["input_size"] == [3, TRAINED, TRAINED]
    config = json.loads((export(ckpt, "hf", tmp_path / "hf") / "config.json").read_text())
    assert config["image_size"] == TRAINED and "vitlab_sizes" not in config


def _row(size: int, acc1: float | None, patch: int = 8) -> Row:
    return Row("ft", "x.ckpt", "d", size, patch, 32, 8, acc1=acc1, loss=1.0, images=10, crop_pct=CROP)


def test_the_choice_is_the_best_validation_top1_at_the_own_patch_size(ckpt: Path) -> None:
    rows = [_row(24, 0.5), _row(32, 0.7), _row(40, 0.8), _row(48, 0.8), _row(56, None), _row(40, 0.99, patch=4)]
    assert choose_test_size(rows).img_size == 40  # the tie 40/48 goes to the size nearer the trained 32
    assert choose_test_size([_row(56, None)]) is None
    line = record_choice(rows, ckpt)
    assert line.startswith(f"recorded test size 40x40 (crop {CROP}) in {ckpt}: top-1 80.00% on 10 validation images")
    assert "70.00% at the trained 32" in line
    assert recorded_test_size(ckpt) == EvalSize((40, 40), CROP)
    assert torch.load(ckpt, weights_only=True)["vitlab"]["test_size"]["trained_acc1"] == 0.7


def test_the_runs_limit_val_batches_is_read_from_its_config(tmp_path: Path) -> None:
    assert run_limit(tmp_path) is None  # no config.yaml
    for value, want in (("2", 2), ("0.25", 0.25), ("1.0", None), ("null", None)):
        (tmp_path / "config.yaml").write_text(f"trainer:\n  max_epochs: 1\n  limit_val_batches: {value}\n")
        assert run_limit(tmp_path) == want, value


def test_predict_and_explain_say_in_one_line_that_they_use_the_recorded_size(
    ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from vitlab.cli import main

    image = _images(tmp_path)[0]
    _recorded(ckpt)
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        assert main(["predict", "--ckpt", str(ckpt), str(image)]) == 0
        assert main(["explain", "--ckpt", str(ckpt), "--image", str(image), "--out", str(tmp_path / "e.png")]) == 0
    said = [r.getMessage() for r in caplog.records if "recorded test size" in r.getMessage()]
    assert len(said) == 2 and all(f"{TEST}x{TEST}" in line and "\n" not in line for line in said)
