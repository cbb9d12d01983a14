"""Test helpers: run the CLI as a subprocess (as a user would, and as Lightning's DDP launcher needs),
read its CSV, and test-only callbacks that recipes load by class_path (`run_cli` puts this folder on
PYTHONPATH, so every DDP rank can import them)."""

from __future__ import annotations

import copy
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

TESTS = Path(__file__).resolve().parent
HUNG = -999  # run_cli's exit code for a job killed at its timeout


def run_cli(
    args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str, float, bool]:
    """`python -m vitlab.cli ARGS` in its own session.

    Returns (exit code, stdout+stderr, seconds, stragglers): stragglers is True when some process of
    the session (a rank) was still running 20 s after the launching process exited. Output goes to a
    file, not a pipe, so a stray rank holding the pipe open cannot block the wait. Whatever is left
    of the session is killed at the end.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    log_path = cwd.parent / f"{cwd.name}.log"
    start = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vitlab.cli", *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout)
            seconds = time.monotonic() - start
            deadline = time.monotonic() + 20
            while _session_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            stragglers = _session_alive(proc.pid)
        except subprocess.TimeoutExpired:
            rc, seconds, stragglers = HUNG, time.monotonic() - start, True
        finally:
            kill_session(proc)
    return rc, log_path.read_text(), seconds, stragglers


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the session `proc` leads (its ranks and workers), nothing else; gone already is fine."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _session_alive(sid: int) -> bool:
    """Whether a live (not zombie) process of session `sid` remains (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session, ...
            return True
    return False


def csv_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def last_value(rows: list[dict[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key)]
    assert values, f"no {key} in the CSV"
    return values[-1]


def _sampler(loader: Any) -> Any:
    """The sampler that really drives `loader`: Lightning swaps in a distributed one through the batch
    sampler when the loader has its own batch-sampler class (torchdata's StatefulDataLoader)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None) or loader.sampler


def _sampler_indices(loader: Any) -> list[int]:
    # A copy, so that reading the order does not advance the real sampler's random generator.
    return [int(i) for i in copy.deepcopy(_sampler(loader))]


class RecordRankData(Callback):
    """Writes, per rank, the sample indices its train and val loaders read in epoch 0, the file each
    index names, and the first augmented train batch, under `out_dir`."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch:
            return
        train, val = trainer.train_dataloader, trainer.val_dataloaders
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "pid": os.getpid(),
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "train_sampler": type(_sampler(train)).__name__,
            "val_sampler": type(_sampler(val)).__name__,
            "train": _sampler_indices(train),
            "val": _sampler_indices(val),
            "train_files": [p for p, _ in train.dataset.samples],
            "val_files": [p for p, _ in val.dataset.samples],
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 0 and batch_idx == 0:
            torch.save(batch[0].detach().cpu(), self.out_dir / f"rank{trainer.global_rank}_batch0.pt")


class FailOnRank(Callback):
    """Raises on one rank when training reaches `step`, as a crashed worker would."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank = rank
        self.step = step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class StallOnRank(Callback):
    """Blocks one rank at `step` for `seconds`, as a rank stuck in I/O or a collective would."""

    def __init__(self, rank: int = 1, step: int = 2, seconds: float = 90.0) -> None:
        self.rank = rank
        self.step = step
        self.seconds = seconds

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            time.sleep(self.seconds)


class HoldsCredential(Callback):
    """A recipe callback that takes a credential (as an uploader or a tracker would) next to a model-like
    `class_token` option: the run's record must keep the first out and the second as given."""

    def __init__(self, api_key: str = "", class_token: bool = False) -> None:
        self.api_key = api_key
        self.class_token = class_token
