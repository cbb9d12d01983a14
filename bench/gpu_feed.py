"""The `feed` section of the device run: can the 224px data path keep a GPU busy?

Compiled ViT-S/16 bf16 training at 224px (CPU: a tiny model at 32px), measured three ways in one process:

  synthetic  a batch already on the device, reused: the model's own rate, the ceiling
  cpu        shards through ShardDataModule(decode="cpu"), every core but one a worker: uint8 crops
             from the workers, normalised on the device
  device     the same shards through decode="device": the workers read bytes, the device decodes
             (nvJPEG), crops, flips and normalises

For each: img/s, MFU (training FLOPs per image x img/s against the measured bf16 matmul peak) and the
GPU's idle share, 1 - img/s / synthetic img/s (the fraction of the step the model waited for data).
Target: the fastest path at >= 0.9x synthetic. The section makes its own data: ImageNet-size JPEGs
from `imagenet-sample/` under --data when it is there, else generated 500x375 pictures, packed by
`vitlab pack-shards --max-side 320`.
"""

from __future__ import annotations

import io
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]
from gpu_check import Context, Row, flops_per_image  # noqa: E402

import vitlab  # noqa: E402
from vitlab.data import ShardDataModule  # noqa: E402
from vitlab.data.pack import pack  # noqa: E402

TARGET = 0.9


def feed_sizes(ctx: Context) -> dict[str, Any]:
    if ctx.cuda:
        return dict(img_size=224, batch=256, images=4000, warmup=5, steps=30, model={}, compile=True)
    return dict(img_size=32, batch=8, images=48, warmup=1, steps=3, model=dict(ctx.profile.model_args), compile=False)


def _picture(seed: int, w: int = 500, h: int = 375) -> bytes:
    """A generated 'photograph' (gradients, blobs, noise) as a JPEG, for a machine without the sample."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([255 * x / w, 255 * y / h, 128 + 60 * np.sin(x / 37 + y / 23 + seed)], -1)
    img += rng.normal(0, 8, img.shape)
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def feed_data(ctx: Context, images: int) -> Path:
    """Shards of `images` ImageNet-size pictures in 10 classes, packed at max side 320 (made once)."""
    out = ctx.work / "feed-shards"
    if (out / "classes.txt").is_file():
        return out
    src = ctx.work / "feed-src"
    sample = sorted((ctx.data / "imagenet-sample").glob("*.JPEG")) if (ctx.data / "imagenet-sample").is_dir() else []
    for i in range(images):
        folder = src / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        data = sample[i % len(sample)].read_bytes() if sample else _picture(i)
        (folder / f"{i:06d}.jpg").write_bytes(data)
    pack(src, out, max_side=320, shard_size=500, report=lambda _: None)
    return out


class _Trainer:
    """What the data module's on_after_batch_transfer reads of a trainer."""

    training, current_epoch, world_size, global_rank, num_devices = True, 0, 1, 0, 1


def _step_fn(ctx: Context, sizes: dict[str, Any]):
    model = vitlab.create_model("vit_small_patch16", img_size=sizes["img_size"], num_classes=10,
                                **({"patch_size": 4} if not ctx.cuda else {}), **sizes["model"]).to(ctx.device)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.cuda)
    fwd = torch.compile(model) if sizes["compile"] else model

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.cuda):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def _sync(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def _rate(ctx: Context, step, batches, warmup: int, steps: int) -> float:
    """img/s over `steps` steps after `warmup`, each batch from `batches()` (an iterator of (x, y))."""
    it = batches()
    for _ in range(warmup):
        step(*next(it))
    _sync(ctx)
    n, start = 0, time.perf_counter()
    for _ in range(steps):
        x, y = next(it)
        step(x, y)
        n += x.shape[0]
    _sync(ctx)
    return n / (time.perf_counter() - start)


def _loader_batches(ctx: Context, dm: ShardDataModule):
    def batches():
        while True:  # epochs repeat: a short shard set outlasts no measurement
            for x, y in dm.train_dataloader():
                moved = (x if not isinstance(x, torch.Tensor) else x.to(ctx.device, non_blocking=True),
                         y.to(ctx.device, non_blocking=True))  # fmt: skip
                yield dm.on_after_batch_transfer(moved, 0)

    return batches


def section_feed(ctx: Context) -> list[Row]:
    sizes = feed_sizes(ctx)
    data = feed_data(ctx, sizes["images"])
    model, step = _step_fn(ctx, sizes)
    flops = flops_per_image(model, sizes["img_size"])
    peak = ctx.results.get("peak_tflops")
    b, s = sizes["batch"], sizes["img_size"]
    x = torch.randn(b, 3, s, s, device=ctx.device)
    y = torch.randint(0, 10, (b,), device=ctx.device)
    rates = {"synthetic": _rate(ctx, step, lambda: iter(lambda: (x, y), None), sizes["warmup"], sizes["steps"])}
    workers = max(1, (os.cpu_count() or 2) - 1)
    for decode in ("cpu", "device"):
        dm = ShardDataModule(str(data), val_fraction=0.0, img_size=s, batch_size=b, num_workers=workers,
                             decode=decode, auto_augment=None, shuffle_buffer=200)  # fmt: skip
        dm.trainer = _Trainer()
        dm.setup("fit")
        rates[decode] = _rate(ctx, step, _loader_batches(ctx, dm), sizes["warmup"], sizes["steps"])
    synthetic = rates["synthetic"]
    rows = []
    for name, ips in rates.items():
        mfu = ips * flops / (peak * 1e12) if peak else None
        idle = max(0.0, 1 - ips / synthetic)
        rows.append(Row(f"feed {name}", f"{ips:.0f} img/s, MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'}, "
                        f"GPU idle {100 * idle:.0f}%", math.isfinite(ips) and ips > 0,
                        train_ips=ips, mfu=mfu, idle_share=idle))  # fmt: skip
    best = max(("cpu", "device"), key=rates.__getitem__)
    ratio = rates[best] / synthetic
    rows.append(Row("feed fastest / synthetic", f"{best}: x{ratio:.2f} (target {TARGET:.2f}, {workers} workers, "
                    f"{sizes['img_size']}px batch {b})", ratio >= TARGET if ctx.cuda else None, ratio=ratio))  # fmt: skip
    ctx.results["feed"] = rates
    return rows
