"""No collective runs inside a callback's `state_dict` or inside a signal handler.

A rank saves from wherever the save is requested, and a signal handler runs wherever the signal lands:
a collective there pairs with whatever collective the other ranks are in (a hang under NCCL, an abort or
garbage under gloo). The ranks' resume states are gathered in `on_save_checkpoint` instead, which every
rank runs together inside `trainer.save_checkpoint`; Lightning's SLURM requeue handler, which saves a
checkpoint, runs after the ranks stopped together, not inside the signal handler.

Real runs: 2 ranks on gloo (started as torchrun would, with RANK/WORLD_SIZE), and one process under a
SLURM environment with auto-requeue; tiny ViT, random images.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from vitlab.train import ViTClassifier
from vitlab.train.reliability.guards import NonFiniteGuard
from vitlab.train.reliability.last_checkpoint import LastCheckpoint
from vitlab.train.reliability.resume import ExactResume

pytestmark = pytest.mark.slow

TINY = {"patch_size": 8, "depth": 1, "embed_dim": 16, "num_heads": 2, "img_size": 32}
COLLECTIVES = ("all_gather_object", "all_gather", "all_reduce", "broadcast", "broadcast_object_list", "barrier",
               "reduce", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all")  # fmt: skip
SIGNAL_AT = 2  # the global step during which the signal arrives


class CollectiveCalled(AssertionError):
    pass


@contextlib.contextmanager
def no_collectives(where: str) -> Iterator[None]:
    """Make every torch.distributed collective raise `CollectiveCalled` (both the public names and
    distributed_c10d's, which the public ones call)."""
    saved = []
    for module in (dist, dist.distributed_c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))

                def forbidden(*args: Any, _name: str = name, **kwargs: Any) -> None:
                    raise CollectiveCalled(f"torch.distributed.{_name} called {where}")

                setattr(module, name, forbidden)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


class Probe(Callback):
    """Forbids collectives in every callback's `state_dict` and around the signal it sends itself (the
    Python handler runs right after `os.kill` returns); records this rank's torch random state at each
    save, the oracle for what the checkpoint must hold for this rank."""

    def __init__(self, out: Path, signal_ranks: tuple[int, ...], signum: int = signal.SIGTERM) -> None:
        self.out, self.signal_ranks, self.signum = out, signal_ranks, signum

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for cb in trainer.callbacks:
            cb.state_dict = self._forbid(cb.state_dict, f"in {type(cb).__name__}.state_dict")
        save = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            torch.save(torch.get_rng_state(), self.out / f"rng_rank{trainer.global_rank}.pt")
            save(*args, **kwargs)

        trainer.save_checkpoint = save_checkpoint

    @staticmethod
    def _forbid(fn: Any, where: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with no_collectives(where):
                return fn(*args, **kwargs)

        return wrapped

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == SIGNAL_AT and trainer.global_rank in self.signal_ranks:
            with no_collectives("in a signal handler"):
                os.kill(os.getpid(), self.signum)
                for _ in range(1000):  # a few bytecodes: Python runs the handler here
                    pass


def fit(root: Path, callbacks: list[Callback], **trainer_kwargs: Any) -> L.Trainer:
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, 32, 32, generator=g), torch.randint(4, (64,), generator=g))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, log_every_n_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0, callbacks=callbacks,
        **trainer_kwargs,
    )  # fmt: skip
    model = ViTClassifier(model_args=TINY, num_classes=4, lr=1e-3, warmup_steps=0)
    trainer.fit(model, train_dataloaders=loader)
    return trainer


def _rank(rank: int, root: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    callbacks = [Probe(root, signal_ranks=(1,)), LastCheckpoint(every_n_train_steps=1), ExactResume(), NonFiniteGuard()]
    with pytest.raises(SIGTERMException):  # every rank stops, at the same batch
        fit(root, callbacks, devices=2, strategy="ddp")
    # As `vitlab` does after a run: a gloo group left to the interpreter's shutdown can abort the process.
    dist.destroy_process_group()


def test_ddp_saves_and_signals_run_no_collective_in_state_dict_or_handler(tmp_path: Path) -> None:
    """2 ranks, a checkpoint every step, SIGTERM to rank 1 only during step 2: every save's state_dict and
    the handler run with collectives forbidden; both ranks stop after that batch; last.ckpt holds each
    rank's own random state, the one it had when the save began."""
    mp.start_processes(_rank, args=(tmp_path, find_free_network_port()), nprocs=2, start_method="spawn")
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == SIGNAL_AT + 1  # the signalled batch finished on both ranks, then they stopped
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("ExactResume")]
    ranks = state["ranks"]
    assert len(ranks) == 2
    for r in (0, 1):
        assert torch.equal(ranks[r]["rng"]["torch"], torch.load(tmp_path / f"rng_rank{r}.pt", weights_only=True))
        assert len(ranks[r]["loaders"]) == 1 and ranks[r]["loaders"][0]["_num_yielded"] == SIGNAL_AT + 1
    assert not torch.equal(ranks[0]["rng"]["torch"], ranks[1]["rng"]["torch"])


def test_slurm_requeue_saves_after_the_stop_not_inside_the_signal_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under SLURM with auto-requeue, Lightning's SIGUSR1 handler saves an hpc checkpoint and requeues the
    job. It runs after the batch end where the run stops (its checkpoint and last.ckpt hold the same step),
    not inside the handler, where `trainer.save_checkpoint` is made to fail here."""
    for key, value in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "vitlab-test"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    requeued: list[list[str]] = []
    requeue = "lightning.pytorch.trainer.connectors.signal_connector.call"  # Lightning's `scontrol requeue`
    monkeypatch.setattr(requeue, lambda cmd: requeued.append(cmd) or 0)

    class SaveOutsideHandlers(Probe):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
            if trainer.global_step != SIGNAL_AT:
                return
            save = trainer.save_checkpoint
            trainer.save_checkpoint = lambda *a, **k: pytest.fail("a checkpoint was saved inside a signal handler")
            try:
                super().on_train_batch_start(trainer, pl_module, batch, i)
            finally:
                trainer.save_checkpoint = save

    probe = SaveOutsideHandlers(tmp_path, signal_ranks=(0,), signum=signal.SIGUSR1)
    with pytest.raises(SIGTERMException):
        fit(tmp_path, [probe, LastCheckpoint(), ExactResume()], devices=1,
            plugins=[SLURMEnvironment(auto_requeue=True)])  # fmt: skip
    assert requeued == [["scontrol", "requeue", "4242"]]
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    hpc = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)
    assert last["global_step"] == hpc["global_step"] == SIGNAL_AT + 1
