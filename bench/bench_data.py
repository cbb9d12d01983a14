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

`--imagenet DIR` (full-size ImageNet JPEGs, e.g. DIR=/work/imagenet-sample): images per second at 224px
of the decode ceilings (PIL, torchvision.io.decode_jpeg), timm's train transform with and without
RandAugment m9, and vitlab's shard and folder loaders on each decode path (`pil`: today's per-image
floats; `cpu`: uint8 crops, normalised on the device), with and without RandAugment, and the shards
packed by `vitlab pack-shards --max-side 320`. Per core (torch.set_num_threads(1), num_workers=0) and
with 2 workers (loaders only); rounds interleaved, the median kept. The loader rows time the workers'
side only: what `cpu` moves to the training device runs there batched.

    python bench/bench_data.py --imagenet /work/imagenet-sample
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


def _imagenet_data(src: Path, tmp: Path) -> dict[str, Path]:
    """An image folder (class = synset prefix of the file name), shards of the original bytes, and the
    shards `vitlab pack-shards --max-side 320` makes from them."""
    import io
    import tarfile

    from vitlab.data.pack import pack

    files = sorted(p for p in src.iterdir() if p.suffix.lower() in (".jpeg", ".jpg"))
    if len(files) < 2:
        raise SystemExit(f"{src} holds {len(files)} JPEGs; point --imagenet at a folder of full-size ImageNet JPEGs")
    classes = sorted({p.name.split("_")[0] for p in files})
    folder, shards = tmp / "folder", tmp / "shards"
    for p in files:
        (folder / p.name.split("_")[0]).mkdir(parents=True, exist_ok=True)
        (folder / p.name.split("_")[0] / p.name).symlink_to(p.resolve())
    shards.mkdir()
    with tarfile.open(shards / "shard-000000.tar", "w") as tar:
        for p in files:
            for ext, data in (("jpg", p.read_bytes()), ("cls", str(classes.index(p.name.split("_")[0])).encode())):
                info = tarfile.TarInfo(f"{p.stem}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (shards / "classes.txt").write_text("".join(f"{c}\n" for c in classes))
    pack(folder, tmp / "packed320", max_side=320, report=lambda _: None)
    return {"folder": folder, "shards": shards, "packed320": tmp / "packed320"}


def _loader_rate(make, images: int) -> float:
    """img/s of a fresh loader (built outside the timing, first batch excluded) over `images` images."""
    loader = make()
    it = iter(loader)
    next(it)
    n, start = 0, time.perf_counter()
    for x, _ in it:
        n += len(x)
        if n >= images:
            break
    return n / (time.perf_counter() - start)


def imagenet(src: Path, images: int, rounds: int) -> None:
    import io

    from PIL import Image
    from timm.data import create_transform
    from torchvision.io import ImageReadMode, decode_jpeg

    from vitlab.data import ImageFolderDataModule, ShardDataModule

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data = _imagenet_data(src, Path(tmp))
        blobs = [p.read_bytes() for p in sorted(data["folder"].rglob("*.JPEG"))][:images]
        tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        timm_t = create_transform(224, is_training=True, interpolation="bicubic", color_jitter=None)
        timm_ra = create_transform(224, is_training=True, interpolation="bicubic", auto_augment="rand-m9-mstd0.5")

        def per_image(fn):
            def rate() -> float:
                start = time.perf_counter()
                for b in fn[1]:
                    fn[0](b)
                return len(fn[1]) / (time.perf_counter() - start)
            return rate

        def dm(kind: str, decode: str, ra: bool, workers: int):
            common = dict(img_size=224, batch_size=50, num_workers=workers, decode=decode, seed=0,
                          auto_augment="randaugment" if ra else None, pin_memory=False)  # fmt: skip
            if kind == "folder":
                m = ImageFolderDataModule(str(data["folder"]), val_fraction=0.0, **common)
            else:
                m = ShardDataModule(str(data[kind]), val_fraction=0.0, shuffle_buffer=100, **common)
            m.setup("fit")
            return lambda: _loader_rate(m.train_dataloader, images)

        rows = {
            "PIL decode alone (no crop, no tensor)": per_image((lambda b: Image.open(io.BytesIO(b)).convert("RGB"), blobs)),
            "torchvision decode_jpeg alone": per_image((lambda t: decode_jpeg(t, mode=ImageReadMode.RGB), tensors)),
            "timm RandomResizedCrop + flip, bicubic": per_image(
                (lambda b: timm_t(Image.open(io.BytesIO(b)).convert("RGB")), blobs)),
            "timm, the same + RandAugment m9": per_image((lambda b: timm_ra(Image.open(io.BytesIO(b)).convert("RGB")), blobs)),
        }  # fmt: skip
        for workers in (0, 2):
            for kind, decode, ra in itertools.product(("shards", "folder", "packed320"), ("pil", "cpu"), (False, True)):
                if kind == "packed320" and decode == "pil":
                    continue
                name = f"vitlab {kind}, decode={decode}{' + RandAugment m9' if ra else ''}, {workers} workers"
                rows[name] = dm(kind, decode, ra, workers)
        got: dict[str, list[float]] = {k: [] for k in rows}
        for _ in range(rounds):
            for name, fn in rows.items():
                got[name].append(fn())
        med = {k: statistics.median(v) for k, v in got.items()}
        timm, timm_ra_rate, pil = (med["timm RandomResizedCrop + flip, bicubic"], med["timm, the same + RandAugment m9"],
                                   med["PIL decode alone (no crop, no tensor)"])  # fmt: skip
        print(f"{len(blobs)} images from {src}, 224px, batch 50, median of {rounds} interleaved rounds; "
              f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        print(f"{'path':62s} {'img/s':>7s} {'x timm':>7s} {'x PIL':>6s}")
        for name, r in med.items():
            ref = timm_ra_rate if "RandAugment" in name else timm
            print(f"{name:62s} {r:7.0f} {r / ref:6.2f}x {r / pil:5.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=10, help="timed batches or steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--startup", action="store_true", help="bytes read and seconds to the first batch, index or not")
    p.add_argument("--one_start", type=Path, help=argparse.SUPPRESS)  # a child process of --startup
    p.add_argument("--imagenet", type=Path, metavar="DIR", help="the 224px table on a folder of full-size JPEGs")
    p.add_argument("--images", type=int, default=500, help="images per --imagenet measurement")
    args = p.parse_args(argv)
    if args.imagenet is not None:
        imagenet(args.imagenet, args.images, args.rounds)
        return 0
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
