"""What every run adds to its recipe, as config entries: `add_run_defaults` writes them into the parsed
config before LightningCLI builds the classes, so `<run_dir>/config.yaml` lists every callback and plugin
that ran, and a rerun of that file adds none twice. Loggers: the `loggers:` key (loggers.py); the
callbacks one objective needs: its `run_callbacks` class attribute."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger("vitlab")

# Appended, in this order, to the recipe's `trainer.callbacks` unless it names the class already.
RUN_CALLBACKS = (
    "vitlab.train.run.loggers.RememberWandbRun",
    "vitlab.train.reliability.end_ranks.EndRanksOnFailure",
    "vitlab.train.reliability.guards.NonFiniteGuard",
    "vitlab.train.reliability.resume.ExactResume",
    "vitlab.train.reliability.redaction.RedactSecrets",
    "vitlab.train.run.callbacks.PerfMonitor",
    "vitlab.train.run.figures.FinetuneSource",
    "vitlab.train.run.img_size_schedule.ImgSizeSchedule",
    "vitlab.train.run.loggers.RunSummary",
    "vitlab.train.reliability.run_dir.RunDirCheck",
)
BEST = "vitlab.train.reliability.last_checkpoint.BestCheckpoint"  # best val/acc1, unless the recipe has a ModelCheckpoint
LAST = "vitlab.train.reliability.last_checkpoint.LastCheckpoint"  # last.ckpt, unless a recipe's ModelCheckpoint writes it
ATOMIC_IO = "vitlab.train.reliability.checkpoint_io.AtomicCheckpointIO"  # unless the recipe's plugins hold a CheckpointIO


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _entries(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def _entry(class_path: str, **given: Any) -> Namespace:
    """A config entry for `class_path`, with every constructor default written out, as jsonargparse writes
    the entries it parsed (so a rerun of config.yaml saves the same file)."""
    params = inspect.signature(_class_of({"class_path": class_path})).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return Namespace(class_path=class_path, init_args=Namespace(**{**defaults, **given}))


def _class_of(entry: Any) -> type | None:
    from vitlab.recipe import import_class

    path = entry.get("class_path") if isinstance(entry, (dict, Namespace)) else None
    return import_class(path, "trainer.callbacks/plugins class_path") if isinstance(path, str) else type(entry)


def add_run_defaults(trainer: Namespace, model_class: type, every_n_train_steps: int | None = None) -> None:
    """Add what every run needs to `trainer` (the parsed `trainer:` section): `RUN_CALLBACKS`, those the
    objective declares (`model_class.run_callbacks`), the best and last checkpoints in `<run_dir>/checkpoints`
    and atomic checkpoint writes. A callback of a class the recipe already has is not added."""
    callbacks = _entries(trainer.get("callbacks"))
    classes = [_class_of(cb) for cb in callbacks]
    wanted = (*RUN_CALLBACKS, *getattr(model_class, "run_callbacks", ()))
    added = [_entry(path) for path in wanted
             if not any(c is not None and issubclass(c, _class_of({"class_path": path})) for c in classes)]
    checkpoints = [(c, cb) for c, cb in zip(classes, callbacks) if c is not None and issubclass(c, ModelCheckpoint)]
    if not any(c.__name__ != "LastCheckpoint" for c, _ in checkpoints):
        added.append(_entry(BEST))
    writes_last = [cb for c, cb in checkpoints if c.__name__ == "LastCheckpoint" or _init_arg(cb, "save_last")]
    if not writes_last:
        added.append(_entry(LAST, every_n_train_steps=every_n_train_steps))
    elif every_n_train_steps and not any(c.__name__ == "LastCheckpoint" for c, _ in checkpoints):
        log.warning(
            "the recipe's ModelCheckpoint writes last.ckpt, so checkpoint_every_n_steps=%d is not applied; "
            "use %s(every_n_train_steps=...) in its place", every_n_train_steps, LAST,
        )  # fmt: skip
    trainer["callbacks"] = callbacks + added
    plugins = _entries(trainer.get("plugins"))
    if not any(isinstance(c, type) and issubclass(c, CheckpointIO) for c in map(_class_of, plugins)):
        trainer["plugins"] = [*plugins, _entry(ATOMIC_IO)]


def _init_arg(entry: Any, key: str) -> Any:
    if isinstance(entry, (dict, Namespace)):
        return (entry.get("init_args") or {}).get(key)
    return getattr(entry, key, None)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (avx512_bf16 or AMX tiles, about 2x float32);
    without them bf16 is emulated and slower than float32. torch's own (private) probe."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_precision(precision: str | int | None, accelerator: Any = "cpu") -> str | int | None:
    """`precision`, except that a bf16 setting on a CPU without native bf16 (`cpu_has_fast_bf16`) falls
    back to 32-true, with one log line."""
    on_cpu = accelerator == "cpu" or (
        accelerator in (None, "auto") and not torch.cuda.is_available() and not torch.backends.mps.is_available()
    )
    if not on_cpu or not str(precision).startswith("bf16") or cpu_has_fast_bf16():
        return precision
    log.warning("precision %s: this CPU has no avx512_bf16 or AMX, so bf16 would run slower than float32; "
                "training in 32-true instead", precision)  # fmt: skip
    return "32-true"
