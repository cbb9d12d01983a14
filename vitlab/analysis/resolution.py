"""Accuracy against test resolution: `vitlab resolution`.

The paper's central move is a change of resolution between pretraining and fine-tuning (section 3.2);
this shows what resolution does to a trained model. Each checkpoint is scored on its data's
validation split at every test size, its position embeddings resampled in memory to the new token
grid (and, with `--patch-sizes`, its patch kernel PI-resized), no training. The data module is the
one `vitlab validate` builds (the checkpoint's recorded data settings, `--data` as `--data_path`,
`img_size` set to the test size), so a row's top-1 is what `vitlab validate --data.img_size=S` gives.

    vitlab resolution --ckpt runs/finetune/checkpoints/last.ckpt --sizes 32,48,64,96,128
    vitlab resolution --ckpt A.ckpt --data DATA_A --ckpt B.ckpt --data DATA_B --sizes 32,64 --out figs
    vitlab resolution --run runs/finetune      # after `make finetune`: the source and the fine-tuned model
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from vitlab.analysis.plots import plot_resolution, save_figure
from vitlab.errors import UserError
from vitlab.models import VisionTransformer
from vitlab.recipe import data_module, import_class, init_params

# Preprocessing keys a model's data_config shares with the data modules' constructor arguments.
_PREPROCESSING = ("mean", "std", "interpolation", "crop_pct")


@dataclass
class Row:
    """One (checkpoint, test size, patch size): top-1 and NLL on the validation split, or why not."""

    label: str
    ckpt: str
    data: str
    img_size: int
    patch_size: int
    trained_img_size: int
    trained_patch_size: int
    grid: str = ""
    acc1: float | None = None
    loss: float | None = None
    images: int = 0
    skipped: str = ""


# ---- the data `vitlab validate` would build ----------------------------------------------------------


def _recorded(ckpt: str | Path) -> dict[str, Any]:
    """What a Lightning checkpoint records besides the weights (data module and module hyperparameters);
    empty for other formats. mmap: only the small metadata is read."""
    p = Path(ckpt)
    if p.suffix != ".ckpt" or not p.is_file():
        return {}
    obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    keys = ("datamodule_hyper_parameters", "hyper_parameters", "vitlab", "global_step")
    return {k: obj[k] for k in keys if k in obj}


def datamodule_for(
    model: VisionTransformer, recorded: Mapping[str, Any], data: str | None, img_size: int, **overrides: Any
) -> L.LightningDataModule:
    """The validation data of a checkpoint at `img_size`: its recorded data module (class and arguments,
    as `vitlab fit` saved them), located at `data` when given (as `--data_path` would), preprocessing
    from the model's `data_config` where nothing is recorded."""
    hp = dict(recorded.get("datamodule_hyper_parameters") or {})
    class_path = hp.pop("_class_path", None)
    args = {k: v for k, v in model.data_config.items() if k in _PREPROCESSING}
    args.update({k: v for k, v in hp.items() if not k.startswith("_")})
    if data is not None:
        new_class, location = data_module(data)  # as `--data_path DATA` would
        if new_class != class_path:  # another reader: keep the settings it also takes (preprocessing, batch)
            args = {k: v for k, v in args.items() if k in init_params(import_class(new_class, "data"))}
        class_path = new_class
        args.update(location)
    if class_path is None:
        raise ValueError("the checkpoint records no data module (it was not trained by `vitlab fit`); pass --data DATA")
    cls = import_class(class_path, "data")
    # A progressive-resize run records its schedule; it ends at the training size, not the test size.
    args.pop("img_size_schedule", None)
    args["img_size"] = img_size
    if "in_memory" in init_params(cls):
        # Streaming validation gives the in-memory path's batches (vitlab.data.memory), without decoding
        # the train split for every size.
        args["in_memory"] = False
    args.update(overrides)
    return cls(**{k: v for k, v in args.items() if k in init_params(cls)})


# ---- scoring --------------------------------------------------------------------------------------


class _Scorer(L.LightningModule):
    """Top-1 (micro, as ViTClassifier's val/acc1) and NLL (its val/loss) of a model over a loader."""

    def __init__(self, model: VisionTransformer) -> None:
        super().__init__()
        self.model = model
        self.acc1 = MulticlassAccuracy(model.num_classes, top_k=1, average="micro")
        self.nll = MeanMetric()
        self.images = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        from vitlab.data.batch import split_batch

        x, y = split_batch(batch)
        logits = self.model(x)
        hard = y.argmax(dim=1) if y.ndim == 2 else y
        self.acc1.update(logits, hard)
        self.nll.update(F.cross_entropy(logits.float(), hard), x.shape[0])
        self.images += x.shape[0]


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """No "GPU available..." banner for every size's Trainer."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def score(
    model: VisionTransformer,
    datamodule: L.LightningDataModule,
    accelerator: str = "auto",
    precision: str = "32-true",
    limit_batches: int | None = None,
) -> tuple[float, float, int]:
    """(top-1, NLL, images) of `model` on `datamodule`'s validation split, through `Trainer.validate`
    (the same hooks and device transfer as `vitlab validate`)."""
    if datamodule.num_classes != model.num_classes:
        raise ValueError(
            f"the data has {datamodule.num_classes} classes but the checkpoint's head {model.num_classes}; "
            "score each checkpoint on its own data (--data once per --ckpt)"
        )
    names = model.data_config.get("class_names")
    if names and list(names) != list(datamodule.class_names):
        raise ValueError("the data's class names differ from the checkpoint's (another class order?); "
                         "score each checkpoint on the data it was trained on")  # fmt: skip
    scorer = _Scorer(model)
    with _quiet_lightning():
        trainer = L.Trainer(
            accelerator=accelerator, devices=1, precision=precision, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, limit_val_batches=limit_batches,
        )  # fmt: skip
        trainer.validate(scorer, datamodule=datamodule, verbose=False)
    return float(scorer.acc1.compute()), float(scorer.nll.compute()), scorer.images


# ---- the sweep ------------------------------------------------------------------------------------


def _label(ckpt: str) -> str:
    p = Path(ckpt)
    return f"{p.parent.parent.name}/{p.name}" if p.parent.name == "checkpoints" else p.name


def sweep(
    ckpt: str,
    data: str | None,
    sizes: Sequence[int],
    patch_sizes: Sequence[int | None] = (None,),
    *,
    label: str | None = None,
    accelerator: str = "auto",
    precision: str = "32-true",
    limit_batches: int | None = None,
    **data_overrides: Any,
) -> list[Row]:
    """Score `ckpt` at every (size, patch size); `None` is the checkpoint's own patch size. Each model is
    resampled from the checkpoint's weights (never from another size's). A size the model cannot take
    (not a multiple of the patch size, a tokenizer whose patch size is not a kernel) gives a skipped row."""
    from vitlab.interop import load_pretrained

    base = load_pretrained(ckpt)
    recorded = _recorded(ckpt)
    own_size, own_patch = base.patch_embed.img_size[0], base.patch_embed.patch_size
    rows = []
    for patch in patch_sizes:
        for size in sizes:
            row = Row(label or _label(ckpt), str(ckpt), str(data or _data_name(recorded)), size, patch or own_patch,
                      own_size, own_patch)  # fmt: skip
            rows.append(row)
            model = copy.deepcopy(base)
            try:
                model.set_image_size(size, patch_size=patch)
            except ValueError as e:
                row.skipped = str(e)
                continue
            row.grid = "x".join(map(str, model.patch_embed.grid_size))
            dm = datamodule_for(model, recorded, data, size, **data_overrides)
            row.acc1, row.loss, row.images = score(model, dm, accelerator, precision, limit_batches)
    return rows


def _data_name(recorded: Mapping[str, Any]) -> str:
    hp = recorded.get("datamodule_hyper_parameters") or {}
    where = [str(hp[k]) for k in ("root", "train_shards", "val_shards", "path", "variant") if hp.get(k)]
    return ", ".join(where) or "recorded"


def format_table(rows: Sequence[Row]) -> str:
    lines = [f"{'checkpoint':<28} {'size':>5} {'patch':>5} {'grid':>6} {'top-1':>7} {'loss':>7} {'images':>7}"]
    for r in rows:
        mark = "*" if (r.img_size, r.patch_size) == (r.trained_img_size, r.trained_patch_size) else " "
        head = f"{r.label[-28:]:<28} {r.img_size:>4}{mark} {r.patch_size:>5} "
        if r.skipped:
            lines.append(f"{head}{'-':>6} skipped: {r.skipped}")
        else:
            lines.append(f"{head}{r.grid:>6} {100 * r.acc1:>6.2f}% {r.loss:>7.4f} {r.images:>7}")
    lines.append("* the size (and patch size) the checkpoint was trained at")
    return "\n".join(lines)


def write_report(rows: Sequence[Row], out_dir: str | Path, title: str | None = None) -> tuple[Path, Path]:
    """`resolution.json` (every row) and `resolution.png` (top-1 against size, one curve per checkpoint
    and patch size) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "resolution.json"
    json_path.write_text(json.dumps({"rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    png = save_figure(figure(rows, title), out / "resolution.png")
    return json_path, png


def figure(rows: Sequence[Row], title: str | None = None) -> Any:
    curves: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        curves.setdefault((r.label, r.patch_size), []).append(r)
    several_patches = len({p for _, p in curves}) > 1
    series = []
    for (label, patch), rs in curves.items():
        done = sorted((r for r in rs if r.acc1 is not None), key=lambda r: r.img_size)
        name = f"{label}, patch {patch}" if several_patches else label
        trained = rs[0].trained_img_size if patch == rs[0].trained_patch_size else None
        series.append((name, [r.img_size for r in done], [r.acc1 for r in done], trained))
    return plot_resolution(series, title=title)


# ---- after `make finetune` ------------------------------------------------------------------------


def around(sizes: Sequence[int], patch: int) -> list[int]:
    """`sizes`, the midpoint of the two outer ones, a size below and one above them (a quarter of the
    smallest / largest beyond), all rounded to multiples of `patch`."""
    lo, hi = min(sizes), max(sizes)
    snap = lambda s: max(patch, round(s / patch) * patch)
    return sorted({snap(s) for s in (*sizes, (lo + hi) / 2, lo * 0.75, hi * 1.25)})


def finetune_report(
    run_dir: str | Path, *, accelerator: str = "auto", precision: str = "32-true", limit_batches: int | None = None
) -> tuple[Path, Path]:
    """For the end of `make finetune`: the pretrained source (on its own data) and the fine-tuned model
    (on the fine-tune data) at the pretraining size, the fine-tune size, their midpoint and a size below
    and above; `run_dir/resolution/resolution.{json,png}`, and the figure in the run's TensorBoard."""
    run = Path(run_dir)
    ckpt = run / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise FileNotFoundError(f"{ckpt} not found; run `make finetune` first (or pass the run folder with --run)")
    recorded = _recorded(ckpt)
    source = (recorded.get("hyper_parameters") or {}).get("init_from")
    model_cfg = (recorded.get("vitlab") or {}).get("model_config") or {}
    ft_size, patch = _side(model_cfg.get("img_size")), int(model_cfg.get("patch_size") or 1)
    source_cfg = ((_recorded(source).get("vitlab") or {}).get("model_config") or {}) if source else {}
    pre_size = _side(source_cfg.get("img_size"))
    sizes = around([s for s in (pre_size, ft_size) if s], patch)
    rows: list[Row] = []
    for path, label, trained in ((source, "pretrained source", pre_size), (str(ckpt), "fine-tuned", ft_size)):
        if not path:
            continue
        try:
            rows += sweep(
                path, None, sizes, label=label, accelerator=accelerator, precision=precision, limit_batches=limit_batches
            )
        except (OSError, ValueError, UserError, SystemExit) as e:  # e.g. the source's data moved: keep the other
            rows.append(Row(label, str(path), "", sizes[0], patch, trained or 0, patch, skipped=f"not scored: {e}"))
    print(format_table(rows))
    title = f"{run.name}: top-1 against test size (pretrained at {pre_size or '?'}, fine-tuned at {ft_size})"
    paths = write_report(rows, run / "resolution", title)
    _to_tensorboard(run, rows, title, int(recorded.get("global_step") or 0))
    return paths


def _side(img_size: Any) -> int | None:
    if img_size is None:
        return None
    return int(img_size[0]) if isinstance(img_size, Sequence) else int(img_size)


def _to_tensorboard(run: Path, rows: Sequence[Row], title: str, step: int) -> None:
    """The figure into the run's TensorBoard folder (where `vitlab fit` logs), when it has one."""
    tb = run / "tensorboard"
    if not tb.is_dir():
        return
    from torch.utils.tensorboard import SummaryWriter  # tensorboard is a dependency

    with SummaryWriter(log_dir=str(tb)) as writer:
        writer.add_figure("val/top1_vs_test_size", figure(rows, title), global_step=step)


# ---- command line ---------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 32,48,64, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, e.g. 32,48,64, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitlab resolution", description=__doc__.split("\n\n")[0])
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
    p.add_argument("--limit-batches", type=int, default=None, help="score only the first N batches of each size")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    common = dict(accelerator=args.accelerator, precision=args.precision, limit_batches=args.limit_batches)
    if args.run:
        for path in finetune_report(args.run, **common):
            print(path)
        return 0
    if not args.ckpt or not args.sizes:
        parser.error("give --ckpt and --sizes (or --run RUN_DIR)")
    if len(args.data) > 1 and len(args.data) != len(args.ckpt):
        parser.error(f"{len(args.data)} --data for {len(args.ckpt)} --ckpt: give one for all or one per checkpoint")
    datas = args.data if len(args.data) > 1 else (args.data or [None]) * len(args.ckpt)
    overrides = {k: v for k, v in (("batch_size", args.batch_size), ("num_workers", args.num_workers)) if v is not None}
    rows: list[Row] = []
    labels = [_label(c) for c in args.ckpt]
    for ckpt, data, label in zip(args.ckpt, datas, labels, strict=True):
        unique = label if labels.count(label) == 1 else str(ckpt)
        rows += sweep(ckpt, data, args.sizes, args.patch_sizes or [None], label=unique, **common, **overrides)
    print(format_table(rows))
    first = Path(args.ckpt[0])
    out = args.out or (first.parent.parent / "resolution" if first.parent.name == "checkpoints" else Path("resolution"))
    for path in write_report(rows, out, "top-1 against test size"):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
