"""`export`: each format's logits in its own runtime (transformers, timm, ONNX Runtime) equal vitlab's
(on generated images: the weights' mapping shows on any pixels), and transformers' processor prepares real
CIFAR images as vitlab does; the HF round trip keeps every tensor; options a format cannot express and a
missing ONNX install fail with a message that says what to do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoImageProcessor, ViTConfig, ViTForImageClassification

import vitlab
from helpers import perturb
from vitlab.cli import main
from vitlab.interop import ExportError, export

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
TINY = dict(img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=2, num_classes=10)
TOL = 1e-4


def _model(**kw: object) -> vitlab.VisionTransformer:
    model = vitlab.create_model("vit_tiny_patch16", **{**TINY, **kw}).eval()
    with torch.no_grad():  # a zero-mean head would give near-equal logits for every image
        model.head.weight.normal_(0.0, 0.5)
        model.head.bias.normal_(0.0, 0.5)
    model.data_config.update(class_names=CLASSES, crop_pct=1.0)
    return model


def _files(root: Path, per_class: int = 1) -> list[Path]:
    return [f for c in CLASSES for f in sorted((root / "val" / c).iterdir())[:per_class]]


def _prepared(files: list[Path]) -> torch.Tensor:
    """The images prepared by vitlab's own evaluation transform."""
    tf = vitlab.eval_transform({"img_size": [32, 32], "mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 1.0})
    return torch.stack([tf(Image.open(f)) for f in files])


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """One generated 32x32 validation image per class, prepared by vitlab's own evaluation transform."""
    from helpers import image_tree

    return _prepared(_files(image_tree(tmp_path_factory.mktemp("images"), CLASSES, 0, 1)))


def test_hf_export_runs_in_transformers(images, tmp_path):
    model = _model()
    out = export(model, "hf", tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    peer = ViTForImageClassification.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(peer(pixel_values=images).logits, model(images), atol=TOL, rtol=0)
    assert peer.config.id2label == dict(enumerate(CLASSES))
    assert (peer.config.image_size, peer.config.patch_size, peer.config.layer_norm_eps) == (32, 4, 1e-6)


def test_hf_processor_prepares_images_as_vitlab_does(tmp_path):
    # transformers' processor prepares images as vitlab's eval transform does (PIL resize 48 -> 32 on both sides)
    from helpers import image_tree

    out = export(_model(), "hf", tmp_path / "hf")
    processor = AutoImageProcessor.from_pretrained(out, use_fast=False)
    files = _files(image_tree(tmp_path / "images", CLASSES, 0, 1, size=48))
    pil = [Image.open(f).convert("RGB") for f in files]
    pixels = torch.as_tensor(np.stack(processor(pil)["pixel_values"]))
    torch.testing.assert_close(pixels, _prepared(files), atol=1e-5, rtol=0)


def test_hf_preprocessor_states_size_crop_and_resample(tmp_path):
    model = _model(img_size=48)
    model.data_config.update(crop_pct=0.875, interpolation="bilinear", mean=[0.4, 0.5, 0.6], std=[0.2, 0.3, 0.4])
    cfg = json.loads((export(model, "hf", tmp_path / "hf") / "preprocessor_config.json").read_text())
    # int(48 / 0.875) = 54: the short side before the 48x48 centre crop; PIL's code 2 is bilinear
    assert cfg["size"] == {"shortest_edge": 54} and cfg["crop_size"] == {"height": 48, "width": 48}
    assert (cfg["resample"], cfg["image_mean"], cfg["image_std"]) == (2, [0.4, 0.5, 0.6], [0.2, 0.3, 0.4])


def test_hf_round_trip_keeps_every_tensor(tmp_path):
    names = {0: "ant", 1: "bee", 2: "cow", 3: "dog"}
    cfg = ViTConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96, image_size=32,
                    patch_size=8, num_labels=4, layer_norm_eps=1e-12, id2label=names,
                    label2id={v: k for k, v in names.items()})  # fmt: skip
    torch.manual_seed(1)
    ViTForImageClassification(cfg).save_pretrained(tmp_path / "source")
    model = vitlab.load_pretrained(tmp_path / "source")
    out = export(model, "hf", tmp_path / "again")
    before, after = load_file(tmp_path / "source" / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    again = json.loads((out / "config.json").read_text())
    assert again["layer_norm_eps"] == 1e-12 and again["id2label"] == {"0": "ant", "1": "bee", "2": "cow", "3": "dog"}


@pytest.mark.parametrize("kw", [{}, {"pool": "avg", "class_token": False}, {"qkv_bias": False, "img_size": (32, 24)}])
def test_timm_export_runs_in_timm(images, tmp_path, kw):
    model = _model(**kw)
    x = images[..., : model.config["img_size"][1]]
    out = export(model, "timm", tmp_path / "timm")
    cfg = json.loads((out / "config.json").read_text())
    weights = str(out / "model.safetensors")
    by_folder = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    by_name = timm.create_model(
        cfg["architecture"], pretrained=True, pretrained_cfg_overlay=dict(cfg["pretrained_cfg"], file=weights),
        **cfg["model_args"],
    ).eval()
    with torch.no_grad():
        for peer in (by_folder, by_name):
            torch.testing.assert_close(peer(x), model(x), atol=TOL, rtol=0)
    with torch.no_grad():  # and back: vitlab reads its own timm export
        torch.testing.assert_close(vitlab.load_pretrained(out)(x), model(x), atol=TOL, rtol=0)
    pc = by_folder.pretrained_cfg
    assert tuple(pc["input_size"]) == (3, *model.config["img_size"])
    assert (pc["mean"], pc["std"], pc["crop_pct"], pc["interpolation"]) == ([0.5] * 3, [0.5] * 3, 1.0, "bicubic")
    assert pc["label_names"] == CLASSES


@pytest.mark.parametrize(
    ("arch", "kw", "timm_name"),
    [
        ("vit_tiny_r_s16_p8", {}, "vit_tiny_r_s16_p8_224"),  # the ResNet root alone, 8x8 projection
        ("vit_small_r26_s32", {}, "vit_small_r26_s32_224"),  # R26, 1x1 projection
        ("deit_tiny_distilled_patch16", {"patch_size": 8, "embed_dim": 192, "num_heads": 3},
         "deit_tiny_distilled_patch16_224"),
    ],
)  # fmt: skip
def test_timm_export_of_hybrids_and_distilled_models_runs_in_timm(images, tmp_path, arch, kw, timm_name):
    model = perturb(vitlab.create_model(arch, **{**TINY, "img_size": 64, "patch_size": 32, **kw}), std=0.05)
    model.data_config.update(class_names=CLASSES, crop_pct=1.0)
    x = torch.nn.functional.interpolate(images, size=(64, 64), mode="bilinear", align_corners=False)
    out = export(model, "timm", tmp_path / "timm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == timm_name
    peer = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(peer.forward_features(x), model.forward_features(x), atol=TOL, rtol=0)
        if model.distilled:  # timm's DeiT class averages the two heads' logits
            cls_logits, dist_logits = model.forward_distilled(x)
            torch.testing.assert_close(peer(x), (cls_logits + dist_logits) / 2, atol=TOL, rtol=0)
        else:
            torch.testing.assert_close(peer(x), model(x), atol=TOL, rtol=0)
        torch.testing.assert_close(vitlab.load_pretrained(out)(x), model(x), atol=TOL, rtol=0)  # and back


def test_hybrids_timm_does_not_register_are_refused(tmp_path):
    model = vitlab.create_model("vit_small_r26_s32", **{**TINY, "img_size": 64, "patch_size": 8}, stem_layers=[1])
    with pytest.raises(ExportError, match=r"(?s)timm format cannot express.*stages \[1\].*timm's hybrids have "
                                          r"root width 64.*export it as vitlab or onnx\b"):  # fmt: skip
        export(model, "timm", tmp_path / "out")
    with pytest.raises(ExportError, match=r"(?s)hf format cannot express.*stem='resnet'"):
        export(vitlab.create_model("vit_tiny_r_s16_p8", **{**TINY, "img_size": 64, "patch_size": 32}), "hf",
               tmp_path / "out")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_onnx_export_runs_in_onnxruntime(images, tmp_path):
    import onnx
    import onnxruntime as ort

    model = _model(pool="seq", class_token=False, stem="conv", lsa=True, pos_embed="sincos")  # ONNX takes them all
    out = export(model, "onnx", tmp_path / "onnx")
    cfg = json.loads((out / "config.json").read_text())
    graph = onnx.load(out / "model.onnx")
    assert cfg["opset"] == 18 and {o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")} == {18}
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].name == cfg["input"]["name"] == "pixel_values"
    with torch.no_grad():
        for batch in (images, images[:1], images[:7]):  # the batch axis is dynamic
            logits = session.run(None, {"pixel_values": batch.numpy()})[0]
            torch.testing.assert_close(torch.from_numpy(logits), model(batch), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("kw", "fmt", "option", "formats"),
    [
        ({"stem": "conv"}, "hf", "stem='conv'", "vitlab or onnx"),
        ({"pool": "seq", "class_token": False}, "timm", "pool='seq'", "vitlab or onnx"),
        ({"lsa": True}, "timm", "lsa=True", "vitlab or onnx"),
        ({"pos_embed": "sincos"}, "hf", "pos_embed='sincos'", "vitlab or onnx"),
        ({"pool": "avg"}, "hf", "pool='avg'", "vitlab or timm or onnx"),
        ({"norm_eps": 1e-12}, "timm", "norm_eps=1e-12", "vitlab or hf or onnx"),
    ],
)
def test_options_a_format_cannot_express_are_refused(tmp_path, kw, fmt, option, formats):
    with pytest.raises(ExportError, match=rf"(?s){fmt} format cannot express.*{option}.*export it as {formats}\b"):
        export(_model(**kw), fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_missing_onnx_packages_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # `import onnxscript` now raises ImportError
    with pytest.raises(ExportError, match=r"needs onnxscript, which is not installed.*pip install 'vitlab\[onnx\]'"):
        export(_model(), "onnx", tmp_path / "onnx")


def test_export_command_writes_each_format(images, tmp_path, capsys):
    model = _model()
    vitlab.save_pretrained(model, tmp_path / "src")
    assert main(["export", "--ckpt", str(tmp_path / "src"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "hf")
    peer = ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(peer(pixel_values=images).logits, model(images), atol=TOL, rtol=0)
