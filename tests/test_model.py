"""The model itself: sizes, options, resolution change, head swap, input errors, learning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed as timm_resample

from vitlab import VisionTransformer, create_model, list_models, resample_pos_embed
from vitlab.models import sincos_pos_embed_2d


def tiny(**kw) -> VisionTransformer:
    args = dict(img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=2, num_heads=4)
    return VisionTransformer(**{**args, **kw})


@pytest.mark.parametrize(
    "name, paper_millions",
    [("vit_base_patch16", 86), ("vit_large_patch16", 307), ("vit_huge_patch14", 632)],
)
def test_parameter_counts_match_paper_table1(name: str, paper_millions: int) -> None:
    with torch.device("meta"):
        model = create_model(name)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e6 - paper_millions) / paper_millions < 0.01, count


def test_named_variants_and_overrides() -> None:
    assert {"vit_tiny_patch16", "vit_small_patch16", "vit_base_patch16", "vit_base_patch32",
            "vit_large_patch16", "vit_large_patch32", "vit_huge_patch14"} <= set(list_models())  # fmt: skip
    m = create_model("vit_tiny_patch16", img_size=64, patch_size=8, num_classes=7, in_chans=1, depth=2)
    assert m.pos_embed.shape == (1, 1 + 64, 192)
    assert m(torch.randn(2, 1, 64, 64)).shape == (2, 7)
    with pytest.raises(ValueError, match="unknown model"):
        create_model("vit_gigantic")


def test_forward_features_and_head_split() -> None:
    m = tiny().eval()
    x = torch.randn(3, 3, 32, 32)
    tokens = m.forward_features(x)
    assert tokens.shape == (3, 1 + 16, 32)
    torch.testing.assert_close(m.forward_head(tokens), m(x))
    assert m.forward_head(tokens, pre_logits=True).shape == (3, 32)


@pytest.mark.parametrize("options", [dict(), dict(lsa=True), dict(grad_checkpointing=True)])
def test_class_token_fast_path_equals_full_forward(options: dict) -> None:
    """`forward` runs the last block for the class token only; logits and gradients must not change."""
    torch.manual_seed(0)
    ckpt = options.pop("grad_checkpointing", False)
    m = tiny(depth=3, **options).train()
    m.set_grad_checkpointing(ckpt)
    with torch.no_grad():  # a non-zero head so that every parameter gets a gradient
        m.head.weight.normal_(std=0.5)
    x = torch.randn(4, 3, 32, 32)
    grads = []
    for fn in (m, lambda x: m.forward_head(m.forward_features(x))):
        m.zero_grad()
        out = fn(x)
        F.cross_entropy(out, torch.arange(4)).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        grads[-1].append(out.detach())
    for fast, full in zip(*grads):
        torch.testing.assert_close(fast, full, atol=1e-5, rtol=1e-4)


def test_non_square_images() -> None:
    m = tiny(img_size=(32, 48)).eval()
    assert m.patch_embed.grid_size == (4, 6)
    assert m(torch.randn(2, 3, 32, 48)).shape == (2, 10)


@pytest.mark.parametrize(
    "options",
    [
        dict(pool="avg"),
        dict(pool="seq", class_token=False),
        dict(pos_embed="sincos"),
        dict(stem="conv", patch_size=4),
        dict(stem="spt", lsa=True),
        dict(representation_size=24),
        dict(qkv_bias=False, norm_eps=1e-12, drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1),
    ],
)
def test_options_build_run_and_backprop(options: dict) -> None:
    m = tiny(**options)
    out = m(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.sum().backward()
    trainable = [n for n, p in m.named_parameters() if p.requires_grad and p.grad is None]
    assert not trainable, f"parameters without gradient: {trainable}"


def test_gap_uses_fc_norm_like_timm() -> None:
    m = tiny(pool="avg")
    names = {n for n, _ in m.named_parameters()}
    assert "fc_norm.weight" in names and "norm.weight" not in names


def test_sdpa_path_equals_explicit_attention() -> None:
    for kw in (dict(), dict(lsa=True)):
        m = tiny(**kw).eval()
        x = torch.randn(2, 3, 32, 32)
        logits, attn = m.forward_attention(x)
        torch.testing.assert_close(logits, m(x), atol=1e-5, rtol=1e-5)
        assert attn.shape == (2, 2, 4, 17, 17)
        torch.testing.assert_close(attn.sum(-1), torch.ones(2, 2, 4, 17))
        if kw:  # locality self-attention never attends to self
            assert attn.diagonal(dim1=-2, dim2=-1).abs().max() == 0


def sincos_reference(h: int, w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """big_vision's posemb_sincos_2d written out element by element: token (y, x) at index y*w + x is
    [sin(x w_k), cos(x w_k), sin(y w_k), cos(y w_k)] (each over k), w_k = T^(-k / (dim/4 - 1))."""
    q = dim // 4
    omega = [temperature ** (-k / (q - 1)) for k in range(q)]
    rows = []
    for y in range(h):
        for x in range(w):
            rows.append([f(c * o) for c in (x, y) for f in (math.sin, math.cos) for o in omega])
    return torch.tensor(rows, dtype=torch.float32)


def test_sincos_embedding_is_fixed_and_recomputed_on_resize() -> None:
    # A hand-computed token first: dim 8, T = 10000, token (y=1, x=2) of a 2x3 grid (index 5).
    want = [math.sin(2), math.sin(2e-4), math.cos(2), math.cos(2e-4), math.sin(1), math.sin(1e-4), math.cos(1),
            math.cos(1e-4)]  # fmt: skip
    torch.testing.assert_close(sincos_pos_embed_2d((2, 3), 8)[5], torch.tensor(want))
    m = tiny(pos_embed="sincos")
    assert not m.pos_embed.requires_grad
    torch.testing.assert_close(m.pos_embed[0, 1:], sincos_reference(4, 4, 32))
    m.set_image_size((64, 48))
    torch.testing.assert_close(m.pos_embed[0, 1:], sincos_reference(8, 6, 32))


def test_set_image_size_resamples_grid_part_only() -> None:
    m = tiny()
    before = m.pos_embed.detach().clone()
    m.set_image_size((64, 48))
    assert m.pos_embed.shape == (1, 1 + 8 * 6, 32)
    torch.testing.assert_close(m.pos_embed[:, :1], before[:, :1])
    expected = timm_resample(before, new_size=[8, 6], old_size=[4, 4], num_prefix_tokens=1)  # bicubic, antialias
    torch.testing.assert_close(m.pos_embed.detach(), expected)
    assert m.config["img_size"] == [64, 48] and m.data_config["img_size"] == [64, 48]
    assert m(torch.randn(1, 3, 64, 48)).shape == (1, 10)
    assert m.pos_embed.requires_grad


def test_resample_pos_embed_independent_reference() -> None:
    # Upsampling a linear ramp with bilinear/align_corners=True must reproduce the ramp exactly.
    ramp = torch.linspace(0, 1, 4)
    grid = (ramp[:, None] + 2 * ramp[None, :]).reshape(1, 16, 1)
    pe = torch.cat([torch.full((1, 1, 1), 7.0), grid], dim=1)
    out = resample_pos_embed(pe, (7, 7), mode="bilinear", antialias=False, align_corners=True)
    r7 = torch.linspace(0, 1, 7)
    torch.testing.assert_close(out[0, 1:, 0], (r7[:, None] + 2 * r7[None, :]).flatten())
    assert out[0, 0, 0] == 7.0
    # Same grid: returned unchanged; a non-square source needs old_grid.
    assert resample_pos_embed(pe, (4, 4)) is pe
    with pytest.raises(ValueError, match="old_grid"):
        resample_pos_embed(torch.zeros(1, 1 + 12, 4), (4, 4))


def test_reset_head_zero_logits_and_same_features() -> None:
    m = tiny(representation_size=24).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = m.forward_features(x)
    m.reset_head(5)
    assert isinstance(m.head, torch.nn.Linear) and m.head.out_features == 5
    assert isinstance(m.pre_logits, torch.nn.Identity) and m.config["representation_size"] is None
    torch.testing.assert_close(m.forward_features(x), feats)
    assert torch.equal(m(x), torch.zeros(2, 5))


def test_bad_inputs_raise_clear_errors() -> None:
    m = tiny()
    with pytest.raises(ValueError, match=r"30x32 is not a multiple of the patch size 8"):
        m(torch.randn(1, 3, 30, 32))
    with pytest.raises(ValueError, match=r"1 channels but the model expects in_chans=3"):
        m(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match=r"set_image_size"):
        m(torch.randn(1, 3, 64, 64))
    with pytest.raises(ValueError, match=r"not a multiple of patch_size 16"):
        create_model("vit_tiny_patch16", img_size=100)
    with pytest.raises(ValueError, match="divisible"):
        tiny(num_heads=5)


def test_overfits_a_fixed_batch() -> None:
    torch.manual_seed(0)
    m = tiny(drop_rate=0.0)
    x, y = torch.randn(16, 3, 32, 32), torch.arange(16) % 10
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses[::10]


def test_grad_checkpointing_gives_same_gradients() -> None:
    torch.manual_seed(0)
    a = tiny()
    b = tiny()
    b.load_state_dict(a.state_dict())
    b.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 32, 32)
    a(x).sum().backward()
    b(x).sum().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, msg=n)


def test_compiles_without_graph_breaks() -> None:
    import torch._dynamo

    m = tiny()
    explanation = torch._dynamo.explain(m)(torch.randn(2, 3, 32, 32))
    assert explanation.graph_break_count == 0, explanation.break_reasons
