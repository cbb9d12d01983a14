"""Atomic checkpoint files: a kill at any moment (SIGKILL included) leaves the previous checkpoint intact,
never a torn file, and loading uses `weights_only=True`, so opening a checkpoint cannot run code."""

from __future__ import annotations

import os
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vitlab.train.reliability.redaction import redact, secret_values

TMP_SUFFIX = ".tmp"


def is_local_path(path: str | Path) -> bool:
    """A plain path or a file:// URL; not `s3://...` or another fsspec protocol (fsspec's own test)."""
    path = str(path)
    return "://" not in path or path.startswith("file://")


class CheckpointLoadError(RuntimeError):
    """A checkpoint that cannot be read safely: truncated, not a checkpoint, or holding code objects."""


def is_temp_checkpoint(name: str) -> bool:
    """True for the temporary files `AtomicCheckpointIO` writes (`.<name>.<random>.tmp`)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX) and ".ckpt." in name


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Delete temporary checkpoint files a killed run left in `folder`; returns what was removed."""
    removed = [p for p in Path(folder).glob("*") if p.is_file() and is_temp_checkpoint(p.name)]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` that never leaves a half-written file under a checkpoint's final name, and
    loads with `weights_only=True` only.

    Local paths: write `.<name>.<random>.tmp` in the same folder, fsync, `os.replace` onto the final name,
    fsync the folder; `LastCheckpoint` removes stray temporary files at the next start. (Lightning's
    `cloud_io._atomic_save` commits through an fsspec transaction and never fsyncs.) Remote paths go
    through Lightning's writer: object stores publish an object only once it is complete.

    Loading forces `weights_only=True`, which Lightning does not: `fit(weights_only=None)` reaches
    `torch.load` as None (a default `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` turns off), `cloud_io._load` makes
    it False for an http `ckpt_path`, and `fit(weights_only=False)` is taken as given.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        secrets = secret_values()
        hparams = ("hyper_parameters", "datamodule_hyper_parameters")
        checkpoint = {k: redact(v, secrets) if k in hparams else v for k, v in checkpoint.items()}
        path = str(path)
        if not is_local_path(path):
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
            with suppress(OSError):  # disk full, permission lost, Ctrl-C: the old checkpoint stays as it was
                os.unlink(tmp)
            raise
        with suppress(OSError):  # makes the rename itself durable; not every filesystem can open a directory
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _write(self, checkpoint: dict[str, Any], f: BinaryIO) -> None:
        torch.save(checkpoint, f)

    def load_checkpoint(
        self, path: str | Path, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                f"{type(self).__name__} loads checkpoints with weights_only=True only; a checkpoint that needs "
                "arbitrary unpickling can run code when opened. Register the extra types with "
                "torch.serialization.add_safe_globals instead."
            )
        try:
            return super().load_checkpoint(path, map_location, weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise CheckpointLoadError(
                f"cannot load checkpoint {path} with weights_only=True: {type(exc).__name__}: {exc}"
            ) from exc
