"""`vitlab resolution --run RUN` (the end of `make finetune`): the pretrained source and the fine-tuned
model around both sizes, within the run's own `limit_val_batches`, and the fine-tuned checkpoint's
test size chosen and recorded."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitlab.analysis.resolution.choose import choose_test_size, record_choice
from vitlab.analysis.resolution.data import recorded
from vitlab.analysis.resolution.report import format_table, to_tensorboard, write_report
from vitlab.analysis.resolution.score import Limit
from vitlab.analysis.resolution.sweep import Row, around, sweep
from vitlab.errors import UserError
from vitlab.train.run.loggers import log_test_size


def run_limit(run_dir: str | Path) -> Limit:
    """The run's `trainer.limit_val_batches` from its `config.yaml`; None when unset, all, or no config."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    limit = ((yaml.safe_load(path.read_text()) or {}).get("trainer") or {}).get("limit_val_batches")
    return None if limit is None or (isinstance(limit, float) and limit >= 1.0) else limit


def limit_line(limit: Limit, given: bool) -> str:
    """What the sweep scores at each size, in one line."""
    if limit is None:
        return "vitlab resolution: every validation batch at each size (--limit-batches N bounds it)"
    what = f"the first {limit} validation batches" if isinstance(limit, int) else f"{limit:.0%} of the validation batches"
    why = "--limit-batches" if given else "the run's trainer.limit_val_batches"
    return f"vitlab resolution: {what} at each size ({why})"


def finetune_report(
    run_dir: str | Path,
    *,
    accelerator: str = "auto",
    precision: str = "32-true",
    limit_batches: Limit = None,
    record: bool = True,
) -> tuple[Path, Path]:
    """For the end of `make finetune`: the pretrained source (on its own data) and the fine-tuned model
    (on the fine-tune data) at the pretraining size, the fine-tune size, their midpoint and a size below
    and above, each over the run's `limit_val_batches` unless `limit_batches` is given;
    `run_dir/resolution/resolution.{json,png}`, the figure in the run's TensorBoard, and (`record`) the
    fine-tuned model's best size written into `checkpoints/last.ckpt` as its test size, and onto the
    run's dashboard row."""
    run = Path(run_dir)
    ckpt = run / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise FileNotFoundError(f"{ckpt} not found; run `make finetune` first (or pass the run folder with --run)")
    limit = limit_batches if limit_batches is not None else run_limit(run)
    print(limit_line(limit, limit_batches is not None))
    rec = recorded(ckpt)
    source = (rec.get("hyper_parameters") or {}).get("init_from")
    model_cfg = (rec.get("vitlab") or {}).get("model_config") or {}
    ft_size, patch = _side(model_cfg.get("img_size")), int(model_cfg.get("patch_size") or 1)
    source_cfg = ((recorded(source).get("vitlab") or {}).get("model_config") or {}) if source else {}
    pre_size = _side(source_cfg.get("img_size"))
    sizes = around([s for s in (pre_size, ft_size) if s], patch)
    rows: list[Row] = []
    tuned: list[Row] = []
    for path, label, trained in ((source, "pretrained source", pre_size), (str(ckpt), "fine-tuned", ft_size)):
        if not path:
            continue
        try:
            got = sweep(path, None, sizes, label=label, accelerator=accelerator, precision=precision,
                        limit_batches=limit)  # fmt: skip
        except (OSError, ValueError, UserError, SystemExit) as e:  # e.g. the source's data moved: keep the other
            got = [Row(label, str(path), "", sizes[0], patch, trained or 0, patch, skipped=f"not scored: {e}")]
        rows += got
        if path == str(ckpt):
            tuned = got
    print(format_table(rows))
    title = f"{run.name}: top-1 against test size (pretrained at {pre_size or '?'}, fine-tuned at {ft_size})"
    paths = write_report(rows, run / "resolution", title)
    to_tensorboard(run, rows, title, int(rec.get("global_step") or 0))
    if record and (line := record_choice(tuned, ckpt)):
        print(line)
        chosen = choose_test_size(tuned)
        log_test_size(run, chosen.img_size, chosen.acc1, int(rec.get("global_step") or 0))  # the dashboard row
    return paths


def _side(img_size: Any) -> int | None:
    if img_size is None:
        return None
    return int(img_size[0]) if isinstance(img_size, Sequence) else int(img_size)
