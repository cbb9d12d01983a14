"""Does pretraining pay? Imagenette accuracy from scratch vs after Tiny-ImageNet pretraining.

Runs, through the real CLI (`vitlab fit`, one subprocess at a time), on the held-out tenth of
Imagenette's train split:

    scratch, fine-tune budget    recipes/pretrain/imagenette_scratch_cpu.yaml for the fine-tune's epochs
    scratch, whole budget        the same recipe as written: pretraining + fine-tune wall-clock together
    pretraining (stage 1)        recipes/pretrain/tinyimagenet_vit_cpu.yaml (its own Tiny-ImageNet val)
    transfer at 32px             the fine-tune recipe at the pretraining resolution, same wall-clock
    transfer at 64px             recipes/finetune/imagenette_72px_cpu.yaml at 64px (FINETUNE_SIZE)
    (--mpp) MPP pretraining      recipes/pretrain/tinyimagenet_mpp_cpu.yaml (labels unused), then the 64px fine-tune
    (--progressive) progressive  the pretraining recipe with data.img_size_schedule 16 -> 24 -> 32 px for
                                 PROGRESSIVE_EPOCHS (the fixed recipe's 8, at ~0.6 of its cost), then the 64px fine-tune
    (--patch) patch size         the pretraining recipe with a patch stem (patch 4 at 32px: 64 tokens), then
                                 the 64px fine-tune twice: patch 4 -> 8, kernel PI-resized (64 tokens, the
                                 pretraining's count), and patch 4 kept (256 tokens): accuracy against minutes

Budgets are contracts in epochs (machines differ 2x in speed and are shared): PRETRAIN_EPOCHS and
FINETUNE_EPOCHS (8 + 8, at a fixed 32px: the budget the recorded figures were measured at; the main-job
recipes have since moved to progressive 18 epochs + 10 at 72px), and FINETUNE_32_EPOCHS for the 32px fine-tune.
Where two rows must have the same wall-clock, a calibration in this one process checks the contract:
training steps of the recipes' model at each resolution, timed in alternating rounds (each keeps its
fastest), give the cost of a pretraining epoch in fine-tune epochs and the epochs a 32px fine-tune gets
for the 64px one's time; both are printed beside the contract. Minutes are measured and printed with the
load average.

    python bench/bench_transfer.py                 # ~2 h on 2 idle cores
    python bench/bench_transfer.py --reuse         # keep finished runs under --out
    python bench/bench_transfer.py --quick         # smoke run: a few steps each
    python bench/bench_transfer.py --mpp           # also masked patch prediction pretraining, same budgets
    python bench/bench_transfer.py --progressive   # also progressive-resize pretraining (+~20 min)
    python bench/bench_transfer.py --patch         # also the patch-size pair (+~70 min)
    python bench/bench_transfer.py --no-scratch --no-32px --progressive   # progressive vs fixed only (~50 min)
    python bench/bench_transfer.py --no-scratch --no-fixed --patch        # the patch-size pair alone (~70 min)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import column, fit, fmt_acc, metrics, shown  # noqa: E402
from common import train_step_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared/data"
PRETRAIN = ROOT / "recipes/pretrain/tinyimagenet_vit_cpu.yaml"
FINETUNE = ROOT / "recipes/finetune/imagenette_72px_cpu.yaml"
SCRATCH = ROOT / "recipes/pretrain/imagenette_scratch_cpu.yaml"
MPP = ROOT / "recipes/pretrain/tinyimagenet_mpp_cpu.yaml"
# The bench's own budgets (see the docstring); the pretraining rows train at a fixed size unless they say otherwise.
PRETRAIN_EPOCHS = FINETUNE_EPOCHS = 8
FIXED_SIZE = ["--data.img_size_schedule=null"]
# The fine-tune rows run at 64px, twice the pretraining size, where the recorded figures are; the main-job
# recipe has since moved to 72px (bench/README.md, main-job levers).
FINETUNE_SIZE = 64
# A 32px step costs about 1/2.75 of a 64px one (calibration below), so the 64px fine-tune's 8 epochs buy 22.
FINETUNE_32_EPOCHS = 22
# Progressive resizing: the fixed recipe's 8 epochs, 3 at 16 px, 3 at 24 and 2 at 32, at about 0.6 of its
# cost (the calibration prints it on this machine); the target is the same accuracy in <= 0.7x the time.
PROGRESSIVE_SCHEDULE = [[0, 16], [3, 24], [6, 32]]
PROGRESSIVE_EPOCHS = 8
# The patch-size pair: a patch-stem model (no conv stem, whose stride is not a kernel to resize).
PATCH_STEM = ["--model.model_args.stem=patch", "--model.model_args.patch_size=4"]


@dataclass
class Row:
    name: str
    recipe: str
    epochs: int
    minutes: float
    images_per_sec: float
    val_acc1: float | None
    best_acc1: float | None
    load: float
    run_dir: str


def recipe(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def calibrate(steps: int, rounds: int, n_pretrain: int, n_finetune: int, progressive: bool = False) -> dict[str, float]:
    """Per-image costs at 32px and 64px (and the progressive schedule's sizes), alternating; the ratios
    the budgets are made of."""
    pre, ft = recipe(PRETRAIN), recipe(FINETUNE)
    args, batch = pre["model"]["model_args"], int(ft["data"]["init_args"]["batch_size"])
    sizes = {32, 64} | ({s for _, s in PROGRESSIVE_SCHEDULE} if progressive else set())
    best = dict.fromkeys(sorted(sizes), float("inf"))
    for _ in range(rounds):
        for size in best:
            best[size] = min(best[size], train_step_seconds(args, size, 10, batch, steps) / batch)
    epoch_pre, epoch_ft = n_pretrain * best[32], n_finetune * best[64]
    out = {f"s_per_image_{s}": t for s, t in best.items()}
    out.update(pretrain_epoch_in_finetune_epochs=epoch_pre / epoch_ft, finetune_32_epoch_ratio=best[64] / best[32])
    if progressive:  # the schedule's cost in 32px epochs
        starts = [e for e, _ in PROGRESSIVE_SCHEDULE] + [PROGRESSIVE_EPOCHS]
        out["progressive_in_32px_epochs"] = sum(
            (b - a) * best[s] / best[32] for (a, s), b in zip(PROGRESSIVE_SCHEDULE, starts[1:])
        )
    return out


def finished(run_dir: Path, epochs: int) -> bool:
    try:
        acc = [r for r in metrics(run_dir) if r.get("val/acc1")]
    except SystemExit:
        return False
    return (run_dir / "checkpoints/last.ckpt").is_file() and bool(acc) and int(acc[-1]["epoch"]) == epochs - 1


def run(name: str, path: Path, data: str, out: Path, epochs: int, n_train: int, extra: list[str], reuse: bool) -> Row:
    run_dir = out / name
    load = os.getloadavg()[0]
    if reuse and finished(run_dir, epochs):
        # a finished run: its wall-clock is the time from the resolved config to the last checkpoint
        wall = (run_dir / "checkpoints/last.ckpt").stat().st_mtime - (run_dir / "config.yaml").stat().st_mtime
        print(f"[{name}] reusing {shown(run_dir)}", flush=True)
    else:
        print(f"[{name}] {shown(path)}, {epochs} epochs {' '.join(extra)}", flush=True)
        wall = fit(path, data, run_dir, [f"--trainer.max_epochs={epochs}", *extra], out / f"{name}.log")
        load = (load + os.getloadavg()[0]) / 2
    acc = column(metrics(run_dir), "val/acc1")
    row = Row(name, shown(path), epochs, wall / 60, n_train * epochs / wall, acc[-1] if acc else None,
              max(acc) if acc else None, load, shown(run_dir))  # fmt: skip
    print(f"[{name}] {row.minutes:.1f} min, val/acc1 {fmt_acc(row.val_acc1)}", flush=True)
    return row


def table(rows: list[Row]) -> str:
    lines = [f"{'run':30s} {'epochs':>6s} {'minutes':>8s} {'img/s':>6s} {'load':>5s} {'val acc1':>9s} {'best':>8s}"]
    for r in rows:
        lines.append(f"{r.name:30s} {r.epochs:6d} {r.minutes:8.1f} {r.images_per_sec:6.0f} {r.load:5.1f} "
                     f"{fmt_acc(r.val_acc1):>9s} {fmt_acc(r.best_acc1):>8s}")  # fmt: skip
    return "\n".join(lines)


def gains(rows: dict[str, Row]) -> list[str]:
    def diff(a: str, b: str) -> str:
        if a not in rows or b not in rows:  # a row left out (--no-fixed)
            return "-"
        x, y = rows[a].val_acc1, rows[b].val_acc1
        return "-" if x is None or y is None else f"{100 * (x - y):+.1f} points"

    out = []
    if "transfer@32px" in rows:
        out.append(f"transfer@64 vs transfer@32 (same budget):  {diff('transfer@64px', 'transfer@32px')} (target >= +2)")
    if "scratch, whole budget" in rows:
        out += [
            f"transfer@64 vs scratch (fine-tune budget): {diff('transfer@64px', 'scratch, fine-tune budget')} (target >= +10)",
            f"transfer@64 vs scratch (whole budget):     {diff('transfer@64px', 'scratch, whole budget')} (target >= 0)",
        ]
    if "progressive transfer@64px" in rows:
        out.append(f"progressive vs fixed 32px pretraining:      {diff('progressive transfer@64px', 'transfer@64px')}")
    if "patch 4 transfer@64px" in rows:
        a, b = rows["patch 4->8 transfer@64px"], rows["patch 4 transfer@64px"]
        out.append(f"patch 4->8 (64 tokens) vs patch 4 (256 tokens): {diff(a.name, b.name)}, "
                   f"{a.minutes:.1f} vs {b.minutes:.1f} min ({b.minutes / max(a.minutes, 1e-9):.1f}x)")
    if "MPP transfer@64px" in rows:
        out.append(f"MPP transfer vs supervised transfer:        {diff('MPP transfer@64px', 'transfer@64px')}")
    if "MPP transfer@64px" in rows and "scratch, fine-tune budget" in rows:
        out.append(f"MPP transfer vs scratch (fine-tune budget): {diff('MPP transfer@64px', 'scratch, fine-tune budget')} "
                   "(target >= +3)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrain-data", default=str(SHARED / "tinyimagenet-200-shards"))
    p.add_argument("--finetune-data", default=str(SHARED / "imagenette-128-shards"))
    p.add_argument("--out", type=Path, default=ROOT / "runs/bench-transfer")
    p.add_argument("--reuse", action="store_true", help="keep runs under --out that finished their epochs")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 train and 2 val batches per epoch, 1-2 epochs")
    p.add_argument("--mpp", action="store_true", help="also masked patch prediction pretraining + the same fine-tune")
    p.add_argument("--progressive", action="store_true",
                   help="also progressive-resize pretraining (16 -> 24 -> 32 px) + the same fine-tune")
    p.add_argument("--patch", action="store_true",
                   help="also a patch-4 pretraining and its 64px fine-tune at patch 8 (PI-resized) and at patch 4")
    p.add_argument("--no-scratch", action="store_true", help="leave out the two from-scratch rows")
    p.add_argument("--no-32px", action="store_true", help="leave out the 32px transfer row")
    p.add_argument("--no-fixed", action="store_true",
                   help="leave out the fixed 32px pretraining and its transfer rows (for --patch or --mpp alone)")
    p.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    if args.no_fixed and args.progressive:
        p.error("--progressive is measured against the fixed pretraining; drop --no-fixed")
    for d in (args.pretrain_data, args.finetune_data):
        if not Path(d).is_dir():
            raise SystemExit(
                f"{d} is not a folder; see ../shared/data/README.md (or pass --pretrain-data/--finetune-data)"
            )
    pre_data, ft_data = str(Path(args.pretrain_data).resolve()), str(Path(args.finetune_data).resolve())
    args.out.mkdir(parents=True, exist_ok=True)

    from vitlab.data import ShardDataModule

    # Train-split sizes, for images/s and the epoch-cost ratio.
    vf = recipe(FINETUNE)["data"]["init_args"]["val_fraction"]
    n_ft = len(ShardDataModule(f"{ft_data}/train", val_fraction=vf, auto_augment=None).dataset("train", decode=False))
    n_pre = len(ShardDataModule(f"{pre_data}/train", val_shards=f"{pre_data}/val", auto_augment=None).dataset(
        "train", decode=False))  # fmt: skip

    e_pre, e_ft = PRETRAIN_EPOCHS, FINETUNE_EPOCHS
    e_whole = recipe(SCRATCH)["trainer"]["max_epochs"]
    cal = calibrate(3 if args.quick else 8, 1 if args.quick else 3, n_pre, n_ft, args.progressive)
    e_32 = FINETUNE_32_EPOCHS
    equiv = e_ft + e_pre * cal["pretrain_epoch_in_finetune_epochs"]
    print(f"calibration: {cal['s_per_image_32'] * 1e3:.2f} ms/image at 32px, {cal['s_per_image_64'] * 1e3:.2f} at 64px;"
          f" a pretraining epoch costs {cal['pretrain_epoch_in_finetune_epochs']:.2f} fine-tune epochs, so"
          f" pretraining + fine-tune = {equiv:.1f} scratch epochs (contract: {e_whole}); the 64px fine-tune's"
          f" {e_ft} epochs buy {e_ft * cal['finetune_32_epoch_ratio']:.1f} at 32px (contract: {e_32})",
          flush=True)  # fmt: skip
    if args.progressive:
        print(f"calibration: progressive pretraining, {PROGRESSIVE_EPOCHS} epochs {PROGRESSIVE_SCHEDULE}, costs "
              f"{cal['progressive_in_32px_epochs']:.1f} epochs at 32px (the fixed recipe: {e_pre})", flush=True)

    quick = ["--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2"] if args.quick else []
    if args.quick:
        e_pre = e_ft = e_whole = e_32 = 1
    pre_ckpt, mpp_ckpt = (args.out / name / "checkpoints/last.ckpt" for name in ("pretrain", "pretrain-mpp"))
    scratch = [] if args.no_scratch else [
        ("scratch, fine-tune budget", "scratch-short", SCRATCH, ft_data, e_ft, n_ft, []),
        ("scratch, whole budget", "scratch-long", SCRATCH, ft_data, e_whole, n_ft, []),
    ]  # fmt: skip
    fixed = [] if args.no_fixed else [
        ("pretrain (Tiny-ImageNet)", "pretrain", PRETRAIN, pre_data, e_pre, n_pre, FIXED_SIZE),
        *([] if args.no_32px else [("transfer@32px", "finetune-32px", FINETUNE, ft_data, e_32, n_ft,
                                    ["--data.img_size=32", f"--model.init_from={pre_ckpt}"])]),
        ("transfer@64px", "finetune-64px", FINETUNE, ft_data, e_ft, n_ft, [f"--model.init_from={pre_ckpt}"]),
    ]  # fmt: skip
    plan = [*scratch, *fixed]  # (row, run folder, recipe, data, epochs, train images, extra flags)
    if args.progressive:
        e_prog = 1 if args.quick else PROGRESSIVE_EPOCHS
        prog_ckpt = args.out / "pretrain-progressive/checkpoints/last.ckpt"
        schedule = f"--data.img_size_schedule={json.dumps(PROGRESSIVE_SCHEDULE)}"
        plan += [
            ("pretrain progressive 16->32", "pretrain-progressive", PRETRAIN, pre_data, e_prog, n_pre, [schedule]),
            ("progressive transfer@64px", "finetune-progressive-64px", FINETUNE, ft_data, e_ft, n_ft,
             [f"--model.init_from={prog_ckpt}"]),
        ]  # fmt: skip
    if args.patch:
        patch_ckpt = args.out / "pretrain-patch4/checkpoints/last.ckpt"
        ft_patch = [f"--model.init_from={patch_ckpt}", PATCH_STEM[0]]
        plan += [
            ("pretrain patch 4 (64 tokens)", "pretrain-patch4", PRETRAIN, pre_data, e_pre, n_pre,
             [*PATCH_STEM, *FIXED_SIZE]),
            ("patch 4->8 transfer@64px", "finetune-patch8-64px", FINETUNE, ft_data, e_ft, n_ft,
             [*ft_patch, "--model.model_args.patch_size=8"]),
            ("patch 4 transfer@64px", "finetune-patch4-64px", FINETUNE, ft_data, e_ft, n_ft,
             [*ft_patch, "--model.model_args.patch_size=4"]),
        ]  # fmt: skip
    if args.mpp:
        e_mpp = 1 if args.quick else recipe(MPP)["trainer"]["max_epochs"]
        plan += [
            ("pretrain MPP (no labels)", "pretrain-mpp", MPP, pre_data, e_mpp, n_pre, []),
            ("MPP transfer@64px", "finetune-mpp-64px", FINETUNE, ft_data, e_ft, n_ft, [f"--model.init_from={mpp_ckpt}"]),
        ]  # fmt: skip
    rows = {}
    for label, folder, path, data, epochs, n, extra in plan:
        if path == FINETUNE:  # a later --data.img_size (the 32px row's) wins
            extra = [f"--data.img_size={FINETUNE_SIZE}", *extra]
        row = run(folder, path, data, args.out, epochs, n, [*extra, *quick], args.reuse)
        rows[label] = Row(**{**asdict(row), "name": label})
    print()
    print(table(list(rows.values())))
    for line in gains(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"calibration": cal, "rows": [asdict(r) for r in rows.values()]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
