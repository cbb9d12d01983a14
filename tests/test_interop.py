"""save_pretrained / load_pretrained round trips, Lightning checkpoints, head swaps and the errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import timm
from helpers import perturb
from timm.models.vision_transformer import _load_weights
from vitlab.interop import CheckpointError, UnsafeCheckpointError, load_pretrained, save_pretrained
from vitlab.models.vit import VisionTransformer

SMALL = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=3)


def _model(**kw: Any) -> VisionTransformer:
    model = VisionTransformer(**{**SMALL, **kw})
    with torch.no_grad():  # non-zero biases, so a wrong mapping cannot hide behind zeros
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _assert_same(a: VisionTransformer, b: VisionTransformer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.config == b.config
    assert a.data_config == b.data_config


# ---- native round trips --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"pool": "avg", "class_token": False, "qkv_bias": False},
        {"representation_size": 16, "norm_eps": 1e-5},
        {"stem": "conv", "stem_channels": 16, "lsa": True, "pool": "seq"},
        {"stem": "spt", "pos_embed": "sincos", "img_size": (32, 16)},
    ],
)
def test_save_load_roundtrip_bit_exact(kw: dict[str, Any], tmp_path: Path) -> None:
    model = _model(**kw)
    model.data_config.update(class_names=["cat", "dog", "emu"], mean=[0.4, 0.5, 0.6], crop_pct=0.95)
    folder = save_pretrained(model, tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((folder / "config.json").read_text())["format"] == "vitlab"
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    for path in (folder, folder / "model.safetensors", str(folder)):
        loaded = load_pretrained(path)
        _assert_same(loaded, model)
        assert not loaded.training
        assert loaded.pos_embed.requires_grad == model.pos_embed.requires_grad
        with torch.no_grad():
            assert torch.equal(loaded(x), model(x))


def test_config_overrides_the_stored_one(tmp_path: Path) -> None:
    save_pretrained(_model(), tmp_path)
    model = load_pretrained(tmp_path, config={"drop_path_rate": 0.1, "attn_drop_rate": 0.05})
    assert model.config["drop_path_rate"] == 0.1 and model.blocks[1].drop_path1.p == 0.1
    with pytest.raises(TypeError, match="not_an_arg"):
        load_pretrained(tmp_path, config={"not_an_arg": 1})


def _lightning_ckpt(model: VisionTransformer, meta: bool = True, prefix: str = "model.") -> dict[str, Any]:
    sd = {f"{prefix}{k}": v for k, v in model.state_dict().items()}
    sd["criterion.weight"] = torch.ones(3)  # other module state is not the model's
    ckpt: dict[str, Any] = {
        "epoch": 4, "global_step": 120, "pytorch-lightning_version": "2.6.6", "state_dict": sd,
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]}],
        "hyper_parameters": {"lr": 1e-3, "model": "vit_tiny_patch16"},
    }  # fmt: skip
    if meta:
        ckpt["vitlab"] = {"model_config": model.config, "data_config": model.data_config}
    return ckpt


def test_lightning_checkpoint(tmp_path: Path) -> None:
    model = _model(embed_dim=32, num_heads=2, pool="avg")  # heads not inferable: the metadata says
    model.data_config["class_names"] = ["a", "b", "c"]
    torch.save(_lightning_ckpt(model), tmp_path / "last.ckpt")
    _assert_same(load_pretrained(tmp_path / "last.ckpt"), model)


def test_lightning_checkpoint_without_metadata_compiled(tmp_path: Path) -> None:
    model = _model(embed_dim=128, num_heads=2)  # 64 dims per head: inferable
    torch.save(_lightning_ckpt(model, meta=False, prefix="model._orig_mod."), tmp_path / "epoch=3.ckpt")
    loaded = load_pretrained(tmp_path / "epoch=3.ckpt")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded.config == model.config


def test_timm_training_checkpoint_with_argparse_namespace(tmp_path: Path) -> None:
    model = _model(embed_dim=128, num_heads=2)
    ckpt = {"epoch": 9, "arch": "vit", "state_dict": model.state_dict(), "args": argparse.Namespace(lr=0.1)}
    torch.save(ckpt, tmp_path / "checkpoint-9.pth.tar")
    loaded = load_pretrained(tmp_path / "checkpoint-9.pth.tar")
    assert torch.equal(loaded.head.weight, model.head.weight)


def test_num_classes_swaps_in_zero_head(tmp_path: Path) -> None:
    model = _model(representation_size=16)
    model.data_config["class_names"] = ["a", "b", "c"]
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, num_classes=7)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), torch.zeros(2, 7))
        assert torch.equal(loaded.forward_features(x), model.forward_features(x))
    assert loaded.config["num_classes"] == 7 and loaded.config["representation_size"] is None
    assert loaded.data_config["class_names"] is None
    rebuilt = VisionTransformer(**loaded.config)  # the config still describes the model
    rebuilt.load_state_dict(loaded.state_dict())


def test_img_size_change_updates_configs(tmp_path: Path) -> None:
    save_pretrained(_model(), tmp_path)
    loaded = load_pretrained(tmp_path, img_size=(48, 64))
    assert loaded.config["img_size"] == [48, 64] and loaded.data_config["img_size"] == [48, 64]
    assert loaded.pos_embed.shape == (1, 1 + 6 * 8, 64)
    assert loaded(torch.randn(1, 3, 48, 64)).shape == (1, 3)


def test_bfloat16_safetensors_and_non_square_grid(tmp_path: Path) -> None:
    model = _model(img_size=(32, 16), embed_dim=128, num_heads=2)
    sd = {k: v.bfloat16() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match="img_size"):
        load_pretrained(tmp_path / "w.safetensors")  # 8 grid tokens: not square, so it must be told
    loaded = load_pretrained(tmp_path / "w.safetensors", config={"img_size": (32, 16)})
    assert loaded.pos_embed.dtype == torch.float32
    assert torch.equal(loaded.pos_embed, sd["pos_embed"].float())


def test_timm_hub_folder_config(tmp_path: Path) -> None:
    model = _model(embed_dim=128, num_heads=2)
    save_file(dict(model.state_dict()), str(tmp_path / "model.safetensors"))
    pretrained_cfg = {"input_size": [3, 32, 32], "mean": [0.1, 0.2, 0.3], "std": [0.3, 0.2, 0.1],
                      "interpolation": "bilinear", "crop_pct": 0.875}  # fmt: skip
    sidecar = {"architecture": "vit_custom", "num_classes": 3, "label_names": ["x", "y", "z"],
               "pretrained_cfg": pretrained_cfg}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(sidecar))
    loaded = load_pretrained(tmp_path)
    assert loaded.data_config == {"img_size": [32, 32], "mean": [0.1, 0.2, 0.3], "std": [0.3, 0.2, 0.1],
                                  "interpolation": "bilinear", "crop_pct": 0.875, "class_names": ["x", "y", "z"]}  # fmt: skip


# ---- errors --------------------------------------------------------------------------------------


def test_mismatched_shape_names_tensor_and_shapes(tmp_path: Path) -> None:
    sd = dict(_model().state_dict())
    sd["blocks.1.mlp.fc1.weight"] = torch.randn(100, 64)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError) as info:
        load_pretrained(tmp_path / "bad.pth", config={"num_heads": 4})
    msg = str(info.value)
    assert "timm" in msg and "blocks.1.mlp.fc1.weight" in msg
    assert "(100, 64)" in msg and "(256, 64)" in msg
    assert isinstance(info.value, ValueError)


def test_missing_tensor_in_native_folder(tmp_path: Path) -> None:
    save_pretrained(_model(), tmp_path)
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["blocks.0.norm2.bias"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"(?s)vitlab checkpoint.*missing: blocks\.0\.norm2\.bias"):
        load_pretrained(tmp_path)


def test_hf_mismatch_names_source_tensor(tmp_path: Path) -> None:
    import transformers
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, num_labels=5)  # fmt: skip
    sd = dict(transformers.ViTForImageClassification(cfg).state_dict())
    sd["vit.layers.1.mlp.fc2.weight"] = torch.randn(64, 100)
    torch.save(sd, tmp_path / "hf.bin")
    expected = r"(?s)hf checkpoint.*blocks\.1\.mlp\.fc2\.weight \(from vit\.layers\.1\.mlp\.fc2\.weight\)"
    with pytest.raises(CheckpointError, match=expected):
        load_pretrained(tmp_path / "hf.bin", config={"num_heads": 4})
    del sd["vit.layers.0.attention.k_proj.bias"]
    torch.save(sd, tmp_path / "hf.bin")
    with pytest.raises(CheckpointError, match="incomplete"):
        load_pretrained(tmp_path / "hf.bin", config={"num_heads": 4})


def test_not_a_vit(tmp_path: Path) -> None:
    import torchvision
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), tmp_path / "resnet.pth")
    with pytest.raises(CheckpointError, match="not a ViT checkpoint"):
        load_pretrained(tmp_path / "resnet.pth")
    (tmp_path / "junk.bin").write_bytes(b"\x00not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a readable torch file"):
        load_pretrained(tmp_path / "junk.bin")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a state dict"):
        load_pretrained(tmp_path / "list.pt")


def test_unsupported_variant_and_gap_after_norm(tmp_path: Path) -> None:
    sd = dict(_model().state_dict())
    sd["blocks.0.ls1.gamma"] = torch.ones(64)  # layer scale: not in vitlab's block
    torch.save(sd, tmp_path / "ls.pth")
    with pytest.raises(CheckpointError, match=r"unexpected: blocks\.0\.ls1\.gamma"):
        load_pretrained(tmp_path / "ls.pth", config={"num_heads": 4})
    sd = {k: v for k, v in _model().state_dict().items() if k != "cls_token"}
    sd["pos_embed"] = sd["pos_embed"][:, 1:]
    torch.save(sd, tmp_path / "gap.pth")
    with pytest.raises(CheckpointError, match="GAP after norm"):
        load_pretrained(tmp_path / "gap.pth", config={"num_heads": 4})


def test_integer_tensor_rejected(tmp_path: Path) -> None:
    sd = dict(_model().state_dict())
    sd["norm.weight"] = torch.ones(64, dtype=torch.int32)
    torch.save(sd, tmp_path / "int.pth")
    with pytest.raises(CheckpointError, match=r"'norm.weight' has dtype torch.int32"):
        load_pretrained(tmp_path / "int.pth", config={"num_heads": 4})


class _Malicious:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))  # unpickling would create the marker file


def test_malicious_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = {"state_dict": _model().state_dict(), "payload": _Malicious(marker)}
    torch.save(ckpt, tmp_path / "evil.pth")
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError) as info:
        load_pretrained(tmp_path / "evil.pth")
    assert not marker.exists()
    msg = str(info.value)
    assert "tensors-only" in msg and "safetensors" in msg and "io.open" in msg
    assert isinstance(info.value, ValueError)


def _google_npz(model: timm.models.vision_transformer.VisionTransformer) -> dict[str, np.ndarray]:
    """A timm ViT's weights in the layout of Google's ViT .npz files, written from timm's parameter names
    as the inverse of each mapping in timm's `_load_weights` (flax kernels are [in, out], [kh, kw, in, out]
    for the patch conv, attention kernels [dim, heads, head_dim] and [heads, head_dim, dim])."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    dim, heads = model.embed_dim, model.blocks[0].attn.num_heads
    out = {
        "embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
        "embedding/bias": sd["patch_embed.proj.bias"],
        "cls": sd["cls_token"], "Transformer/posembed_input/pos_embedding": sd["pos_embed"],
        "Transformer/encoder_norm/scale": sd["norm.weight"], "Transformer/encoder_norm/bias": sd["norm.bias"],
        "head/kernel": sd["head.weight"].T, "head/bias": sd["head.bias"],
    }  # fmt: skip
    for i in range(len(model.blocks)):
        b, bp = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        mha = bp + "MultiHeadDotProductAttention_1/"
        q, k, v = np.split(sd[b + "attn.qkv.weight"], 3)  # [out, in] each
        for part, w, bias in zip(("query", "key", "value"), (q, k, v), np.split(sd[b + "attn.qkv.bias"], 3)):
            out[f"{mha}{part}/kernel"] = w.T.reshape(dim, heads, -1)
            out[f"{mha}{part}/bias"] = bias.reshape(heads, -1)
        out[f"{mha}out/kernel"] = sd[b + "attn.proj.weight"].reshape(dim, heads, -1).transpose(1, 2, 0)
        out[f"{mha}out/bias"] = sd[b + "attn.proj.bias"]
        for src, dst in (("LayerNorm_0", "norm1"), ("LayerNorm_2", "norm2")):
            out[f"{bp}{src}/scale"], out[f"{bp}{src}/bias"] = sd[b + dst + ".weight"], sd[b + dst + ".bias"]
        for src, dst in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
            out[f"{bp}MlpBlock_3/{src}/kernel"] = sd[f"{b}mlp.{dst}.weight"].T
            out[f"{bp}MlpBlock_3/{src}/bias"] = sd[f"{b}mlp.{dst}.bias"]
    return out


def _timm_vit() -> timm.models.vision_transformer.VisionTransformer:
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=3
    ).eval()


def test_google_npz_loads_as_timm_reads_it(tmp_path: Path) -> None:
    """The oracle is timm's `_load_weights` (its reader of Google's ViT .npz): it rebuilds the source
    model from the file exactly, and vitlab's model from the same file gives timm's logits."""
    source = perturb(_timm_vit())
    np.savez(tmp_path / "vit.npz", **_google_npz(source))
    reread = _timm_vit()
    with torch.no_grad():
        for p in reread.parameters():
            p.zero_()
    _load_weights(reread, str(tmp_path / "vit.npz"))
    for key, value in source.state_dict().items():
        assert torch.equal(reread.state_dict()[key], value), key
    loaded = load_pretrained(tmp_path / "vit.npz")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = reread(x)
        torch.testing.assert_close(loaded(x), expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.1  # logits far from the zero-head start


def test_npz_errors(tmp_path: Path) -> None:
    arrays = _google_npz(perturb(_timm_vit()))

    bad = dict(arrays)
    bad["Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel"] = np.zeros((64, 100), np.float32)
    np.savez(tmp_path / "shape.npz", **bad)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(tmp_path / "shape.npz")
    msg = str(info.value)
    assert "npz" in msg and "blocks.1.mlp.fc1.weight (from Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel)" in msg
    assert "(100, 64)" in msg and "(256, 64)" in msg

    bad = dict(arrays)
    bad["embedding/kernel"] = arrays["embedding/kernel"][0]
    np.savez(tmp_path / "rank.npz", **bad)
    with pytest.raises(CheckpointError, match=r"embedding/kernel has shape \(8, 3, 64\).*expected rank 4"):
        load_pretrained(tmp_path / "rank.npz")

    bad = dict(arrays)
    bad["Transformer/encoderblock_0/LayerNorm_0/scale"] = np.ones(64, np.int32)
    np.savez(tmp_path / "dtype.npz", **bad)
    with pytest.raises(CheckpointError, match=r"LayerNorm_0/scale' has dtype int32"):
        load_pretrained(tmp_path / "dtype.npz")

    bad = dict(arrays)
    bad["extra/object"] = np.array([{"a": 1}], dtype=object)
    np.savez(tmp_path / "object.npz", **bad)
    with pytest.raises(UnsafeCheckpointError, match="object arrays"):
        load_pretrained(tmp_path / "object.npz")

    bad = dict(arrays)
    bad["MAPHead_0/probe"] = np.zeros((1, 1, 64), np.float32)
    np.savez(tmp_path / "map.npz", **bad)
    with pytest.raises(CheckpointError, match="MAPHead_0/probe"):
        load_pretrained(tmp_path / "map.npz")
