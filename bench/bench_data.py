"""The data share of a training step: streaming (decode + PIL augmentation per image) vs in-memory.

For each CPU recipe of the main job, in one process: seconds per batch spent producing the batch
(the DataLoader as the recipe builds it, and for the in-memory path the batched augmentation
Lightning applies after the transfer) and seconds per training step of the recipe's model (forward,
backward, AdamW). Share = data / (data + model). Rounds alternate between the measurements and each
keeps its fastest, so a busy spell on a shared machine does not land on one side only.

    python bench/bench_data.py            # both recipes, both paths

`--startup`: what a start costs before its first batch, without and then with the shard index
(vitlab.data.shard_index), each start a fresh process with an empty cache folder at first: bytes
read during `setup("fit")` (the kernel's rchar), seconds of setup and to the first training batch,
and the batches per epoch (which the index must not change).

    python bench/bench_data.py --startup
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import train_step_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("VITLAB_SHARED_DATA", ROOT.parent / "shared/data"))
RECIPES = {
    "pretrain (Tiny-ImageNet, 32px)": (
        ROOT / "recipes/pretrain/tinyimagenet_vit_cpu.yaml",
        SHARED / "tinyimagenet-200-shards",
    ),
    "fine-tune (Imagenette, 72px)": (
        ROOT / "recipes/finetune/imagenette_72px_cpu.yaml",
        SHARED / "imagenette-128-shards",
    ),
}


def datamodule(recipe: dict, data: Path, in_memory: bool):
    from vitlab.data import ShardDataModule

    args = {k: v for k, v in recipe["data"]["init_args"].items() if k not in ("train_shards", "val_shards", "source", "img_size_schedule")}
    val = {"val_shards": str(data / "val")} if (data / "val").is_dir() else {}
    dm = ShardDataModule(str(data / "train"), **val, **{**args, "in_memory": in_memory})
    dm.setup("fit")
    return dm


class _Training:
    """Stands in for a one-process trainer in its training loop (the in-memory hook augments then)."""

    training, world_size, global_rank, num_devices, current_epoch = True, 1, 0, 1, 0


def data_seconds(dm, batches: int) -> float:
    """Median seconds to produce a training batch ready for the model, over `batches` batches after the
    first (which fills the streaming path's shuffle buffer)."""
    dm.trainer = _Training()
    loader = iter(dm.train_dataloader())
    times = []
    for _ in range(batches + 1):
        start = time.perf_counter()
        batch = next(loader)
        if dm.in_memory:
            batch = dm.on_after_batch_transfer(batch, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


STARTUP = {"CIFAR-10 shards (held out by key)": SHARED / "cifar10-train-shards",
           "Tiny-ImageNet shards (train/ + val/)": SHARED / "tinyimagenet-200-shards"}


def _rchar() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def one_start(data: Path) -> dict:
    """One start in this process: setup('fit') and the first training batch, as a training run does them."""
    from vitlab.data import ShardDataModule

    split = (data / "train").is_dir()
    dm = ShardDataModule(str(data / "train") if split else str(data), val_shards=str(data / "val") if split else None,
                         img_size=32, batch_size=128, num_workers=0, auto_augment=None)  # fmt: skip
    t0, r0 = time.perf_counter(), _rchar()
    dm.setup("fit")
    t1, r1 = time.perf_counter(), _rchar()
    loader = dm.train_dataloader()
    next(iter(loader))
    return {"setup_bytes": r1 - r0, "setup_s": t1 - t0, "first_batch_s": time.perf_counter() - t0,
            "batches": len(loader)}  # fmt: skip


def startup() -> None:
    print(f"{'data':38s} {'start':9s} {'setup MB read':>13s} {'% of shards':>11s} {'setup s':>8s} "
          f"{'1st batch s':>11s} {'batches':>7s}")  # fmt: skip
    for name, data in STARTUP.items():
        if not data.is_dir():
            raise SystemExit(f"{data} is not a folder; see ../shared/data/README.md")
        size = sum(p.stat().st_size for p in data.rglob("*.tar*"))
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": str(ROOT)}
            for kind in ("no index", "indexed"):
                out = subprocess.run([sys.executable, __file__, "--one_start", str(data)], env=env, check=True,
                                     capture_output=True, text=True).stdout  # fmt: skip
                r = json.loads(out.strip().splitlines()[-1])
                print(f"{name:38s} {kind:9s} {r['setup_bytes'] / 1e6:13.2f} {100 * r['setup_bytes'] / size:10.2f}% "
                      f"{r['setup_s']:8.2f} {r['first_batch_s']:11.2f} {r['batches']:7d}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=10, help="timed batches or steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--startup", action="store_true", help="bytes read and seconds to the first batch, index or not")
    p.add_argument("--one_start", type=Path, help=argparse.SUPPRESS)  # a child process of --startup
    args = p.parse_args(argv)
    if args.one_start is not None:
        print(json.dumps(one_start(args.one_start)))
        return 0
    if args.startup:
        startup()
        return 0
    print(f"torch threads {torch.get_num_threads()}; fastest of {args.rounds} alternating rounds of {args.batches}")
    print(f"{'recipe':32s} {'path':10s} {'data s/batch':>12s} {'model s/step':>12s} {'data share':>10s}")
    for name, (path, data) in RECIPES.items():
        if not data.is_dir():
            raise SystemExit(f"{data} is not a folder; see ../shared/data/README.md")
        recipe = yaml.safe_load(path.read_text())
        dms = {"streaming": datamodule(recipe, data, False), "in-memory": datamodule(recipe, data, True)}
        d0 = dms["streaming"]
        best = {k: float("inf") for k in [*dms, "model"]}
        for _, kind in itertools.product(range(args.rounds), [*dms, "model"]):
            t = (train_step_seconds(recipe["model"]["model_args"], d0.img_size, d0.num_classes, d0.batch_size,
                                    args.batches) if kind == "model" else data_seconds(dms[kind], args.batches))  # fmt: skip
            best[kind] = min(best[kind], t)
        for kind in dms:
            share = best[kind] / (best[kind] + best["model"])
            print(f"{name:32s} {kind:10s} {best[kind]:12.4f} {best['model']:12.4f} {100 * share:9.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
