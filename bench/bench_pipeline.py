"""The training pipeline's overhead: a full Lightning training step of vitlab against a plain
PyTorch loop with the same model, optimizer, schedule, clipping and data.

Both sides train ViT-Ti/4 at 32x32 on real CIFAR images held in memory (decoded once, so the
data loader costs the same on both sides), batch 128. The Lightning side runs what a vitlab run
runs: `ViTClassifier` (metrics, logging, LR schedule), gradient clipping, a CSV logger and the
throughput monitor; checkpointing and the progress bar are off, as they are not per-step work.
Steps are timed between two step boundaries after warm-up; the sides alternate across repeats.
Target: overhead <= 5%.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# The tree this script sits in is the one measured, installed or not.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import median, spread  # noqa: E402
from vitlab.train import PerfMonitor, ViTClassifier  # noqa: E402
from vitlab.train.objectives.optim import build_optimizer, param_groups  # noqa: E402
from vitlab.train.objectives.schedule import build_scheduler  # noqa: E402

MODEL = dict(arch="vit_tiny_patch16", model_args=dict(patch_size=4, depth=6, mlp_ratio=2.0), img_size=32,
             num_classes=10, lr=5e-4, weight_decay=0.05, label_smoothing=0.1)  # fmt: skip


def real_images(root: Path, n: int) -> TensorDataset:
    """`n` CIFAR training images from the shared ImageFolder subset, normalised, in memory."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    tf = v2.Compose([v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.5] * 3)])
    ds = ImageFolder(str(root / "train"))
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))[:n].tolist()
    xs = torch.stack([tf(ds[i][0]) for i in idx])
    ys = torch.tensor([ds.targets[i] for i in idx])
    return TensorDataset(xs, ys)


class StepClock(L.Callback):
    """Wall time between the end of step `warmup` and the end of the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def lightning_run(data: TensorDataset, batch: int, steps: int, warmup: int) -> float:
    torch.manual_seed(0)
    module = ViTClassifier(**MODEL)
    clock = StepClock(warmup)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator="cpu", max_steps=steps + warmup, gradient_clip_val=1.0, log_every_n_steps=50,
            logger=L.pytorch.loggers.CSVLogger(tmp), callbacks=[PerfMonitor(), clock],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(module, DataLoader(data, batch_size=batch, shuffle=True, drop_last=True))
    return (clock.end - clock.start) / steps


def plain_run(data: TensorDataset, batch: int, steps: int, warmup: int) -> float:
    torch.manual_seed(0)
    model = ViTClassifier(**MODEL).model.train()
    groups = param_groups(model, MODEL["weight_decay"], lr=MODEL["lr"])
    opt = build_optimizer(groups, "adamw", lr=MODEL["lr"], weight_decay=MODEL["weight_decay"])
    sched = build_scheduler(opt, warmup_steps=0, total_steps=steps + warmup)
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    done, start = 0, 0.0
    while done < steps + warmup:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y, label_smoothing=MODEL["label_smoothing"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss.item()  # the Lightning side reads the loss for its log too
            done += 1
            if done == warmup:
                start = time.perf_counter()
            if done == steps + warmup:
                break
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/cifar10-subset"))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps, one repeat")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.repeats = 4, 2, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    root = Path(a.data)
    if not (root / "train").is_dir():
        raise SystemExit(f"no image folder at {root}: pass --data <folder with train/<class>/...>")
    data = real_images(root, a.batch * (a.steps + a.warmup))
    plain, light = [], []
    for r in range(a.repeats):  # alternate the order so drift hits both sides
        for side in ("plain", "lightning") if r % 2 == 0 else ("lightning", "plain"):
            if side == "plain":
                plain.append(plain_run(data, a.batch, a.steps, a.warmup))
            else:
                light.append(lightning_run(data, a.batch, a.steps, a.warmup))
    tp, tl = median(plain), median(light)
    overhead = tl / tp - 1
    print(f"torch {torch.__version__} | cpu threads {torch.get_num_threads()} | ViT-Ti/4 32x32 batch {a.batch}")
    print(f"{'side':<22}{'s/step':>10}{'img/s':>10}{'spread':>9}")
    print(f"{'plain PyTorch loop':<22}{tp:>10.4f}{a.batch / tp:>10.1f}{(spread(plain) or 0):>9.1%}")
    print(f"{'vitlab on Lightning':<22}{tl:>10.4f}{a.batch / tl:>10.1f}{(spread(light) or 0):>9.1%}")
    print(f"pipeline overhead: {overhead:+.1%} (target <= +5.0%) {'ok' if overhead <= 0.05 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
