"""Figures for the analysis functions, in the look of the ViT paper's Fig. 6/7.

Figures are built as `matplotlib.figure.Figure` on an Agg canvas, never through pyplot, so they
hold no global state, need no display and do not change the caller's backend. Saved PNGs are
exactly `figsize * dpi` pixels (no tight bounding box), which callers and tests can rely on.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

Predictions = Sequence[tuple[str, float]]


def new_figure(figsize: tuple[float, float], dpi: int = 100, layout: str | None = None) -> Figure:
    fig = Figure(figsize=figsize, dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as a PNG at its own size and dpi; parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=fig.dpi, format="png")
    return path


def _finish(fig: Figure, path: str | Path | None, ax: Any = None, title: str | None = None) -> Figure:
    """Every plot's ending: the axes' title, wrapped to the figure's width; saved where a path is given."""
    if title:
        ax.set_title(_wrap(title, 8.5 * fig.get_figwidth()), fontsize=9)
    if path is not None:
        save_figure(fig, path)
    return fig


def image_to_array(image: Any) -> np.ndarray:
    """PIL image, `[H, W, C]` array or `[C, H, W]` tensor -> float RGB array `[H, W, 3]` in [0, 1].

    uint8 input is divided by 255; float input is taken as already in [0, 1] and clipped.
    """
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL, without importing it here
        image = np.asarray(image.convert("RGB"))
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu()
        image = image if image.dtype == torch.uint8 else image.float()
        if image.ndim == 3 and image.shape[0] in (1, 3) and image.shape[-1] not in (1, 3):
            image = image.permute(1, 2, 0)
        image = image.numpy()
    arr = np.asarray(image)
    arr = arr.astype(np.float32) / 255.0 if arr.dtype == np.uint8 else arr.astype(np.float32)
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected an image [H, W, C] with C in 1/3/4, got shape {arr.shape}")
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return np.clip(arr[..., :3], 0.0, 1.0)


def _numpy(x: Any, dtype: type = np.float64) -> np.ndarray:
    return np.asarray(x.detach().cpu().float() if isinstance(x, torch.Tensor) else x, dtype=dtype)


def _heat_to_array(heat: Any, size: tuple[int, int]) -> np.ndarray:
    t = torch.tensor(_numpy(heat, np.float32))
    if t.ndim != 2:
        raise ValueError(f"expected a single heat-map [h, w], got shape {tuple(t.shape)}")
    if tuple(t.shape) != size:
        t = F.interpolate(t[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]
    return t.numpy()


def format_predictions(predictions: Predictions, max_chars: int = 20) -> str:
    """`rank. name  prob%` lines, names cut to `max_chars` and padded so the percentages line up."""
    names = [str(n) if len(str(n)) <= max_chars else str(n)[: max_chars - 1] + "…" for n, _ in predictions]
    width = max((len(n) for n in names), default=0)
    return "\n".join(f"{i}. {n:<{width}} {100 * p:5.1f}%" for i, (n, (_, p)) in enumerate(zip(names, predictions), 1))


def plot_rollout(
    image: Any,
    heatmap: Any,
    predictions: Predictions | None = None,
    *,
    path: str | Path | None = None,
    title: str | None = None,
    alpha: float = 0.5,
    cmap: str = "jet",
    figsize: tuple[float, float] = (9.0, 3.4),
    dpi: int = 100,
) -> Figure:
    """Image | image with the rollout heat-map over it | top predictions as text (paper Fig. 6 look).

    `heatmap` `[h, w]` is upsampled bilinearly to the image if its size differs; it is shown with
    its own range (pass a [0, 1] map from `attention_rollout` for comparable colours).
    """
    img = image_to_array(image)
    heat = _heat_to_array(heatmap, img.shape[:2])
    fig = new_figure(figsize, dpi)
    axes = fig.subplots(1, 3, gridspec_kw=dict(width_ratios=[1, 1, 0.9]))
    axes[0].imshow(img, interpolation="bilinear")
    axes[0].set_title("input", fontsize=10)
    axes[1].imshow(img, interpolation="bilinear")
    axes[1].imshow(heat, cmap=cmap, alpha=alpha, interpolation="bilinear")
    axes[1].set_title("attention rollout", fontsize=10)
    for ax in axes:
        ax.set_axis_off()
    if predictions:
        axes[2].text(0.0, 0.5, f"top-{len(predictions)}\n" + format_predictions(predictions), va="center",
                     ha="left", fontsize=9, family="monospace", transform=axes[2].transAxes)  # fmt: skip
    if title:
        fig.suptitle(_wrap(title, 90), fontsize=10)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.04, top=0.86 if title else 0.9, wspace=0.08)
    return _finish(fig, path)


def plot_attention_distance(
    distances: Any,
    *,
    path: str | Path | None = None,
    title: str | None = None,
    max_distance: float | None = None,
    figsize: tuple[float, float] = (5.0, 4.0),
    dpi: int = 100,
) -> Figure:
    """Mean attention distance `[depth, heads]` against depth, one dot per head (paper Fig. 7 right).

    `max_distance` (e.g. the image diagonal or side, in pixels) fixes the top of the y axis.
    """
    d = _numpy(distances)
    if d.ndim != 2:
        raise ValueError(f"expected distances [depth, heads], got shape {d.shape}")
    depth, heads = d.shape
    fig = new_figure(figsize, dpi, layout="constrained")
    ax = fig.subplots()
    layers = np.arange(1, depth + 1)
    cmap = matplotlib.colormaps["tab20" if heads > 10 else "tab10"]
    for h in range(heads):
        ax.scatter(layers, d[:, h], s=14, color=cmap(h % cmap.N), label=f"Head {h + 1}")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xticks(layers if depth <= 16 else layers[:: math.ceil(depth / 12)])
    ax.set_ylim(0, max_distance if max_distance else max(1.0, float(np.nanmax(d)) * 1.08))
    ax.grid(alpha=0.3)
    if heads <= 16:
        ax.legend(fontsize=6, ncol=2 if heads > 6 else 1, loc="lower right", markerscale=0.8)
    return _finish(fig, path, ax, title)


def _wrap(text: str, width: float) -> str:
    return textwrap.fill(text, width=max(20, int(width)), break_long_words=False)


def _tick_positions(n: int, cell: int, gap: int) -> tuple[np.ndarray, list[str]]:
    step = 1 if n <= 16 else math.ceil(n / 12)
    idx = np.arange(0, n, step)
    return idx * (cell + gap) + (cell - 1) / 2, [str(i + 1) for i in idx]


def plot_pos_embed_similarity(
    similarity: Any,
    *,
    path: str | Path | None = None,
    title: str | None = "Position embedding similarity",
    cmap: str = "viridis",
    figsize: tuple[float, float] = (6.0, 5.2),
    dpi: int = 100,
) -> Figure:
    """Grid of grids (paper Fig. 7 centre): tile (i, j) is patch (i, j)'s similarity to every patch.

    `similarity` is `[h, w, h, w]` from `pos_embed_similarity`. The tiles are drawn as one mosaic
    image (one `imshow`, not h*w axes), so large grids stay fast.
    """
    s = _numpy(similarity)
    if s.ndim != 4 or s.shape[:2] != s.shape[2:]:
        raise ValueError(f"expected a similarity [h, w, h, w], got shape {s.shape}")
    h, w = s.shape[:2]
    gap = 1
    mosaic = np.full((h * (h + gap) - gap, w * (w + gap) - gap), np.nan)
    for i in range(h):
        for j in range(w):
            mosaic[i * (h + gap) : i * (h + gap) + h, j * (w + gap) : j * (w + gap) + w] = s[i, j]
    fig = new_figure(figsize, dpi, layout="constrained")
    ax = fig.subplots()
    cm = matplotlib.colormaps[cmap].with_extremes(bad="white")
    im = ax.imshow(mosaic, cmap=cm, vmin=-1.0, vmax=1.0, interpolation="nearest")
    xt, xl = _tick_positions(w, w, gap)
    yt, yl = _tick_positions(h, h, gap)
    ax.set_xticks(xt, xl, fontsize=7)
    ax.set_yticks(yt, yl, fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    fig.colorbar(im, ax=ax, shrink=0.9, label="Cosine similarity")
    return _finish(fig, path, ax, title)


def plot_patch_components(
    components: Any,
    *,
    path: str | Path | None = None,
    title: str | None = "RGB embedding filters (first principal components)",
    ncols: int = 7,
    figsize: tuple[float, float] | None = None,
    dpi: int = 100,
) -> Figure:
    """The principal components `[k, C, p, p]` as a grid of small RGB patches (paper Fig. 7 left).

    Components should already be in [0, 1] (`patch_embedding_components(..., rescale=True)`).
    Three-channel components are shown as RGB, any other channel count as the channel mean in grey.
    """
    c = _numpy(components)
    if c.ndim != 4:
        raise ValueError(f"expected components [k, C, p, p], got shape {c.shape}")
    k, ch, ph, pw = c.shape
    rgb = c.transpose(0, 2, 3, 1) if ch == 3 else np.repeat(c.mean(axis=1)[..., None], 3, axis=-1)
    ncols = max(1, min(ncols, k))
    nrows = math.ceil(k / ncols)
    gap = max(1, round(max(ph, pw) / 6))
    mosaic = np.ones((nrows * (ph + gap) - gap, ncols * (pw + gap) - gap, 3))
    for n in range(k):
        r, col = divmod(n, ncols)
        mosaic[r * (ph + gap) : r * (ph + gap) + ph, col * (pw + gap) : col * (pw + gap) + pw] = rgb[n]
    if figsize is None:
        figsize = (max(3.0, 0.7 * ncols + 0.4), 0.7 * nrows + (0.5 if title else 0.2))
    fig = new_figure(figsize, dpi)
    top = 0.1 / figsize[1] + (0.3 / figsize[1] if title else 0.0)  # room for the title, in inches
    ax = fig.add_axes((0.02, 0.1 / figsize[1], 0.96, 1.0 - 0.1 / figsize[1] - top))
    ax.imshow(np.clip(mosaic, 0.0, 1.0), interpolation="nearest")
    ax.set_axis_off()
    if title:
        fig.suptitle(_wrap(title, 12 * figsize[0]), fontsize=9, y=1.0 - 0.05 / figsize[1], va="top")
    return _finish(fig, path)


def plot_resolution(
    curves: Sequence[tuple[str, Sequence[int], Sequence[float], int | None]],
    *,
    path: str | Path | None = None,
    title: str | None = None,
    figsize: tuple[float, float] = (6.0, 4.0),
    dpi: int = 100,
) -> Figure:
    """Top-1 accuracy against test resolution, one curve per entry of `curves`: (label, sizes in
    pixels, top-1 in [0, 1], the size the model was trained at or None, marked with a ring)."""
    fig = new_figure(figsize, dpi, layout="constrained")
    ax = fig.subplots()
    cmap = matplotlib.colormaps["tab10"]
    ticks: set[int] = set()
    for i, (label, sizes, acc, trained) in enumerate(curves):
        color = cmap(i % cmap.N)
        pct = [100 * a for a in acc]
        ax.plot(sizes, pct, "o-", color=color, label=label, markersize=4)
        ticks.update(sizes)
        if trained in sizes:
            y = pct[list(sizes).index(trained)]
            ax.plot([trained], [y], "o", markersize=11, markerfacecolor="none", markeredgecolor=color)
    ax.set_xlabel("Test resolution (pixels; ring: trained at)")
    ax.set_ylabel("Top-1 accuracy (%)")
    if ticks:
        ax.set_xticks(sorted(ticks))
    values = [100 * a for _, _, acc, _ in curves for a in acc]
    if values:  # zoomed to the curves: a few points' difference must stay visible
        ax.set_ylim(max(0.0, min(values) - 5), min(100.0, max(values) + 5))
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=7, loc="best")
    return _finish(fig, path, ax, title)
