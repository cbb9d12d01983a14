"""The sweep's report: a text table, `resolution.json`, and top-1 against size as a figure (PNG and
the run's TensorBoard)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vitlab.analysis.plots import plot_resolution, save_figure
from vitlab.analysis.resolution.sweep import Row


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


def to_tensorboard(run: Path, rows: Sequence[Row], title: str, step: int) -> None:
    """The figure into the run's TensorBoard events (the run folder itself, or the `tensorboard/` folder
of runs written before), when it has any."""
    tb = next((d for d in (run / "tensorboard", run) if any(d.glob("events.out.tfevents.*"))), None)
    if tb is None:
        return
    from torch.utils.tensorboard import SummaryWriter  # tensorboard is a dependency

    with SummaryWriter(log_dir=str(tb)) as writer:
        writer.add_figure("val/top1_vs_test_size", figure(rows, title), global_step=step)
