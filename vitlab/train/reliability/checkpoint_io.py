"""Atomic checkpoint files: a kill at any moment (SIGKILL included) leaves the previous checkpoint intact,
never a torn file, and loading uses `weights_only=True`, so opening a checkpoint cannot run code."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vitlab.train.reliability.redaction import redact, secret_values

TMP_SUFFIX = ".tmp"


class CheckpointLoadError(RuntimeError):
    """A checkpoint that cannot be read safely: truncated, not a checkpoint, or holding code objects."""


def _fsync_dir(folder: str) -> None:
    # Makes the rename itself durable; not every platform/filesystem can open a directory.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_temp_checkpoint(name: str) -> bool:
    """True for the temporary files `AtomicCheckpointIO` writes (`.<name>.<random>.tmp`)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX) and ".ckpt." in name


def remove_stale_temp_files(folder: _PATH) -> list[Path]:
    """Delete temporary checkpoint files a killed run left in `folder`; returns what was removed."""
    removed = []
    folder = Path(folder)
    if folder.is_dir():
        for p in folder.iterdir():
            if p.is_file() and is_temp_checkpoint(p.name):
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` that never leaves a half-written file under a checkpoint's final name.

    Local paths: `torch.save` into `.<name>.<random>.tmp` in the same folder, flush + fsync, `os.replace`
    onto the final name (atomic on POSIX and Windows), fsync the folder. A kill (SIGKILL included)
    at any point leaves the previous file intact plus at most a stray temporary file, which
    `LastCheckpoint` removes at the next start. Lightning's own `_atomic_save` stages the file in the
    system temp folder, which is often another filesystem (then the "move" is a plain copy) and never
    fsyncs. Remote paths (s3://, gs://...) go through Lightning's writer: object stores publish an
    object only once it is complete.

    Loading always uses `weights_only=True`: a checkpoint cannot run code when it is opened.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        checkpoint = _redact_checkpoint(checkpoint)
        path = str(path)
        if not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path)
            return
        path = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                self._write(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            # Disk full, permission lost, KeyboardInterrupt: leave the old checkpoint as it was.
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(folder)

    def _write(self, checkpoint: dict[str, Any], f: BinaryIO) -> None:
        """Serialise `checkpoint` into the open temporary file."""
        torch.save(checkpoint, f)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                f"{type(self).__name__} loads checkpoints with weights_only=True only; a checkpoint that needs "
                "arbitrary unpickling can run code when opened. Register the extra types with "
                "torch.serialization.add_safe_globals instead."
            )
        fs = get_filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        try:
            if _is_local_file_protocol(path):
                return torch.load(path, map_location=map_location, weights_only=True)
            with fs.open(path, "rb") as f:
                return torch.load(f, map_location=map_location, weights_only=True)
        except Exception as exc:
            raise CheckpointLoadError(
                f"cannot load checkpoint {path} with weights_only=True: {type(exc).__name__}: {exc}"
            ) from exc


def _redact_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    keys = [k for k in ("hyper_parameters", "datamodule_hyper_parameters") if k in checkpoint]
    if not keys:
        return checkpoint
    secrets = secret_values()
    out = dict(checkpoint)  # shallow: the tensors are shared, not copied
    for k in keys:
        out[k] = redact(checkpoint[k], secrets)
    return out


def use_atomic_io(trainer: L.Trainer) -> bool:
    """Put `AtomicCheckpointIO` on the trainer's strategy if it still uses the stock `TorchCheckpointIO`
    (a custom CheckpointIO from the recipe is left alone). Returns True when the IO is atomic."""
    strategy = trainer.strategy
    current = strategy.checkpoint_io
    if isinstance(current, AtomicCheckpointIO):
        return True
    if type(current) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
        return True
    return False
