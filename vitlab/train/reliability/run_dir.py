"""`RunDirCheck`: a run folder that cannot be written (or lacks room for a few checkpoints) fails at the start,
not at the first save."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, WeightAveraging

from vitlab.train.reliability.checkpoint_io import is_local_path


class RunDirError(RuntimeError):
    """The run folder cannot be written, or its disk lacks room for the run's checkpoints."""


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_run_dir(run_dir: str | Path, need_bytes: int = 0, what: str = "") -> None:
    """Create `run_dir` if needed, prove it writable (create + delete a probe file) and, when
    `need_bytes` > 0, that its filesystem has that much free space. Raises RunDirError otherwise."""
    run_dir = str(run_dir)
    if not is_local_path(run_dir):
        return  # remote stores: no cheap, meaningful probe
    path = Path(run_dir).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".vitlab-write-probe-") as probe:
            probe.write(b"ok")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise RunDirError(
            f"run folder {path} is not writable ({type(exc).__name__}: {exc.strerror or exc}); "
            "choose another --run_dir or fix its permissions"
        ) from exc
    if need_bytes > 0:
        free = shutil.disk_usage(path).free
        if free < need_bytes:
            raise RunDirError(
                f"not enough free disk space for run folder {path}: about {_mib(need_bytes)} needed"
                f"{' (' + what + ')' if what else ''}, {_mib(free)} available; free some space or "
                "choose another --run_dir"
            )


class RunDirCheck(Callback):
    """At the start of fit (rank 0 checks, every rank raises): the run folder is writable and its disk
    has room for `keep` checkpoints (best, last and the temporary copy of an atomic write) plus
    `margin_bytes` for logs. The run folder is the trainer's default_root_dir (vitlab's --run_dir)."""

    def __init__(self, keep: int = 3, margin_bytes: int = 64 * 2**20) -> None:
        self.keep = keep
        self.margin_bytes = margin_bytes

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        error = None
        if trainer.is_global_zero:
            # weights + buffers, the optimizer's moments (1 copy of the trainable weights for SGD, 2 for Adam)
            # and an averaged copy under EMA
            size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
            weights = size(pl_module.parameters()) + size(pl_module.buffers())
            slots = 1 if getattr(pl_module, "hparams", {}).get("optimizer") == "sgd" else 2
            averaged = any(isinstance(cb, WeightAveraging) for cb in trainer.callbacks)
            trainable = size(p for p in pl_module.parameters() if p.requires_grad)
            per_ckpt = weights + slots * trainable + (weights if averaged else 0)
            need = self.keep * per_ckpt + self.margin_bytes
            what = f"{self.keep} checkpoints of ~{_mib(per_ckpt)} (weights + optimizer state) + logs"
            try:
                check_run_dir(trainer.default_root_dir, need, what)
            except RunDirError as exc:
                error = str(exc)
        error = trainer.strategy.broadcast(error, src=0)
        if error:
            raise RunDirError(error)
