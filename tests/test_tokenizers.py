"""Tokenizers as one family: the same interface, the same parameter names as before the split (a
checkpoint written by vitlab before it loads and gives the same logits), each against a hand-written
reference; plus the pieces of vit.py that changed with them (stochastic depth, the head swap)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from vitlab import VisionTransformer
from vitlab.models.tokenizers import (
    ConvTokenizer, HybridEmbed, PatchEmbed, ShiftedPatchTokenizer, Tokenizer, make_tokenizer,
)  # fmt: skip

# Written by vitlab at commit e770ae4, before the tokenizers were split out of one PatchEmbed: for
# each stem a small model's config (metadata), state dict, an input and its logits.
PRE_SPLIT = Path(__file__).parent / "data" / "pre_tokenizer_split.safetensors"


def _pre_split(name: str) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    with safe_open(str(PRE_SPLIT), "pt") as f:
        config = json.loads(f.metadata()[name])
        sd = {k.split("/", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(f"{name}/")}
        x = f.get_tensor("input")
    return config, {k: v for k, v in sd.items() if k != "logits"}, x, sd["logits"]


@pytest.mark.parametrize("name", ["patch", "conv", "spt"])
def test_checkpoint_written_before_the_split_loads_with_the_same_logits(name: str) -> None:
    config, sd, x, logits = _pre_split(name)
    model = VisionTransformer(**config).eval()
    model.load_state_dict(sd, strict=True)  # every parameter name is unchanged
    assert model.patch_embed.stem == config["stem"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), logits, atol=1e-6, rtol=1e-5)
    assert "stem_layers" not in model.config and "distilled" not in model.config  # saved configs read as before


def test_stochastic_depth_drops_as_before() -> None:
    # torchvision's StochasticDepth replaced a local DropPath: same per-sample drops from the same seed.
    config, sd, x, logits = _pre_split("droppath")
    model = VisionTransformer(**config).train()
    model.load_state_dict(sd, strict=True)
    assert model.blocks[1].drop_path1.p == 0.5 and model.blocks[0].drop_path1.p == 0.0
    torch.manual_seed(2)
    with torch.no_grad():
        out = model(torch.cat([x] * 4))
    torch.testing.assert_close(out, logits, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        assert (model.eval()(torch.cat([x] * 4)) - logits).abs().max() > 1e-3  # some branches were dropped


def test_stochastic_depth_row_mode_hand_case() -> None:
    block = VisionTransformer(img_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2, drop_path_rate=1.0)
    sd = block.blocks[1].drop_path1.train()
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(sd(x), torch.zeros_like(x))  # p=1 drops every sample's branch
    sd.p = 0.5
    torch.manual_seed(0)
    out = sd(x)
    per_sample = out.flatten(1)
    for i in range(3):  # each sample is either dropped whole or scaled by 1/(1-p)
        assert torch.equal(per_sample[i], torch.zeros(40)) or torch.allclose(per_sample[i], 2 * x[i].flatten())


# ---- one interface ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stem,patch,kw",
    [("patch", 8, {}), ("conv", 8, {"stem_channels": 8}), ("spt", 8, {}), ("resnet", 16, {"stem_layers": [1, 1, 1]})],
)
def test_every_tokenizer_has_the_same_interface(stem: str, patch: int, kw: dict) -> None:
    tok = make_tokenizer(stem, (32, 48), patch, 3, 24, **kw)
    assert isinstance(tok, Tokenizer) and tok.stem == stem
    assert tok.patch_size == patch and tok.img_size == (32, 48) and tok.grid_size == (32 // patch, 48 // patch)
    out = tok(torch.randn(2, 3, 32, 48))
    assert out.shape == (2, (32 // patch) * (48 // patch), 24)
    tok.set_grid((64, 32))
    assert tok.grid_size == (64 // patch, 32 // patch)
    assert tok(torch.randn(1, 3, 64, 32)).shape == (1, (64 // patch) * (32 // patch), 24)
    with pytest.raises(ValueError, match="differs from the model's img_size"):
        tok(torch.randn(1, 3, 32, 48))
    with pytest.raises(ValueError, match="in_chans=3"):
        tok(torch.randn(1, 1, 64, 32))


def test_patch_embed_is_a_linear_map_of_flattened_patches() -> None:
    tok = PatchEmbed((8, 12), 4, 3, 5)
    x = torch.randn(2, 3, 8, 12)
    patches = x.reshape(2, 3, 2, 4, 3, 4).permute(0, 2, 4, 1, 3, 5).reshape(2, 6, 48)  # row-major patches, (c, p, p)
    expected = patches @ tok.proj.weight.reshape(5, 48).T + tok.proj.bias
    torch.testing.assert_close(tok(x), expected, atol=1e-5, rtol=1e-5)


def test_conv_tokenizer_written_out() -> None:
    tok = ConvTokenizer((8, 8), 4, 3, 6, channels=5)
    x = torch.randn(2, 3, 8, 8)
    w1, w2 = tok.convs[0][0].weight, tok.convs[1][0].weight
    y = F.max_pool2d(F.relu(F.conv2d(x, w1, padding=1)), 3, 2, 1)
    y = F.max_pool2d(F.relu(F.conv2d(y, w2, padding=1)), 3, 2, 1)
    expected = y.flatten(2).transpose(1, 2)
    torch.testing.assert_close(tok(x), expected)
    # It runs channels-last inside; the gradients are those of the plain NCHW computation.
    x.requires_grad_(True)
    ref = [t.detach() for t in torch.autograd.grad(
        (F.max_pool2d(F.relu(F.conv2d(F.max_pool2d(F.relu(F.conv2d(x, w1, padding=1)), 3, 2, 1), w2, padding=1)),
                      3, 2, 1) ** 2).sum(), (x, w1, w2))]  # fmt: skip
    got = torch.autograd.grad((tok(x) ** 2).sum(), (x, w1, w2))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def test_shifted_patches_hand_case() -> None:
    # patch 2 -> shift 1: a single bright pixel at (1, 1) of a 4x4 image appears, in the four shifted
    # copies, at (0, 0), (0, 2), (2, 0), (2, 2) (each copy reads the image one pixel diagonally away).
    tok = ShiftedPatchTokenizer((4, 4), 2, 1, 3)
    with torch.no_grad():
        tok.norm.weight.fill_(1.0), tok.norm.bias.zero_()
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, 1, 1] = 1.0
    seen = {}
    tok.norm.register_forward_hook(lambda m, inp, out: seen.setdefault("patches", inp[0]))
    tok(x)
    patches = seen["patches"][0].reshape(4, 2, 2, 5)  # tokens (2x2 grid), p1, p2, channels (image + 4 shifts)
    image = patches.permute(3, 0, 1, 2).reshape(5, 2, 2, 2, 2).permute(0, 1, 3, 2, 4).reshape(5, 4, 4)
    expect = torch.zeros(5, 4, 4)
    expect[0, 1, 1] = 1  # the image itself
    # shifts (dy, dx) = (-1, -1), (-1, +1), (+1, -1), (+1, +1): out[i, j] = x[i + dy, j + dx]
    expect[1, 2, 2], expect[2, 2, 0], expect[3, 0, 2], expect[4, 0, 0] = 1, 1, 1, 1
    torch.testing.assert_close(image, expect)


def test_hybrid_grid_is_the_feature_map_grid() -> None:
    tok = HybridEmbed((64, 96), 16, 3, 8, layers=(1, 1, 1), width=32)
    feats = tok.backbone(torch.randn(1, 3, 64, 96))
    assert feats.shape == (1, 4 * 32 * 4, 4, 6)  # stride 16, 4 * width * 2**2 channels
    assert tok.grid_size == (4, 6) and tok.proj.kernel_size == (1, 1)


def test_tokenizer_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="unknown stem 'vit'; choose one of 'patch', 'conv', 'spt', 'resnet'"):
        make_tokenizer("vit", (32, 32), 8, 3, 16)
    with pytest.raises(ValueError, match="power-of-two patch_size"):
        make_tokenizer("conv", (24, 24), 6, 3, 16)
    with pytest.raises(ValueError, match="has stride 16; patch_size=8 .* must be a multiple of it"):
        make_tokenizer("resnet", (32, 32), 8, 3, 16, stem_layers=[1, 1, 1])
    with pytest.raises(ValueError, match="stem_layers .* needs stem='resnet'"):
        make_tokenizer("patch", (32, 32), 8, 3, 16, stem_layers=[3, 4, 9])
    with pytest.raises(ValueError, match="every ResNet stage needs at least one block"):
        make_tokenizer("resnet", (32, 32), 16, 3, 16, stem_layers=[1, 0, 1])


# ---- the head swap in the model's dtype and device -------------------------------------------------


def test_reset_head_keeps_the_model_dtype() -> None:
    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3)
    model = model.to(torch.bfloat16).eval()
    model.reset_head(5)
    assert model.head.weight.dtype == torch.bfloat16 and model.head.weight.device == model.pos_embed.device
    with torch.no_grad():
        out = model(torch.randn(2, 3, 16, 16, dtype=torch.bfloat16))  # float32 head here raised a dtype error
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros(2, 5, dtype=torch.bfloat16))
