"""Choosing a checkpoint's test size from its sweep (validation split only) and recording it in the
checkpoint, where predict, explain, export and `load_pretrained` find it (`vitlab.interop.eval_size`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vitlab.analysis.resolution.sweep import Row
from vitlab.interop.eval_size import EvalSize, record_test_size


def choose_test_size(rows: Sequence[Row]) -> Row | None:
    """The best top-1 among one checkpoint's rows at its own patch size (a tie goes to the size nearest
    the trained one, then to the smaller); None when no size was scored."""
    scored = [r for r in rows if r.acc1 is not None and r.patch_size == r.trained_patch_size]
    if not scored:
        return None
    return max(scored, key=lambda r: (r.acc1, -abs(r.img_size - r.trained_img_size), -r.img_size))


def record_choice(rows: Sequence[Row], ckpt: str | Path) -> str | None:
    """Choose among `rows` (all of `ckpt`'s) and record the size into the Lightning checkpoint `ckpt`;
    returns the line that says so, or None when nothing was scored."""
    best = choose_test_size(rows)
    if best is None:
        return None
    trained = next((r for r in rows if r.acc1 is not None and r.patch_size == r.trained_patch_size
                    and r.img_size == r.trained_img_size), None)  # fmt: skip
    crop = 1.0 if best.crop_pct is None else float(best.crop_pct)
    size = best.img_size
    record_test_size(
        ckpt, EvalSize((size, size), crop), split="validation", acc1=best.acc1, loss=best.loss, images=best.images,
        trained_img_size=best.trained_img_size, trained_acc1=None if trained is None else trained.acc1,
    )  # fmt: skip
    against = f"; {100 * trained.acc1:.2f}% at the trained {trained.img_size}" if trained else ""
    return (f"recorded test size {size}x{size} (crop {crop:g}) in {ckpt}: top-1 {100 * best.acc1:.2f}% on "
            f"{best.images} validation images{against}")  # fmt: skip
