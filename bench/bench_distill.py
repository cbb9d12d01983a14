"""DeiT distillation on Imagenette (CPU): a distilled ViT student with a CNN teacher trained on the
same data, against the same student without distillation, with the same budget (epochs, data,
split, augmentation, optimiser). Target: +2 points of validation top-1.

1. The teacher: torchvision's ResNet-18 (random init) trained on the recipe's data and split,
   saved as a state dict (OUT/teacher.pth, what the recipe's `teacher` names).
2. The student without distillation: the recipe's ViT with its class token only (`distilled: false`),
   trained by `ViTClassifier` (cross-entropy on the labels).
3. The distilled student: the recipe's `DistillClassifier` (class + distillation token, the recipe's
   distillation, or `--distillation/--alpha/--tau`), predicting with the mean of both heads'
   logits.

Each trains from the same seed through Lightning on the recipe's `ShardDataModule` and is scored
by `trainer.validate` on the held-out part (`val_fraction` of the train split, by key hash).

    python bench/bench_distill.py --data ../shared/data/imagenette-128-shards/train          # full budget
    python bench/bench_distill.py --data ../shared/data/imagenette-128-shards/train --quick  # 1 short epoch each

Each finished row is saved as OUT/rows/<row>.json and the table is made of every row there, so the
two students can run as two processes on two cores once the teacher exists:

    python bench/bench_distill.py --data D --students none                       # the teacher alone
    python bench/bench_distill.py --data D --teacher OUT/teacher.pth --students plain &
    python bench/bench_distill.py --data D --teacher OUT/teacher.pth --students distilled
    python bench/bench_distill.py --data D --teacher OUT/teacher.pth --students distilled --distillation hard

Every distilled row (named by its distillation, alpha and tau) is compared with the plain row.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchvision
import yaml
from torchmetrics.classification import MulticlassAccuracy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vitlab.data import ShardDataModule  # noqa: E402
from vitlab.data.batch import split_batch  # noqa: E402
from vitlab.train import ViTClassifier  # noqa: E402
from vitlab.train.objectives.distill import DistillClassifier  # noqa: E402

RECIPE = ROOT / "recipes/finetune/imagenette_deit_distill_cpu.yaml"


class CNNTeacher(L.LightningModule):
    """A torchvision CNN trained from scratch: SGD + Nesterov, per-step cosine, label smoothing."""

    def __init__(self, arch: str, num_classes: int, lr: float = 0.1, weight_decay: float = 5e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        self.val_acc1 = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = split_batch(batch)
        loss = F.cross_entropy(self(x), y, label_smoothing=0.1)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = split_batch(batch)
        self.val_acc1(self(x), y.argmax(1) if y.ndim == 2 else y)
        self.log("val/acc1", self.val_acc1, on_epoch=True)

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, nesterov=True,
                              weight_decay=self.hparams.weight_decay)  # fmt: skip
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0))))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(epochs: int, quick: bool) -> L.Trainer:
    limits = dict(limit_train_batches=3, limit_val_batches=2) if quick else {}
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     gradient_clip_val=1.0, **limits)  # fmt: skip


def run(name: str, module: L.LightningModule, data: ShardDataModule, epochs: int, quick: bool) -> dict[str, Any]:
    t = trainer(epochs, quick)
    start = time.perf_counter()
    t.fit(module, datamodule=data)
    wall = time.perf_counter() - start
    acc = t.validate(module, datamodule=data, verbose=False)[0]["val/acc1"]
    print(f"  {name}: val top-1 {100 * acc:.2f}% after {epochs} epoch(s), {wall:.0f} s", flush=True)
    return {"name": name, "val_acc1": acc, "epochs": epochs, "train_wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="Imagenette train shards (the split is held out from it)")
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--out", default="runs/bench_distill", help="teacher.pth and results.json go here")
    parser.add_argument("--epochs", type=int, default=None, help="student epochs (default: the recipe's)")
    parser.add_argument("--teacher-epochs", type=int, default=24)
    parser.add_argument("--teacher", default=None, help="use this teacher state dict instead of training one")
    parser.add_argument("--students", choices=["both", "plain", "distilled", "none"], default="both",
                        help="which students to train (rows of other processes are read from OUT/rows)")
    parser.add_argument("--quick", action="store_true", help="1 epoch of 3 batches each: checks the pipeline only")
    parser.add_argument("--distillation", choices=["hard", "soft"], default=None, help="default: the recipe's")
    parser.add_argument("--alpha", type=float, default=None, help="distill_alpha (default: the recipe's)")
    parser.add_argument("--tau", type=float, default=None, help="distill_tau, soft only (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    recipe = yaml.safe_load(Path(args.recipe).read_text())
    model_args = dict(recipe["model"]["init_args"])
    for key, value in (("distillation", args.distillation), ("distill_alpha", args.alpha), ("distill_tau", args.tau)):
        if value is not None:
            model_args[key] = value
    data_args = {**recipe["data"]["init_args"], "train_shards": args.data, "source": None}
    epochs = 1 if args.quick else args.epochs or int(recipe["trainer"]["max_epochs"])
    teacher_epochs = 1 if args.quick else args.teacher_epochs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = ShardDataModule(**data_args)
    data.setup("fit")
    num_classes = data.num_classes
    common = dict(num_classes=num_classes, img_size=data.img_size, data_config=data.data_config,
                  class_names=data.class_names)  # fmt: skip
    rows = []
    print(f"data {args.data}: {num_classes} classes, {data.img_size}px; recipe {args.recipe}", flush=True)

    teacher_arch = model_args.get("teacher_arch") or "resnet18"
    teacher_path = Path(args.teacher) if args.teacher else out / "teacher.pth"
    if not args.teacher:
        L.seed_everything(args.seed, verbose=False)
        cnn = CNNTeacher(teacher_arch, num_classes)
        rows.append(run(f"teacher {teacher_arch}", cnn, data, teacher_epochs, args.quick))
        torch.save(cnn.net.state_dict(), teacher_path)

    plain_keys = inspect.signature(ViTClassifier.__init__).parameters
    student = {k: v for k, v in model_args.items() if k in plain_keys}
    if args.students in ("both", "plain"):
        L.seed_everything(args.seed, verbose=False)
        plain_args = {**student, "model_args": {**student.get("model_args", {}), "distilled": False}}
        rows.append(run("student, no distillation", ViTClassifier(**plain_args, **common), data, epochs, args.quick))
    if args.students in ("both", "distilled"):
        L.seed_everything(args.seed, verbose=False)
        distill_args = {**model_args, "teacher": str(teacher_path), "teacher_arch": teacher_arch}
        distilled = DistillClassifier(**distill_args, **common)
        hp = distilled.hparams  # the variant as the module resolved it, defaults included
        label = f"alpha {hp.distill_alpha:g}" + (f", tau {hp.distill_tau:g}" if hp.distillation == "soft" else "")
        rows.append(run(f"student, {hp.distillation} distillation ({label})", distilled, data, epochs, args.quick))

    saved = out / "rows"
    saved.mkdir(exist_ok=True)
    for r in rows:
        row = {**r, "seed": args.seed, "quick": args.quick}
        (saved / f"{re.sub(r'[^a-z0-9.]+', '_', r['name'])}.json").write_text(json.dumps(row))
    rows = [json.loads(f.read_text()) for f in sorted(saved.glob("*.json"))]
    rows.sort(key=lambda r: (0 if r["name"].startswith("teacher") else 1 if "no distillation" in r["name"] else 2, r["name"]))
    print("\n| model | seed | val top-1 | epochs | train s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r.get('seed', '?')} | {100 * r['val_acc1']:.2f}% | {r['epochs']} | {r['train_wall_s']:.0f} |")
    plain = next((r for r in rows if r["name"] == "student, no distillation"), None)
    gains = {}
    quick = " [quick run: not a measurement]" if any(r.get("quick") for r in rows) else ""
    for r in (r for r in rows if plain is not None and "distillation (" in r["name"]):
        if (r["epochs"], r.get("seed")) != (plain["epochs"], plain.get("seed")):  # a row left by another run
            print(f"{r['name']}: not compared (its epochs/seed differ from the plain row's; use one --out per budget)")
            continue
        gains[r["name"]] = 100 * (r["val_acc1"] - plain["val_acc1"])
        print(f"{r['name']}: {gains[r['name']]:+.2f} points over no distillation (target +2.00){quick}")
    (out / "results.json").write_text(json.dumps({"rows": rows, "gain_points": gains, "quick": args.quick}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
