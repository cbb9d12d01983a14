"""`vitlab resolution`'s command line."""

from __future__ import annotations

import argparse
from pathlib import Path

from vitlab.analysis.resolution.choose import record_choice
from vitlab.analysis.resolution.finetune import finetune_report, limit_line
from vitlab.analysis.resolution.report import format_table, write_report
from vitlab.analysis.resolution.sweep import Row, label_of, sweep


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 32,48,64, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, e.g. 32,48,64, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    from vitlab.analysis import resolution

    p = argparse.ArgumentParser(prog="vitlab resolution", description=(resolution.__doc__ or "").split("\n\n")[0])
    p.add_argument("--ckpt", action="append", default=[], help="checkpoint (repeat for several curves)")
    p.add_argument("--data", action="append", default=[],
                   help="data as --data_path takes it: once for all checkpoints or once per --ckpt; "
                        "default: the data each checkpoint was trained on")  # fmt: skip
    p.add_argument("--sizes", type=_ints, help="test sizes, e.g. 32,48,64,96,128")
    p.add_argument("--patch-sizes", type=_ints, default=None,
                   help="patch sizes to PI-resize the kernel to (stem='patch'); "
                        "default: the checkpoint's own")  # fmt: skip
    p.add_argument("--out", default=None, help="output folder (default: <run>/resolution beside the first checkpoint)")
    p.add_argument("--run", default=None, help="a fine-tune run folder: score its source and itself around both sizes")
    p.add_argument("--batch-size", type=int, default=None, help="evaluation batch (default: the recorded one)")
    p.add_argument("--num-workers", type=int, default=None, help="loader workers (default: the recorded number)")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--limit-batches", type=int, default=None,
                   help="score only the first N batches of each size (default with --run: the run's "
                        "trainer.limit_val_batches)")  # fmt: skip
    p.add_argument("--record", action=argparse.BooleanOptionalAction, default=None,
                   help="write each Lightning checkpoint's best validation size into it as its test size "
                        "(default: with --run, the fine-tuned checkpoint; with --ckpt, not)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    common = dict(accelerator=args.accelerator, precision=args.precision, limit_batches=args.limit_batches)
    if args.run:
        for path in finetune_report(args.run, record=args.record is not False, **common):
            print(path)
        return 0
    if not args.ckpt or not args.sizes:
        parser.error("give --ckpt and --sizes (or --run RUN_DIR)")
    if len(args.data) > 1 and len(args.data) != len(args.ckpt):
        parser.error(f"{len(args.data)} --data for {len(args.ckpt)} --ckpt: give one for all or one per checkpoint")
    datas = args.data if len(args.data) > 1 else (args.data or [None]) * len(args.ckpt)
    overrides = {k: v for k, v in (("batch_size", args.batch_size), ("num_workers", args.num_workers)) if v is not None}
    print(limit_line(args.limit_batches, True))
    rows: list[Row] = []
    chosen: list[str] = []
    labels = [label_of(c) for c in args.ckpt]
    for ckpt, data, label in zip(args.ckpt, datas, labels, strict=True):
        unique = label if labels.count(label) == 1 else str(ckpt)
        got = sweep(ckpt, data, args.sizes, args.patch_sizes or [None], label=unique, **common, **overrides)
        rows += got
        if args.record and Path(ckpt).suffix == ".ckpt" and (line := record_choice(got, ckpt)):
            chosen.append(line)
    print(format_table(rows))
    print(*chosen, sep="\n")
    first = Path(args.ckpt[0])
    out = args.out or (first.parent.parent / "resolution" if first.parent.name == "checkpoints" else Path("resolution"))
    for path in write_report(rows, out, "top-1 against test size"):
        print(path)
    return 0
