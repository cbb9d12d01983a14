"""The paper's hybrid (section 3.1, Table 6): a BiT ResNet stem, stages (3, 4, 9), stride 16, then a
1x1 projection. Oracle: timm's hybrid ViTs, randomly initialised, given the same state dict."""

from __future__ import annotations

import pytest
import torch

from helpers import perturb
from vitlab import create_model
from vitlab.models.resnet import StdConv2dSame, pad_same

import timm  # noqa: E402 - a test dependency (pyproject dev extra)
from timm.models.vision_transformer_hybrid import checkpoint_filter_fn  # noqa: E402

TOL = 1e-4


@torch.no_grad()
def _max_diff(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> float:
    return (a(x) - b(x)).abs().max().item()


def test_r50_hybrid_matches_timm_at_224_and_after_resize_to_384() -> None:
    # The whole R50 stem; two transformer blocks keep it cheap (the blocks have their own parity tests).
    peer = perturb(timm.create_model("vit_base_r50_s16_224", num_classes=10, depth=2))
    model = create_model("vit_base_r50_s16", num_classes=10, img_size=224, depth=2).eval()
    model.load_state_dict(peer.state_dict(), strict=True)  # timm's names, nothing left over
    assert model.patch_embed.grid_size == (14, 14) and model.pos_embed.shape == (1, 1 + 14 * 14, 768)
    assert _max_diff(model, peer, torch.randn(1, 3, 224, 224)) <= TOL

    # Fine-tuning at 384: the position embeddings are resampled on the feature-map grid, 384 / 16 = 24.
    big = timm.create_model("vit_base_r50_s16_384", num_classes=10, depth=2).eval()
    big.load_state_dict(checkpoint_filter_fn(peer.state_dict(), big))
    model.set_image_size(384)
    assert model.patch_embed.grid_size == (24, 24) and model.pos_embed.shape == (1, 1 + 24 * 24, 768)
    torch.testing.assert_close(model.pos_embed, big.pos_embed, atol=1e-6, rtol=0)
    assert _max_diff(model, big, torch.randn(1, 3, 384, 384)) <= TOL


def test_root_only_hybrid_with_8x8_projection_matches_timm() -> None:
    # R+ViT-Ti/16: the ResNet root alone (stride 4), then an 8x8 projection: total stride 32.
    peer = perturb(timm.create_model("vit_tiny_r_s16_p8_224", num_classes=7, depth=2))
    model = create_model("vit_tiny_r_s16_p8", num_classes=7, img_size=224, depth=2).eval()
    model.load_state_dict(peer.state_dict(), strict=True)
    assert model.patch_embed.grid_size == (7, 7) and model.patch_embed.proj.kernel_size == (8, 8)
    assert _max_diff(model, peer, torch.randn(2, 3, 224, 224)) <= TOL


@pytest.mark.parametrize(
    "ours,timms",
    [
        ("vit_base_r50_s16", "vit_base_r50_s16_224"),
        ("vit_small_r26_s32", "vit_small_r26_s32_224"),
        ("vit_tiny_r_s16_p8", "vit_tiny_r_s16_p8_224"),
        ("vit_large_r50_s32", "vit_large_r50_s32_224"),
    ],
)
def test_parameter_counts_and_names_match_timm(ours: str, timms: str) -> None:
    with torch.device("meta"):
        model = create_model(ours, num_classes=1000, img_size=224)
        peer = timm.create_model(timms, num_classes=1000)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in peer.state_dict().items()}
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in peer.parameters())


def test_same_padding_and_weight_standardisation_hand_case() -> None:
    # TF "SAME": output ceil(n / stride); the odd pixel of padding goes at the end.
    x = torch.ones(1, 1, 6, 5)
    padded = pad_same(x, kernel_size=3, stride=2)  # height 6: 1 extra row, width 5: 1 + 1 columns
    assert padded.shape == (1, 1, 7, 7)
    assert padded[0, 0, :, 0].sum() == 0 and padded[0, 0, -1].sum() == 0 and padded[0, 0, 0].sum() == 5
    conv = StdConv2dSame(1, 1, 1)
    with torch.no_grad():
        conv.weight.fill_(3.0)  # a single weight standardises to 0 (mean removed): output all zeros
    assert torch.equal(conv(torch.randn(1, 1, 4, 4)), torch.zeros(1, 1, 4, 4))
    conv = StdConv2dSame(2, 1, 1)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, 5.0]).reshape(1, 2, 1, 1))  # -> (-1, +1): mean 3, std 2
    out = conv(torch.tensor([[2.0], [7.0]]).reshape(1, 2, 1, 1))
    torch.testing.assert_close(out, torch.full((1, 1, 1, 1), 5.0))


def test_hybrid_trains_and_the_grid_follows_non_square_input() -> None:
    model = create_model("vit_tiny_r_s16_p8", img_size=(64, 96), depth=1, num_classes=3)
    assert model.patch_embed.grid_size == (2, 3) and model.config["stem_layers"] == []
    out = model(torch.randn(2, 3, 64, 96))
    out.sum().backward()
    assert model.patch_embed.backbone.conv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["vit_tiny_r_s16_p8_224", "vit_base_r50_s16_224"])
def test_google_hybrid_npz_loads_as_timm_reads_it(name: str, tmp_path) -> None:
    """A big_vision-layout R+ViT .npz (ResNet keys `conv_root`, `gn_root`, `blockI/unitJ/...`): timm's own
    npz reader is the oracle; vitlab's `load_pretrained` must give the same logits."""
    import numpy as np
    from timm.models.vision_transformer import _load_weights
    from test_parity import timm_to_npz

    from vitlab import load_pretrained

    src = perturb(timm.create_model(name, num_classes=5, depth=2)).eval()
    sd = {k: v.detach().numpy() for k, v in src.state_dict().items()}
    conv = lambda k: sd[k].transpose(2, 3, 1, 0)  # noqa: E731 - OIHW -> HWIO
    arrays = dict(timm_to_npz(src))
    bb = "patch_embed.backbone."
    stem = bb + ("stem." if hasattr(src.patch_embed.backbone, "stem") else "")
    arrays.update({"conv_root/kernel": conv(stem + "conv.weight"), "gn_root/scale": sd[stem + "norm.weight"],
                   "gn_root/bias": sd[stem + "norm.bias"]})  # fmt: skip
    for i, stage in enumerate(getattr(src.patch_embed.backbone, "stages", [])):
        for j in range(len(stage.blocks)):
            t, b = f"{bb}stages.{i}.blocks.{j}.", f"block{i + 1}/unit{j + 1}/"
            for r in (1, 2, 3):
                arrays[f"{b}conv{r}/kernel"] = conv(f"{t}conv{r}.weight")
                arrays[f"{b}gn{r}/scale"], arrays[f"{b}gn{r}/bias"] = sd[f"{t}norm{r}.weight"], sd[f"{t}norm{r}.bias"]
            if f"{t}downsample.conv.weight" in sd:
                arrays[f"{b}conv_proj/kernel"] = conv(f"{t}downsample.conv.weight")
                arrays[f"{b}gn_proj/scale"], arrays[f"{b}gn_proj/bias"] = (
                    sd[f"{t}downsample.norm.weight"], sd[f"{t}downsample.norm.bias"])  # fmt: skip
    path = tmp_path / "hybrid.npz"
    np.savez(path, **arrays)
    peer = timm.create_model(name, num_classes=5, depth=2).eval()
    _load_weights(peer, str(path))
    ours = load_pretrained(str(path)).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (peer(x) - src(x)).abs().max() < 1e-5  # the file holds the source weights
        assert (ours(x) - peer(x)).abs().max() < 1e-4
