"""The analysis commands behind the CLI (`explain`, `predict`, `inspect`), on plain arguments.

The model loader and the eval transform are imported inside the functions, so importing this
module (and `vitlab.analysis`) does not pull in checkpoint formats or data pipelines.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from vitlab.analysis.distance import mean_attention_distance
from vitlab.analysis.filters import patch_embedding_components
from vitlab.analysis.plots import (
    plot_attention_distance,
    plot_patch_components,
    plot_pos_embed_similarity,
    plot_rollout,
)
from vitlab.analysis.posembed import pos_embed_similarity
from vitlab.analysis.rollout import attention_rollout, pooling_weights
from vitlab.constants import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD

Prediction = list[tuple[str, float]]


def load_image(path: str | Path) -> Any:
    """Open an image file as an RGB PIL image; a missing or unreadable file raises naming it."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")  # convert() loads the pixels, so truncated files fail here
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ValueError(f"cannot read image {path}: {e}") from e


def load_model(ckpt: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    from vitlab.interop import load_pretrained

    return load_pretrained(ckpt).to(device).eval()


def preprocess(model: torch.nn.Module, images: Sequence[str | Path]) -> torch.Tensor:
    """Image files -> the normalised batch `[B, 3, H, W]` the model expects."""
    from vitlab.data.transforms import eval_transform

    transform = eval_transform(model)
    return torch.stack([transform(load_image(p)) for p in images])


def class_names(model: torch.nn.Module, num_classes: int | None = None) -> list[str]:
    """`data_config["class_names"]` when they match the head (`num_classes` outputs, by default the model's),
    else the class indices as text."""
    names = (getattr(model, "data_config", None) or {}).get("class_names")
    n = model.num_classes if num_classes is None else num_classes
    if names is not None and len(names) == n:
        return [str(s) for s in names]
    return [str(i) for i in range(n)]


def top_predictions(logits: torch.Tensor, names: Sequence[str], topk: int = 5) -> list[Prediction]:
    """Softmax probabilities -> per image the `topk` (class name, probability) pairs, best first."""
    probs = logits.float().softmax(dim=-1)
    values, idx = probs.topk(min(topk, probs.shape[-1]), dim=-1)
    return [[(names[i], float(v)) for v, i in zip(vs, ids)] for vs, ids in zip(values.tolist(), idx.tolist())]


@torch.no_grad()
def rollout_for_model(
    model: torch.nn.Module,
    x: torch.Tensor,
    attn: torch.Tensor,
    *,
    image_size: int | tuple[int, int] | None = None,
    discard_ratio: float = 0.0,
) -> torch.Tensor:
    """`attention_rollout` read as the model pools: class token, patch mean, or learned sequence weights."""
    return attention_rollout(
        attn, model.num_prefix_tokens, model.patch_embed.grid_size, image_size=image_size, pool=model.pool,
        discard_ratio=discard_ratio, query_weights=pooling_weights(model, x),
    )  # fmt: skip


@torch.no_grad()
def explain(
    ckpt: str,
    image: str,
    out: str | None = None,
    topk: int = 5,
    *,
    discard_ratio: float = 0.0,
    device: str = "cpu",
) -> Path:
    """Write the image as the model sees it, its attention-rollout heat-map and the top-k predictions.

    The PNG goes to `out`, by default `<image stem>_explain.png` in the current folder (not next to
    the image: data folders are often read-only). The picture is the preprocessed model input
    (resized and cropped), so the heat-map lines up with what was classified.
    """
    from vitlab.data.batch import denormalize

    model = load_model(ckpt, device)
    x = preprocess(model, [image]).to(device)
    logits, attn = model.forward_attention(x)
    preds = top_predictions(logits, class_names(model), topk)[0]
    heat = rollout_for_model(model, x, attn, image_size=tuple(x.shape[-2:]), discard_ratio=discard_ratio)[0]
    path = Path(out) if out else Path.cwd() / f"{Path(image).stem}_explain.png"
    rgb = denormalize(x[0], model.data_config.get("mean"), model.data_config.get("std")).clamp(0, 1)  # what it saw
    plot_rollout(rgb.cpu(), heat.cpu(), preds, path=path, title=Path(image).name).clear()
    return path


@torch.no_grad()
def predict(
    ckpt: str, images: list[str], topk: int = 5, *, batch_size: int = 32, device: str = "cpu"
) -> list[Prediction]:
    """Top-k (class name, probability) per image, in the order given."""
    model = load_model(ckpt, device)
    names = class_names(model)
    results: list[Prediction] = []
    for start in range(0, len(images), batch_size):
        x = preprocess(model, images[start : start + batch_size]).to(device)
        results.extend(top_predictions(model(x), names, topk))
    return results


def print_predictions(predictions: Sequence[Prediction], images: Sequence[str], file: TextIO | None = None) -> None:
    """One block per image (the output of `predict`, in order): its path, then `rank. class  prob%` lines."""
    file = file or sys.stdout
    for image, preds in zip(images, predictions):
        print(image, file=file)
        for rank, (name, prob) in enumerate(preds, 1):
            print(f"  {rank}. {name:<24} {100 * prob:6.2f}%", file=file)


def noise_inputs(model: torch.nn.Module, n: int = 8, seed: int = 0, sigma: float = 0.2) -> torch.Tensor:
    """Deterministic stand-in images: the normalisation mean colour plus Gaussian pixel noise, normalised."""
    cfg = model.data_config
    h, w = model.patch_embed.img_size
    mean = torch.tensor(cfg.get("mean", IMAGENET_INCEPTION_MEAN)).view(-1, 1, 1)
    std = torch.tensor(cfg.get("std", IMAGENET_INCEPTION_STD)).view(-1, 1, 1)
    gen = torch.Generator().manual_seed(seed)
    pixels = (mean + sigma * torch.randn(n, model.patch_embed.in_chans, h, w, generator=gen)).clamp(0, 1)
    return (pixels - mean) / std


@torch.no_grad()
def inspect(
    ckpt: str,
    out_dir: str,
    images: list[str] | None = None,
    *,
    num_noise: int = 8,
    seed: int = 0,
    batch_size: int = 16,
    device: str = "cpu",
) -> list[Path]:
    """Write the paper's Fig. 7 trio for a checkpoint into `out_dir`; returns the files written.

    - `attention_distance.png`: mean attention distance per head and layer, on `images` if given,
      else on `num_noise` mean-colour-plus-noise inputs (the title says which).
    - `pos_embed_similarity.png`: cosine similarity of the position embeddings at the current grid.
    - `patch_embedding_filters.png`: top principal components of the first-layer filters; only for
      the paper's linear patch stem (the conv and shifted-patch stems have no such filters: skipped
      with a warning).
    """
    model = load_model(ckpt, device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grid, p = model.patch_embed.grid_size, model.patch_embed.patch_size
    prefix = model.num_prefix_tokens
    written: list[Path] = []

    def write(plot: Any, data: Any, name: str, **kwargs: Any) -> None:
        plot(data, path=out / name, **kwargs).clear()
        written.append(out / name)

    if images:
        source = f"on {len(images)} image{'s' if len(images) != 1 else ''}"
        chunks = [preprocess(model, images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
    else:
        source = f"no images given: {num_noise} mean-colour + noise inputs"
        chunks = list(noise_inputs(model, num_noise, seed).split(batch_size))
    total, count = None, 0
    for x in chunks:  # batch-size-weighted mean, equal to the mean over all images
        _, attn = model.forward_attention(x.to(device))
        d = mean_attention_distance(attn.cpu(), grid, p, prefix) * x.shape[0]
        total, count = (d if total is None else total + d), count + x.shape[0]
    title = f"Mean attention distance ({source})"
    write(plot_attention_distance, total / count, "attention_distance.png", title=title)

    kind = "fixed sin-cos" if model.config.get("pos_embed") == "sincos" else "learned"
    sim = pos_embed_similarity(model.pos_embed.cpu(), grid, prefix)
    title = f"Position embedding similarity ({kind}, {grid[0]}x{grid[1]})"
    write(plot_pos_embed_similarity, sim, "pos_embed_similarity.png", title=title)

    if model.patch_embed.stem == "patch":
        comps = patch_embedding_components(model.patch_embed.proj.weight.cpu(), k=28)
        write(plot_patch_components, comps, "patch_embedding_filters.png")
    else:
        warnings.warn(
            f"stem {model.patch_embed.stem!r} has no linear patch filters; patch_embedding_filters.png not written",
            stacklevel=2,
        )
    return written
