"""`ExactResume`: a resumed run continues exactly where its checkpoint was taken: the same batches,
the same augmentation, the same later epochs."""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import CombinedLoader

from vitlab.data.random_state import get_rng_state, set_rng_state
from vitlab.train.reliability.lightning_internals import check_lightning_version, pop_loader_states, restart_fetcher

log = logging.getLogger("vitlab")


class ExactResume(Callback):
    """Stores and restores, for every rank its own, what a resumed run needs to continue exactly:

    - the global torch / numpy / python (and CUDA) random streams, restored just before the first batch.
      Lightning saves none (`_CheckpointConnector.dump_checkpoint`); fabric's `_collect_rng_states` serves
      the spawn launcher only, and its numpy array does not load with `weights_only=True`;
    - each train loader's shuffling generator: restoring a StatefulDataLoader rewinds it to the epoch
      start, so every later epoch would be shuffled differently;
    - each train loader's state (position, worker streams). Lightning's own restore keeps rank 0's state
      only, and drops it when `configure_optimizers` reads `estimated_stepping_batches`, as
      ViTClassifier does (lightning#20550); a state taken at an epoch's end is dropped, since a loader
      restored from it yields an empty next epoch.

    `state_dict` runs no collective; under DDP `on_save_checkpoint` (every rank together) gathers the
    ranks' states into rank 0's file. Resumed on another number of ranks, every rank starts from rank 0's
    state and derives its streams from it: same data order, not the same augmentation.
    """

    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        self._state: dict[str, Any] | None = None  # loaded; applied at the start of training
        self._lightning_loaders: list[dict[str, Any]] | None = None  # Lightning's copy: rank 0's

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_lightning_version()
        self._trainer = trainer
        if stage == "fit":
            _decorrelate_ranks(trainer)

    def state_dict(self) -> dict[str, Any]:
        loaders = _train_loaders(self._trainer)
        generators = [{k: g.get_state() if g is not None else None for k, g in _generators(dl).items()}
                      for dl in loaders]  # fmt: skip
        loader_states = [dl.state_dict() for dl in loaders if hasattr(dl, "load_state_dict")]
        return {"rng": get_rng_state(), "generators": generators, "loaders": loader_states}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Not from a signal handler in a vitlab run: LastCheckpoint runs Lightning's SLURM requeue save after
        # the ranks stopped together.
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(ranks, checkpoint["callbacks"][self.state_key])
            checkpoint["callbacks"][self.state_key] = {"ranks": ranks}

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Before Lightning restores its loops: take its copy out so the states are applied once, here.
        self._lightning_loaders = pop_loader_states(checkpoint)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = state_dict

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state, self._state = self._state or {}, None
        fallback, self._lightning_loaders = self._lightning_loaders, None
        ranks = state.get("ranks") or [state]
        own = len(ranks) == trainer.world_size
        if state and not own and trainer.is_global_zero:
            log.warning("resuming on %d ranks a run saved on %d: every rank starts from rank 0's loader and "
                        "random state (same data order, not the same augmentation)", trainer.world_size,
                        len(ranks))  # fmt: skip
        mine = ranks[trainer.global_rank if own else 0]
        states, generators = mine.get("loaders", fallback) or None, mine.get("generators")
        loaders = _train_loaders(trainer)
        if states and _epoch_consumed(states, loaders, trainer.num_training_batches):
            states = None  # saved at the end of an epoch: the next epoch starts fresh
        # Restoring a loader's state rewinds its generators to the epoch start, so they are put where the
        # original run had them after the new iterator exists; without a state, before it.
        if states:
            stateful = [dl for dl in loaders if hasattr(dl, "load_state_dict")]
            if len(stateful) != len(states):
                raise RuntimeError(f"the checkpoint holds {len(states)} train loader states for {len(stateful)} "
                                   "stateful train loaders: resume with the data settings it was saved with")
            for dl, s in zip(stateful, states):
                dl.load_state_dict(s)
            restart_fetcher(trainer)
            _set_generator_states(loaders, generators)
        elif generators:
            _set_generator_states(loaders, generators)
            restart_fetcher(trainer)
        # RNG last, and not at load time: sanity-check validation and loader set-up draw from these
        # streams in a resumed run only; the stored state is the one the next batch saw originally.
        if mine.get("rng"):
            set_rng_state(mine["rng"])
            if not own:  # rank 0's streams on every rank: make the others' differ again
                _decorrelate_ranks(trainer)


def _train_loaders(trainer: L.Trainer | None) -> list[Any]:
    loaders = trainer.train_dataloader if trainer is not None else None
    return CombinedLoader(loaders).flattened if loaders is not None else []


def _generators(dl: Any) -> dict[str, torch.Generator | None]:
    """The loader's and its sampler's shuffling generators."""
    sampler = getattr(dl, "sampler", None)
    gens = {"loader": getattr(dl, "generator", None), "sampler": getattr(sampler, "generator", None)}
    return {k: g if isinstance(g, torch.Generator) else None for k, g in gens.items()}


def _epoch_consumed(states: list[dict[str, Any]], loaders: list[Any], num_batches: float) -> bool:
    """True when every saved loader state is at the end of its epoch: all `num_batches` batches the
    trainer takes per epoch (`limit_train_batches` included), or all the loader has, were yielded."""
    stateful = [dl for dl in loaders if hasattr(dl, "load_state_dict")]
    if len(states) != len(stateful):
        return False
    for state, dl in zip(states, stateful):
        if state.get("_iterator_finished"):
            continue
        try:
            n = min(len(dl), num_batches) if len(stateful) == 1 else len(dl)
        except TypeError:  # no length: only the finished flag tells
            n = num_batches
        if not state.get("_num_yielded", -1) >= n:
            return False
    return True


def _set_generator_states(loaders: list[Any], states: list[dict[str, Any]] | None) -> None:
    if not states or len(states) != len(loaders):
        return
    for dl, state in zip(loaders, states):
        for key, gen in _generators(dl).items():
            if gen is not None and state.get(key) is not None:
                gen.set_state(state[key])


def _decorrelate_ranks(trainer: L.Trainer) -> None:
    """Seed ranks > 0 from the shared stream plus their rank: `seed_everything` gives every rank the
    same seed, so without this in-process augmentation and dropout would repeat across ranks."""
    if trainer.global_rank == 0:
        return
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) + trainer.global_rank
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
