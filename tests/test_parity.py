"""Logit parity with the peers: randomly initialised timm / HF / torchvision models and Google-layout
`.npz` files saved to disk, loaded by `vitlab.load_pretrained`, must give the peer's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import perturb
from vitlab.interop import load_pretrained
from vitlab.models.resize import resample_pos_embed

import timm
import transformers
import torchvision

from timm.layers import resample_abs_pos_embed  # noqa: E402
from timm.models.vision_transformer import _load_weights, checkpoint_filter_fn  # noqa: E402
from timm.models.vision_transformer_hybrid import checkpoint_filter_fn as hybrid_filter_fn  # noqa: E402

TOL = 1e-4


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@torch.no_grad()
def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _save(sd: dict[str, torch.Tensor], path: Path) -> Path:
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    else:
        torch.save(sd, path)
    return path


# ---- timm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,suffixes",
    [
        ("vit_tiny_patch16_224", (".pth", ".safetensors")),
        ("vit_small_patch16_224", (".pth", ".safetensors")),
        ("vit_base_patch32_224", (".pth", ".safetensors")),
    ],
)
def test_timm_logits(name: str, suffixes: tuple[str, ...], tmp_path: Path) -> None:
    peer = perturb(timm.create_model(name, pretrained=False))
    x = torch.randn(1, 3, 224, 224)
    ref = _logits(peer, x)
    for suffix in suffixes:
        model = load_pretrained(_save(peer.state_dict(), tmp_path / f"w{suffix}"))
        assert model.config["num_heads"] == peer.blocks[0].attn.num_heads
        assert _max_diff(_logits(model, x), ref) <= TOL, suffix
        assert model.data_config["crop_pct"] == 0.9 and model.data_config["interpolation"] == "bicubic"


def _timm_tiny(**kw: object) -> torch.nn.Module:
    args = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5)
    return timm.models.vision_transformer.VisionTransformer(**{**args, **kw})


def test_timm_wrapped_linear_patch_gap_and_no_qkv_bias(tmp_path: Path) -> None:
    # GAP with fc_norm, no qkv bias, old linear patch embedding, inside a training checkpoint.
    peer = perturb(_timm_tiny(global_pool="avg", class_token=False, qkv_bias=False))
    sd = dict(peer.state_dict())
    sd["patch_embed.proj.weight"] = sd["patch_embed.proj.weight"].flatten(1)
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in sd.items()}}, tmp_path / "ckpt.pth.tar")
    model = load_pretrained(tmp_path / "ckpt.pth.tar", config={"num_heads": 4})
    assert model.pool == "avg" and model.cls_token is None and not model.config["qkv_bias"]
    x = torch.randn(2, 3, 32, 32)
    assert _max_diff(_logits(model, x), _logits(peer, x)) <= TOL


@pytest.mark.parametrize("img_size", [384, (384, 256)])
def test_timm_resolution_change(img_size: int | tuple[int, int], tmp_path: Path) -> None:
    src = perturb(timm.create_model("vit_tiny_patch16_224", pretrained=False))
    path = _save(src.state_dict(), tmp_path / "w.safetensors")
    peer = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=img_size).eval()
    peer.load_state_dict(checkpoint_filter_fn(src.state_dict(), peer))
    model = load_pretrained(path, img_size=img_size)
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    assert model.data_config["img_size"] == [h, w]
    x = torch.randn(1, 3, h, w)
    assert _max_diff(model.pos_embed, peer.pos_embed) <= 1e-6
    assert _max_diff(_logits(model, x), _logits(peer, x)) <= TOL


@pytest.mark.parametrize(
    "old,new,prefix",
    [
        ((14, 14), (24, 24), 1),  # square, up
        ((14, 14), (24, 16), 1),  # to non-square
        ((14, 14), (7, 7), 1),  # down
        ((12, 8), (20, 10), 0),  # non-square source, no prefix token
        ((24, 24), (9, 15), 1),  # down and non-square
    ],
)
def test_resample_pos_embed_matches_timm(old: tuple[int, int], new: tuple[int, int], prefix: int) -> None:
    pos = torch.randn(1, prefix + old[0] * old[1], 32)
    ours = resample_pos_embed(pos, new, old_grid=old, num_prefix_tokens=prefix)
    ref = resample_abs_pos_embed(pos, list(new), list(old), num_prefix_tokens=prefix)
    assert _max_diff(ours, ref) <= 1e-5


# ---- HF transformers -----------------------------------------------------------------------------


def _hf_config(**kw: object) -> object:
    args = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                image_size=32, patch_size=8, num_labels=5)  # fmt: skip
    return transformers.ViTConfig(**{**args, **kw})


_HF_NEW_TO_OLD = [
    (".layers.", ".encoder.layer."),
    ("attention.q_proj", "attention.attention.query"),
    ("attention.k_proj", "attention.attention.key"),
    ("attention.v_proj", "attention.attention.value"),
    ("attention.o_proj", "attention.output.dense"),
    ("mlp.fc1", "intermediate.dense"),
    ("mlp.fc2", "output.dense"),
]


def _to_old_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        k = "." + k
        for new, old in _HF_NEW_TO_OLD:
            k = k.replace(new, old)
        out[k[1:]] = v
    return out


def test_hf_classification_both_layouts(tmp_path: Path) -> None:
    names = ["ant", "bee", "cat", "dog", "eel"]
    peer = perturb(transformers.ViTForImageClassification(_hf_config(id2label=dict(enumerate(names)))))
    x = torch.randn(2, 3, 32, 32)
    ref = _logits(peer, x)
    new = dict(peer.state_dict())
    assert "vit.layers.0.attention.q_proj.weight" in new  # transformers 5.x names in memory
    old = _to_old_layout(new)
    assert "vit.encoder.layer.0.attention.attention.query.weight" in old

    # transformers' own folder (config.json carries heads and eps): whatever layout it writes to disk
    peer.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    assert model.config["num_heads"] == 4 and model.config["norm_eps"] == 1e-12
    assert model.data_config["class_names"] == names
    assert _max_diff(_logits(model, x), ref) <= TOL
    # bare state dicts in both layouts; heads are not in the shapes, so they are given
    for name, sd in (("new.bin", new), ("old.safetensors", old)):
        model = load_pretrained(_save(sd, tmp_path / name), config={"num_heads": 4})
        assert model.config["norm_eps"] == 1e-12
        assert model.data_config["interpolation"] == "bilinear" and model.data_config["crop_pct"] == 1.0
        assert _max_diff(_logits(model, x), ref) <= TOL, name


@pytest.mark.parametrize("layout", ["new", "old"])
def test_hf_vitmodel_pooler_without_prefix(layout: str, tmp_path: Path) -> None:
    peer = perturb(transformers.ViTModel(_hf_config(qkv_bias=False, pooler_output_size=48)))
    sd = dict(peer.state_dict())
    assert not any(k.startswith("vit.") for k in sd)
    sd = _to_old_layout(sd) if layout == "old" else sd
    model = load_pretrained(_save(sd, tmp_path / "w.pth"), config={"num_heads": 4})
    assert model.num_classes == 0 and model.config["representation_size"] == 48
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = peer(x)
        assert _max_diff(model.forward_features(x), out.last_hidden_state) <= TOL
        assert _max_diff(model(x), out.pooler_output) <= TOL


def test_hf_family_resample_matches_interpolate_pos_encoding(tmp_path: Path) -> None:
    peer = perturb(transformers.ViTForImageClassification(_hf_config()))
    peer.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf", img_size=48, resample="family")
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        ref = peer(x, interpolate_pos_encoding=True).logits
    assert _max_diff(_logits(model, x), ref) <= TOL


# ---- torchvision ---------------------------------------------------------------------------------


def test_torchvision_vit_b_32(tmp_path: Path) -> None:
    peer = perturb(torchvision.models.vit_b_32(weights=None))
    x = torch.randn(1, 3, 224, 224)
    ref = _logits(peer, x)
    model = load_pretrained(_save(peer.state_dict(), tmp_path / "vit_b_32.pth"))
    assert model.config["num_heads"] == 12
    assert model.data_config["mean"] == [0.485, 0.456, 0.406] and model.data_config["crop_pct"] == 0.875
    assert _max_diff(_logits(model, x), ref) <= TOL


def _tv_small(image_size: int = 32) -> torch.nn.Module:
    return torchvision.models.vision_transformer.VisionTransformer(
        image_size=image_size, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
        num_classes=5, representation_size=32,
    )  # fmt: skip


def test_torchvision_old_mlp_names_pre_logits_and_family_resample(tmp_path: Path) -> None:
    peer = perturb(_tv_small())
    sd = {k.replace("mlp.0.", "mlp.linear_1.").replace("mlp.3.", "mlp.linear_2."): v
          for k, v in peer.state_dict().items()}  # fmt: skip
    assert any("mlp.linear_1" in k for k in sd)
    path = _save(sd, tmp_path / "tv.pth")
    model = load_pretrained(path, config={"num_heads": 4})
    assert model.config["representation_size"] == 32
    x = torch.randn(2, 3, 32, 32)
    assert _max_diff(_logits(model, x), _logits(peer, x)) <= TOL

    big = _tv_small(48).eval()
    state = torchvision.models.vision_transformer.interpolate_embeddings(48, 8, peer.state_dict())
    big.load_state_dict(state)
    model = load_pretrained(path, config={"num_heads": 4}, img_size=48, resample="family")
    x = torch.randn(1, 3, 48, 48)
    assert _max_diff(_logits(model, x), _logits(big, x)) <= TOL


# ---- Google .npz ---------------------------------------------------------------------------------


def _n(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().copy()


def timm_to_npz(model: torch.nn.Module, big_vision: bool = False, stacked: bool = False,
                cls_slot: bool = True) -> dict[str, np.ndarray]:  # fmt: skip
    """A timm ViT in the Flax layout of google-research/vision_transformer (or big_vision)."""
    sd = model.state_dict()
    dim, heads = model.embed_dim, model.blocks[0].attn.num_heads
    p = "params/" if big_vision else ""
    mha, ln2, mlp = ("MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0") if big_vision else (
        "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")  # fmt: skip
    out = {
        f"{p}embedding/kernel": _n(sd["patch_embed.proj.weight"].permute(2, 3, 1, 0)),
        f"{p}embedding/bias": _n(sd["patch_embed.proj.bias"]),
        f"{p}cls": _n(sd["cls_token"]),
        f"{p}Transformer/encoder_norm/scale": _n(sd["norm.weight"]),
        f"{p}Transformer/encoder_norm/bias": _n(sd["norm.bias"]),
        f"{p}head/kernel": _n(sd["head.weight"].T),
        f"{p}head/bias": _n(sd["head.bias"]),
    }
    pos = sd["pos_embed"] if cls_slot else sd["pos_embed"][:, 1:]
    out[f"{p}pos_embedding" if big_vision else "Transformer/posembed_input/pos_embedding"] = _n(pos)
    blocks = []
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        q, k, v = sd[b + "attn.qkv.weight"].chunk(3)
        qb, kb, vb = sd[b + "attn.qkv.bias"].chunk(3)
        blk = {
            "LayerNorm_0/scale": sd[b + "norm1.weight"], "LayerNorm_0/bias": sd[b + "norm1.bias"],
            f"{ln2}/scale": sd[b + "norm2.weight"], f"{ln2}/bias": sd[b + "norm2.bias"],
            f"{mha}/out/kernel": sd[b + "attn.proj.weight"].T.reshape(heads, dim // heads, dim),
            f"{mha}/out/bias": sd[b + "attn.proj.bias"],
            f"{mlp}/Dense_0/kernel": sd[b + "mlp.fc1.weight"].T, f"{mlp}/Dense_0/bias": sd[b + "mlp.fc1.bias"],
            f"{mlp}/Dense_1/kernel": sd[b + "mlp.fc2.weight"].T, f"{mlp}/Dense_1/bias": sd[b + "mlp.fc2.bias"],
        }  # fmt: skip
        for name, w, bias in (("query", q, qb), ("key", k, kb), ("value", v, vb)):
            blk[f"{mha}/{name}/kernel"] = w.T.reshape(dim, heads, dim // heads)
            blk[f"{mha}/{name}/bias"] = bias.reshape(heads, dim // heads)
        blocks.append(blk)
    if stacked:
        for key in blocks[0]:
            out[f"{p}Transformer/encoderblock/{key}"] = np.stack([_n(blk[key]) for blk in blocks])
    else:
        for i, blk in enumerate(blocks):
            out.update({f"{p}Transformer/encoderblock_{i}/{key}": _n(t) for key, t in blk.items()})
    return out


@pytest.mark.parametrize("big_vision,stacked", [(False, False), (True, True), (True, False)])
def test_npz_logits_against_timm_loader(big_vision: bool, stacked: bool, tmp_path: Path) -> None:
    src = perturb(_timm_tiny())
    path = tmp_path / "vit.npz"
    np.savez(path, **timm_to_npz(src, big_vision=big_vision, stacked=stacked))
    peer = _timm_tiny().eval()
    _load_weights(peer, str(path))
    model = load_pretrained(path)
    assert model.config["num_heads"] == 4  # stored in the Flax kernels' head axis
    assert model.data_config["interpolation"] == "bilinear"
    x = torch.randn(2, 3, 32, 32)
    ref = _logits(peer, x)
    assert _max_diff(ref, _logits(src, x)) <= TOL  # the test's own conversion is right
    assert _max_diff(_logits(model, x), ref) <= TOL


def test_npz_family_resample_matches_timm(tmp_path: Path) -> None:
    src = perturb(_timm_tiny())
    path = tmp_path / "vit.npz"
    np.savez(path, **timm_to_npz(src))
    peer = _timm_tiny(img_size=48).eval()
    _load_weights(peer, str(path))  # bilinear, no antialias
    model = load_pretrained(path, img_size=48, resample="family")
    x = torch.randn(1, 3, 48, 48)
    assert _max_diff(_logits(model, x), _logits(peer, x)) <= TOL


def test_big_vision_npz_without_class_token_slot(tmp_path: Path) -> None:
    # big_vision adds the position embedding before appending the class token
    src = perturb(_timm_tiny())
    with torch.no_grad():
        src.pos_embed[:, 0] = 0
    path = tmp_path / "bv.npz"
    np.savez(path, **timm_to_npz(src, big_vision=True, stacked=True, cls_slot=False))
    model = load_pretrained(path)
    x = torch.randn(2, 3, 32, 32)
    assert _max_diff(_logits(model, x), _logits(src, x)) <= TOL


def test_npz_pre_logits_and_bfloat16(tmp_path: Path) -> None:
    import vitlab

    ref = perturb(vitlab.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                                            num_classes=5, representation_size=24))  # fmt: skip
    arrays = timm_to_npz(ref)
    arrays["pre_logits/kernel"] = _n(ref.pre_logits.fc.weight.T)
    arrays["pre_logits/bias"] = _n(ref.pre_logits.fc.bias)
    np.savez(tmp_path / "rep.npz", **arrays)
    model = load_pretrained(tmp_path / "rep.npz")
    x = torch.randn(2, 3, 32, 32)
    assert model.config["representation_size"] == 24
    assert _max_diff(_logits(model, x), _logits(ref, x)) <= TOL
    # bfloat16 arrays as numpy writes them without ml_dtypes: raw 2-byte words
    bf16 = {k: torch.from_numpy(v).bfloat16().view(torch.int16).numpy().view("V2") for k, v in arrays.items()}
    np.savez(tmp_path / "bf16.npz", **bf16)
    model = load_pretrained(tmp_path / "bf16.npz")
    expect = torch.from_numpy(arrays["head/bias"]).bfloat16().float()
    assert torch.equal(model.head.bias, expect)


# ---- hybrids and distilled models (timm) ---------------------------------------------------------


def test_timm_r50_hybrid_loads_through_load_pretrained(tmp_path: Path) -> None:
    # timm's vit_base_r50_s16 layout (two transformer blocks keep it cheap): stem, stages, grid inferred;
    # the resize to 384 is tests/test_hybrid.py's.
    peer = perturb(timm.create_model("vit_base_r50_s16_224", num_classes=10, depth=2))
    model = load_pretrained(_save(peer.state_dict(), tmp_path / "r50.safetensors"))
    c = model.config
    assert (c["stem"], c["stem_layers"], c["stem_channels"], c["patch_size"]) == ("resnet", [3, 4, 9], 64, 16)
    assert c["img_size"] == [224, 224] and model.patch_embed.grid_size == (14, 14)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in peer.parameters())
    x = torch.randn(1, 3, 224, 224)
    assert _max_diff(_logits(model, x), _logits(peer, x)) <= TOL


def test_timm_root_only_hybrid_resized_on_the_feature_map_grid(tmp_path: Path) -> None:
    src = perturb(timm.create_model("vit_tiny_r_s16_p8_224", num_classes=5, depth=2))
    path = _save(src.state_dict(), tmp_path / "r_ti.pth")
    peer = timm.create_model("vit_tiny_r_s16_p8_224", num_classes=5, depth=2, img_size=384).eval()
    peer.load_state_dict(hybrid_filter_fn(src.state_dict(), peer))
    model = load_pretrained(path, img_size=384)
    assert model.config["stem_layers"] == [] and model.patch_embed.grid_size == (12, 12)  # 384 / 32
    x = torch.randn(1, 3, 384, 384)
    assert _max_diff(model.pos_embed, peer.pos_embed) <= 1e-6
    assert _max_diff(_logits(model, x), _logits(peer, x)) <= TOL


def test_timm_distilled_deit_two_prefix_tokens(tmp_path: Path) -> None:
    src = perturb(timm.create_model("deit_tiny_distilled_patch16_224", num_classes=5, depth=2))
    path = _save(src.state_dict(), tmp_path / "deit.safetensors")
    model = load_pretrained(path)
    assert model.distilled and model.num_prefix_tokens == 2 and model.config["img_size"] == [224, 224]
    assert model.data_config["mean"] == [0.485, 0.456, 0.406]  # DeiT's ImageNet statistics
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():  # timm's VisionTransformerDistilled in eval: the mean of both heads' logits
        ref = src.eval()(x)
    assert _max_diff(_logits(model, x), ref) <= TOL
    # Resampled with both prefix tokens kept, as timm's own filter does.
    peer = timm.create_model("deit_tiny_distilled_patch16_224", num_classes=5, depth=2, img_size=384).eval()
    peer.load_state_dict(checkpoint_filter_fn(src.state_dict(), peer))
    model = load_pretrained(path, img_size=384)
    assert _max_diff(model.pos_embed, peer.pos_embed) <= 1e-6
    x = torch.randn(1, 3, 384, 384)
    with torch.no_grad():
        feats = peer.forward_features(x)
        cls_logits, dist_logits = model.forward_distilled(x)
    assert _max_diff(cls_logits, peer.head(feats[:, 0])) <= TOL
    assert _max_diff(dist_logits, peer.head_dist(feats[:, 1])) <= TOL
