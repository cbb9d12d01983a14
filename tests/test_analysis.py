"""vitlab.analysis: rollout, attention distance, position-embedding similarity, filter PCA, figures, commands."""

from __future__ import annotations

import io
import itertools
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.analysis import (
    attention_rollout,
    attention_rollout_matrix,
    commands,
    mean_attention_distance,
    patch_embedding_components,
    plot_attention_distance,
    plot_patch_components,
    plot_pos_embed_similarity,
    plot_rollout,
    pooling_weights,
    pos_embed_similarity,
)
from vitlab.interop import save_pretrained
from vitlab.models import VisionTransformer, sincos_pos_embed_2d

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def tiny_vit(**kw) -> VisionTransformer:
    cfg = dict(img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    return VisionTransformer(**{**cfg, **kw}).eval()


def identity_attention(depth: int, b: int, heads: int, n: int) -> torch.Tensor:
    return torch.eye(n).expand(depth, b, heads, n, n).clone()


def uniform_attention(depth: int, b: int, heads: int, n: int) -> torch.Tensor:
    return torch.full((depth, b, heads, n, n), 1.0 / n)


def random_attention(depth: int, b: int, heads: int, n: int) -> torch.Tensor:
    return torch.randn(depth, b, heads, n, n).mul(2).softmax(dim=-1)


def make_attention_identity(model: VisionTransformer) -> None:
    """Every block attends each token to itself only (output = v), through the model's own code path."""

    def forward(self, x, return_attn=False):
        b, n, _ = x.shape
        v = self.qkv(x).chunk(3, dim=-1)[2]
        attn = torch.eye(n, device=x.device).expand(b, self.num_heads, n, n) if return_attn else None
        return self.proj(v), attn

    for blk in model.blocks:
        blk.attn.forward = types.MethodType(forward, blk.attn)


def make_attention_uniform(model: VisionTransformer) -> None:
    """Zero query and key projections: every logit is 0, so softmax is uniform (no patching needed)."""
    d = model.embed_dim
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight[: 2 * d].zero_()
            blk.attn.qkv.bias[: 2 * d].zero_()


# ---- 1. attention rollout ------------------------------------------------------------------------


def test_rollout_identity_attention_keeps_all_mass_on_class_token():
    # Identity attention mixes nothing: the rolled-out matrix is the identity, so the class token's
    # row is one-hot on itself and the map over the patches is exactly zero (also after "max").
    grid, n = (3, 4), 1 + 12
    attn = identity_attention(3, 2, 2, n)
    assert torch.allclose(attention_rollout_matrix(attn), torch.eye(n).expand(2, n, n))
    for norm in ("none", "max", "sum"):
        heat = attention_rollout(attn, 1, grid, normalize=norm)
        assert heat.shape == (2, 3, 4)
        assert torch.count_nonzero(heat) == 0


def test_rollout_identity_attention_through_model():
    model = tiny_vit()
    make_attention_identity(model)
    x = torch.randn(2, 3, 32, 32)
    logits, attn = model.forward_attention(x)
    n = 1 + 16
    assert attn.shape == (2, 2, 2, n, n) and logits.shape == (2, 10)
    assert torch.allclose(attn, torch.eye(n).expand_as(attn))
    roll = attention_rollout_matrix(attn)
    assert torch.allclose(roll[:, 0], torch.nn.functional.one_hot(torch.tensor(0), n).float().expand(2, n))
    heat = attention_rollout(attn, model.num_prefix_tokens, model.patch_embed.grid_size, image_size=32)
    assert heat.shape == (2, 32, 32) and torch.count_nonzero(heat) == 0


def test_rollout_uniform_attention_is_uniform_over_patches():
    grid, n = (3, 4), 13
    attn = uniform_attention(4, 2, 3, n)
    assert torch.allclose(attention_rollout(attn, 1, grid), torch.ones(2, 3, 4))  # "max": peak 1 everywhere
    assert torch.allclose(attention_rollout(attn, 1, grid, normalize="sum"), torch.full((2, 3, 4), 1 / 12))
    raw = attention_rollout(attn, 1, grid, normalize="none")
    assert torch.allclose(raw, raw.flatten()[0].expand_as(raw)) and 0 < raw.sum(dim=(1, 2))[0] < 1


def test_rollout_uniform_attention_through_model():
    model = tiny_vit()
    make_attention_uniform(model)
    _, attn = model.forward_attention(torch.randn(2, 3, 32, 32))
    assert torch.allclose(attn, torch.full_like(attn, 1 / 17), atol=1e-6)
    heat = attention_rollout(attn, 1, model.patch_embed.grid_size, image_size=(32, 32))
    assert torch.allclose(heat, torch.ones(2, 32, 32), atol=1e-5)


def test_rollout_matches_a_direct_implementation():
    depth, b, heads, grid = 3, 2, 4, (2, 3)
    n = 1 + 6
    attn = random_attention(depth, b, heads, n)
    a = attn.double().numpy()
    for i in range(b):
        r = np.eye(n)
        for layer in range(depth):
            m = 0.5 * a[layer, i].mean(axis=0) + 0.5 * np.eye(n)  # rows already sum to 1
            r = m @ r
        want = r[0, 1:].reshape(grid)
        got = attention_rollout(attn, 1, grid, normalize="none")[i].double().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5)
        np.testing.assert_allclose(attention_rollout(attn, 1, grid)[i].numpy(), want / want.max(), rtol=1e-5)


def test_rollout_points_at_the_attended_patch():
    # Every token reads from patch 5 in every layer: the class token's map must peak there.
    grid, n = (3, 4), 13
    attn = torch.zeros(2, 1, 2, n, n)
    attn[..., 1 + 5] = 1.0
    heat = attention_rollout(attn, 1, grid)
    assert heat.shape == (1, 3, 4)
    assert heat.flatten().argmax().item() == 5 and heat.max().item() == pytest.approx(1.0)
    assert (heat.flatten()[torch.arange(12) != 5] == 0).all()


def test_rollout_image_size_and_unbatched():
    attn = random_attention(2, 3, 2, 1 + 12)
    assert attention_rollout(attn, 1, (3, 4), image_size=(48, 64)).shape == (3, 48, 64)
    assert attention_rollout(attn, 1, (3, 4), image_size=40).shape == (3, 40, 40)
    heat = attention_rollout(attn, 1, (3, 4), image_size=(48, 64))
    assert heat.min() >= 0 and heat.amax(dim=(1, 2)).allclose(torch.ones(3))
    single = attention_rollout(attn[:, 0], 1, (3, 4))
    assert single.shape == (3, 4) and torch.allclose(single, attention_rollout(attn, 1, (3, 4))[0])
    assert torch.allclose(attention_rollout(list(attn), 1, (3, 4)), attention_rollout(attn, 1, (3, 4)))


def test_rollout_gap_model():
    # No class token: the map is the mean of the patch rows. Identity attention keeps each patch on
    # itself, so GAP reads every patch equally; uniform attention too.
    model = tiny_vit(class_token=False, pool="avg")
    assert model.num_prefix_tokens == 0
    _, attn = model.forward_attention(torch.randn(2, 3, 32, 32))
    assert attn.shape[-1] == 16
    heat = attention_rollout(attn, 0, model.patch_embed.grid_size, pool="avg", normalize="none")
    want = attention_rollout_matrix(attn).mean(dim=1).reshape(2, 4, 4)
    assert torch.allclose(heat, want, atol=1e-6) and torch.allclose(heat.sum(dim=(1, 2)), torch.ones(2))
    for attn in (identity_attention(2, 2, 2, 16), uniform_attention(2, 2, 2, 16)):
        assert torch.allclose(attention_rollout(attn, 0, (4, 4), pool="avg"), torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match="class token"):
        attention_rollout(attn, 0, (4, 4), pool="token")


@pytest.mark.parametrize(
    "kw", [{}, dict(class_token=False, pool="avg"), dict(class_token=False, pool="seq"), dict(distilled=True)],
    ids=["token", "avg", "seq", "distilled"],
)
def test_pooling_weights_are_the_token_mixture_the_model_pools(kw):
    """`pooling_weights(model, x) @ tokens` is the model's own pooled token, for every pooling type."""
    torch.manual_seed(0)
    model = tiny_vit(**kw)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        tokens = model.forward_features(x)
        weights = pooling_weights(model, x)
        assert weights.shape == tokens.shape[:2]
        assert torch.allclose(weights.sum(dim=-1), torch.ones(3), atol=1e-6)
        torch.testing.assert_close(torch.einsum("bn,bnd->bd", weights, tokens), model.pool_tokens(tokens))
    if kw.get("pool") == "seq":  # learned, so each image its own
        assert not torch.allclose(weights[0], weights[1])


def test_rollout_query_weights_and_discard_ratio():
    attn = random_attention(2, 2, 2, 1 + 6)
    w = torch.zeros(2, 7)
    w[:, 0] = 1.0
    assert torch.allclose(attention_rollout(attn, 1, (2, 3), query_weights=w), attention_rollout(attn, 1, (2, 3)))
    roll = attention_rollout_matrix(attn, discard_ratio=0.5)
    assert torch.allclose(roll.sum(dim=-1), torch.ones(2, 7), atol=1e-6)
    assert torch.allclose(attention_rollout_matrix(attn, discard_ratio=0.0), attention_rollout_matrix(attn))
    with pytest.raises(ValueError, match="tokens"):
        attention_rollout(attn, 1, (3, 3))
    # Head fusion: with one head self-only and one uniform, max keeps the larger entry of each pair.
    n = 7
    two = torch.stack([identity_attention(1, 1, 1, n)[:, :, 0], uniform_attention(1, 1, 1, n)[:, :, 0]], dim=2)
    fused = torch.maximum(torch.eye(n), torch.full((n, n), 1 / n)) + torch.eye(n)
    want = fused / fused.sum(-1, keepdim=True)
    assert torch.allclose(attention_rollout_matrix(two, head_fusion="max")[0], want)
    with pytest.raises(ValueError, match="head_fusion"):
        attention_rollout_matrix(two, head_fusion="median")


# ---- 2. mean attention distance ------------------------------------------------------------------


def mean_pairwise_centre_distance(grid: tuple[int, int], patch: int) -> float:
    centres = [((i + 0.5) * patch, (j + 0.5) * patch) for i in range(grid[0]) for j in range(grid[1])]
    total = 0.0
    for (y0, x0), (y1, x1) in itertools.product(centres, centres):
        total += math.hypot(y0 - y1, x0 - x1)
    return total / len(centres) ** 2


def test_mean_attention_distance_self_only_is_zero():
    d = mean_attention_distance(identity_attention(3, 2, 4, 1 + 12), (3, 4), 16, 1)
    assert d.shape == (3, 4) and torch.count_nonzero(d) == 0


def test_mean_attention_distance_uniform_is_mean_pairwise_distance():
    grid, patch = (3, 4), 16
    want = mean_pairwise_centre_distance(grid, patch)
    # Uniform over all tokens, class token included: the class token is dropped as key and query and
    # the patch weights renormalised, so it is uniform over patches.
    d = mean_attention_distance(uniform_attention(2, 2, 3, 1 + 12), grid, patch, 1)
    assert torch.allclose(d, torch.full((2, 3), want), rtol=1e-5)
    d0 = mean_attention_distance(uniform_attention(2, 2, 3, 12), grid, patch, 0)
    assert torch.allclose(d0, torch.full((2, 3), want), rtol=1e-5)
    # One local head, one global head, told apart.
    mixed = torch.stack([identity_attention(1, 2, 1, 13)[:, :, 0], uniform_attention(1, 2, 1, 13)[:, :, 0]], dim=2)
    d = mean_attention_distance(mixed, grid, patch, 1)
    assert d[0, 0] == 0 and d[0, 1].item() == pytest.approx(want, rel=1e-5)


def test_mean_attention_distance_through_model():
    model = tiny_vit(depth=3, num_heads=4)
    _, attn = model.forward_attention(torch.randn(3, 3, 32, 32))
    d = mean_attention_distance(attn, model.patch_embed.grid_size, model.patch_embed.patch_size, 1)
    assert d.shape == (3, 4)
    assert (d > 0).all() and (d < math.hypot(24, 24)).all()


# ---- 3. position-embedding similarity ------------------------------------------------------------


def test_pos_embed_similarity_sincos_peaks_on_itself_and_falls_off():
    g = 7
    sim = pos_embed_similarity(sincos_pos_embed_2d((g, g), 192), (g, g), 0)
    assert sim.shape == (g, g, g, g)
    flat = sim.reshape(g * g, g * g)
    assert torch.allclose(flat.diagonal(), torch.ones(g * g), atol=1e-5)
    assert (flat.argmax(dim=1) == torch.arange(g * g)).all()  # every map peaks at its own position
    assert torch.allclose(flat, flat.T, atol=1e-6)
    c = g // 2
    for line in (sim[c, c, c, c:], sim[c, c, c, : c + 1].flip(0), sim[c, c, c:, c]):  # centre outwards
        assert (line.diff() < 0).all()
    # Over the whole 14x14 grid, the mean similarity at row offset d falls with d (near range; sin-cos
    # is periodic, so far offsets are not guaranteed to keep falling).
    g = 14
    sim = pos_embed_similarity(sincos_pos_embed_2d((g, g), 192), (g, g), 0)
    by_offset = torch.stack([torch.stack([sim[i, j, i, j + d] for i in range(g) for j in range(g - d)]).mean()
                             for d in range(6)])  # fmt: skip
    assert (by_offset.diff() < 0).all()


@pytest.mark.parametrize("pos", ["sincos", "learn"])
def test_pos_embed_similarity_follows_set_image_size(pos):
    model = tiny_vit(pos_embed=pos)
    grid = model.patch_embed.grid_size
    sim = pos_embed_similarity(model.pos_embed, grid, model.num_prefix_tokens)
    assert sim.shape == (4, 4, 4, 4)
    model.set_image_size((48, 64))
    grid = model.patch_embed.grid_size
    sim = pos_embed_similarity(model.pos_embed, grid, model.num_prefix_tokens)
    assert sim.shape == (6, 8, 6, 8)
    assert torch.allclose(sim.reshape(48, 48).diagonal(), torch.ones(48), atol=1e-5)
    if pos == "sincos":
        assert torch.allclose(sim, pos_embed_similarity(sincos_pos_embed_2d(grid, 32), grid, 0), atol=1e-6)
    with pytest.raises(ValueError, match="tokens"):
        pos_embed_similarity(model.pos_embed, (4, 4), 1)


# ---- 4. principal components of the patch-embedding filters ---------------------------------------


def test_patch_embedding_components_shape():
    w = torch.randn(64, 3, 8, 8)
    comps = patch_embedding_components(w)
    assert comps.shape == (28, 3, 8, 8)
    assert comps.min() >= 0 and comps.max() <= 1
    assert torch.allclose(comps.flatten(1).amax(1), torch.ones(28)) and comps.flatten(1).amin(1).abs().max() < 1e-6
    raw = patch_embedding_components(w, k=5, rescale=False).flatten(1).double()
    assert torch.allclose(raw @ raw.T, torch.eye(5, dtype=torch.float64), atol=1e-5)  # orthonormal
    assert patch_embedding_components(torch.randn(10, 3, 4, 4), k=28).shape == (10, 3, 4, 4)  # capped at D
    model = tiny_vit()
    assert patch_embedding_components(model.patch_embed.proj.weight, k=7).shape == (7, 3, 8, 8)


def test_patch_embedding_components_recover_a_shared_pattern():
    pattern = torch.randn(3, 6, 6)
    scalars = torch.randn(40) * 3
    w = scalars.view(-1, 1, 1, 1) * pattern + 1e-4 * torch.randn(40, 3, 6, 6)
    first = patch_embedding_components(w, k=1, rescale=False)[0]
    corr = torch.nn.functional.cosine_similarity(first.flatten(), pattern.flatten(), dim=0)
    assert abs(corr.item()) > 0.9999  # up to sign
    # The display version is an affine rescale of it, so it still correlates perfectly.
    shown = patch_embedding_components(w, k=1)[0].flatten().double().numpy()
    assert abs(np.corrcoef(shown, pattern.flatten().double().numpy())[0, 1]) > 0.9999


# ---- 5. figures -----------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        assert im.format == "PNG"
        return im.size


def test_plots_write_pngs_of_the_expected_size(tmp_path):
    img = Image.fromarray((np.random.default_rng(0).random((40, 56, 3)) * 255).astype(np.uint8))
    attn = random_attention(2, 1, 2, 1 + 12)
    heat = attention_rollout(attn, 1, (3, 4))[0]  # patch-grid map: upsampled to the image by the plot
    preds = [("cat", 0.6), ("dog", 0.2), ("a rather long class name that gets cut", 0.1), ("frog", 0.05),
             ("ship", 0.05)]  # fmt: skip
    fig = plot_rollout(img, heat, preds, path=tmp_path / "r.png", title="t", figsize=(9, 3.4), dpi=100)
    assert png_size(tmp_path / "r.png") == (900, 340) and len(fig.axes) == 3
    tensor_img = torch.rand(3, 32, 32)
    plot_rollout(tensor_img, torch.rand(32, 32), None, path=tmp_path / "r2.png", figsize=(6, 2), dpi=50)
    assert png_size(tmp_path / "r2.png") == (300, 100)

    plot_attention_distance(torch.rand(12, 6) * 100, path=tmp_path / "d.png", title="x", figsize=(5, 4), dpi=80)
    assert png_size(tmp_path / "d.png") == (400, 320)

    sim = pos_embed_similarity(sincos_pos_embed_2d((6, 8), 64), (6, 8), 0)
    plot_pos_embed_similarity(sim, path=tmp_path / "s.png", figsize=(6, 5), dpi=100)
    assert png_size(tmp_path / "s.png") == (600, 500)

    comps = patch_embedding_components(torch.randn(64, 3, 8, 8))
    plot_patch_components(comps, path=tmp_path / "sub" / "f.png", dpi=100)
    assert len(comps) == 28  # the paper's first 28 components
    # In the default 7 columns: 4 rows of 0.7 in + 0.5 in for the title, 7 x 0.7 + 0.4 in wide, at 100 dpi.
    assert png_size(tmp_path / "sub" / "f.png") == (530, 330)
    plot_patch_components(comps[:5], path=tmp_path / "f2.png", figsize=(4, 2), dpi=60)
    assert png_size(tmp_path / "f2.png") == (240, 120)


# ---- 6. commands ----------------------------------------------------------------------------------


def large_photo(src: Path, tmp_path: Path) -> Path:
    """An image enlarged to a non-square 600x512 JPEG, so the commands resize and crop it."""
    path = tmp_path / "large_photo.jpg"
    with Image.open(src) as img:
        img.convert("RGB").resize((600, 512), Image.BICUBIC).save(path, quality=90)
    return path


def cat_and_ship(tmp_path: Path) -> list[Path]:
    """Two generated 32x32 PNGs (what the commands do holds for any pixels) and the second enlarged."""
    from helpers import image_tree

    tree = image_tree(tmp_path / "images", ["cat", "ship"], 0, 1)
    images = [next((tree / "val" / c).iterdir()) for c in ("cat", "ship")]
    return [*images, large_photo(images[1], tmp_path)]


@pytest.fixture
def stub_io(monkeypatch, tmp_path):
    """Stand-ins for the checkpoint loader and eval transform, to test the commands' own logic.

    The checkpoint is a torch.save of config/state/data_config; the transform resizes to the
    model's img_size and normalises with its mean/std.
    """
    from vitlab.models.vit import VisionTransformer as ViT

    def load_pretrained(path):
        blob = torch.load(path, weights_only=True)
        model = ViT(**blob["config"])
        model.load_state_dict(blob["state"])
        model.data_config.update(blob["data_config"])
        return model

    def eval_transform(model):
        h, w = model.data_config["img_size"]
        mean = torch.tensor(model.data_config["mean"]).view(3, 1, 1)
        std = torch.tensor(model.data_config["std"]).view(3, 1, 1)

        def tf(img):
            arr = np.asarray(img.convert("RGB").resize((w, h), Image.BICUBIC), dtype=np.float32) / 255.0
            return (torch.from_numpy(arr).permute(2, 0, 1) - mean) / std

        return tf

    interop = types.ModuleType("vitlab.interop")
    interop.load_pretrained = load_pretrained
    transforms = types.ModuleType("vitlab.data.transforms")
    transforms.eval_transform = eval_transform
    monkeypatch.setitem(sys.modules, "vitlab.interop", interop)
    monkeypatch.setitem(sys.modules, "vitlab.data.transforms", transforms)

    def save(model, name="ckpt.pt"):
        path = tmp_path / name
        torch.save(dict(config=model.config, state=model.state_dict(), data_config=model.data_config), path)
        return str(path)

    return save


@pytest.fixture
def real_io(tmp_path):
    """The project's own saver (read back by the commands through the project's loader and transform)."""

    def save(model, name="export"):
        return str(save_pretrained(model, tmp_path / name))

    return save


def trained_like_model(**kw) -> VisionTransformer:
    model = tiny_vit(**kw)
    model.data_config["class_names"] = list(CIFAR_CLASSES)
    return model


def check_commands(save, tmp_path: Path, images: list[Path], monkeypatch, **model_kw) -> None:
    model = trained_like_model(**model_kw)
    ckpt = save(model)
    x = commands.preprocess(model, images)
    with torch.no_grad():
        want = model(x).softmax(-1)

    preds = commands.predict(ckpt, [str(p) for p in images], topk=5)
    assert len(preds) == len(images)
    for p, row in zip(preds, want):
        assert len(p) == 5 and all(name in CIFAR_CLASSES for name, _ in p)
        probs = [q for _, q in p]
        assert probs == sorted(probs, reverse=True)
        assert p[0][0] == CIFAR_CLASSES[int(row.argmax())] and p[0][1] == pytest.approx(row.max().item(), abs=1e-4)
    buf = io.StringIO()
    commands.print_predictions(preds, [str(p) for p in images], file=buf)
    assert str(images[0]) in buf.getvalue() and preds[0][0][0] in buf.getvalue()

    out = commands.explain(ckpt, str(images[0]), str(tmp_path / "e.png"))
    assert out == tmp_path / "e.png" and png_size(out) == (900, 340)
    monkeypatch.chdir(tmp_path)
    default = commands.explain(ckpt, str(images[-1]))
    assert default.name == f"{images[-1].stem}_explain.png" and default.parent == tmp_path and default.is_file()

    paths = commands.inspect(ckpt, str(tmp_path / "inspect"))
    assert [p.name for p in paths] == ["attention_distance.png", "pos_embed_similarity.png",
                                       "patch_embedding_filters.png"]  # fmt: skip
    assert all(png_size(p)[0] > 100 for p in paths)
    paths = commands.inspect(ckpt, str(tmp_path / "inspect2"), images=[str(p) for p in images])
    assert len(paths) == 3 and all(p.is_file() for p in paths)


def test_commands_with_stub_io(stub_io, tmp_path, monkeypatch):
    check_commands(stub_io, tmp_path, cat_and_ship(tmp_path), monkeypatch)


def test_commands_gap_and_seq_models_with_stub_io(stub_io, tmp_path, monkeypatch):
    img = tmp_path / "img.png"
    Image.fromarray((np.random.default_rng(1).random((32, 32, 3)) * 255).astype(np.uint8)).save(img)
    for kw in (dict(class_token=False, pool="avg"), dict(class_token=False, pool="seq")):
        model = trained_like_model(**kw)
        ckpt = stub_io(model, name=f"{kw['pool']}.pt")
        assert commands.explain(ckpt, str(img), str(tmp_path / f"{kw['pool']}.png")).is_file()
    model = trained_like_model(stem="conv")
    with pytest.warns(UserWarning, match="no linear patch filters"):
        paths = commands.inspect(stub_io(model, name="conv.pt"), str(tmp_path / "conv"))
    assert [p.name for p in paths] == ["attention_distance.png", "pos_embed_similarity.png"]


def test_commands_name_unreadable_images(stub_io, tmp_path):
    ckpt = stub_io(trained_like_model())
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"this is not a PNG")
    with pytest.raises(ValueError, match="not_an_image.png"):
        commands.predict(ckpt, [str(bad)])
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        commands.explain(ckpt, str(tmp_path / "missing.jpg"))
    gray = tmp_path / "gray.png"
    Image.fromarray(np.zeros((20, 30), np.uint8), mode="L").save(gray)  # any mode is converted to RGB
    assert len(commands.predict(ckpt, [str(gray)], topk=3)[0]) == 3


def test_commands_end_to_end(real_io, tmp_path, monkeypatch):
    check_commands(real_io, tmp_path, cat_and_ship(tmp_path), monkeypatch)
