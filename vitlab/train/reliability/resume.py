"""`ExactResume`: a resumed run continues exactly where its checkpoint was taken: the same batches,
the same augmentation, the same later epochs."""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from vitlab.data.random_state import get_rng_state, set_rng_state
from vitlab.train.reliability.lightning_internals import (
    check_lightning_version,
    pop_loader_states,
    restore_train_loaders,
    train_loader_states,
    train_loaders,
)

log = logging.getLogger("vitlab")


class ExactResume(Callback):
    """Makes a resumed run continue exactly where its checkpoint was taken (same batches, same
    augmentation, same later epochs), and takes over restoring the train loader's state:

    - RNG: the global torch / numpy / python (and CUDA) streams of every rank are stored in every
      checkpoint and restored, each rank its own, just before the first batch of the resumed run.
      DataLoader workers' streams are part of the loader's state (`WorkerRandomState`).
    - Loader generators: the shuffling generator of each train loader is stored too, because
      restoring a torchdata StatefulDataLoader rewinds it to the start of the epoch, so every later
      epoch would be shuffled differently from the uninterrupted run.
    - Loader position: the loader state (`loader.state_dict()`, worker streams included) of every rank
      is stored and applied here, each rank its own (Lightning's checkpoint holds rank 0's only, and
      drops it when `configure_optimizers` reads `trainer.estimated_stepping_batches`, as ViTClassifier
      does; lightning#20550); a state taken at the end of an epoch is dropped, because a
      StatefulDataLoader restored from it yields an empty next epoch.

    Saving gathers the ranks' states (one `all_gather_object`, when every rank saves anyway). A
    resume on a different number of ranks restores rank 0's state on every rank and derives the
    other ranks' streams from it: the data order is kept, not the exact augmentation.
    """

    def __init__(self) -> None:
        self._rng: dict[str, Any] | None = None
        self._generators: list[dict[str, Any]] | None = None
        self._loader_states: list[dict[str, Any]] | None = None
        self._ranks: list[dict[str, Any]] | None = None

    # ---- saving ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "_trainer", None)
        mine = {"rng": get_rng_state(), "generators": self._generator_states(), "loaders": train_loader_states(trainer)}
        ranks = [mine]
        if trainer is not None and trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = [None] * trainer.world_size
            dist.all_gather_object(ranks, mine)
        return {"rng": mine["rng"], "generators": mine["generators"], "ranks": ranks}

    def _generator_states(self) -> list[dict[str, Any]]:
        states = []
        for dl in self._train_loaders():
            gen = getattr(dl, "generator", None)
            sgen = getattr(getattr(dl, "sampler", None), "generator", None)
            states.append({
                "loader": gen.get_state() if isinstance(gen, torch.Generator) else None,
                "sampler": sgen.get_state() if isinstance(sgen, torch.Generator) else None,
            })  # fmt: skip
        return states

    # ---- loading ---------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rng = state_dict.get("rng")
        self._generators = state_dict.get("generators")
        self._ranks = state_dict.get("ranks")

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Runs before Lightning restores its loops: take the loader states out so they are applied
        # once, here, at the right moment.
        self._loader_states = pop_loader_states(checkpoint)

    def _own_rank_state(self, trainer: L.Trainer) -> bool:
        """Switch to this rank's stored state when the checkpoint has one per rank; True when it did."""
        ranks, self._ranks = self._ranks, None
        if not ranks:
            return False
        if len(ranks) != trainer.world_size:
            if trainer.is_global_zero:
                log.warning("resuming on %d ranks a run saved on %d: every rank starts from rank 0's loader and "
                            "random state (same data order, not the same augmentation)", trainer.world_size,
                            len(ranks))  # fmt: skip
            return False
        own = ranks[trainer.global_rank]
        self._rng, self._generators, self._loader_states = own["rng"], own["generators"], own["loaders"] or None
        return True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        own = self._own_rank_state(trainer)
        states, self._loader_states = self._loader_states, None
        generators, self._generators = self._generators, None
        if states or generators:
            if states and _epoch_consumed(states, train_loaders(trainer), trainer.num_training_batches):
                states = None  # saved at the end of an epoch: the next epoch starts fresh
            # Restoring a loader's state rewinds its generators to the epoch start, so they are put
            # where the original run had them after the new iterator exists; without a state, before.
            if states:
                if restore_train_loaders(trainer, states):
                    _set_generator_states(train_loaders(trainer), generators)
            else:
                _set_generator_states(train_loaders(trainer), generators)
                restore_train_loaders(trainer, None)
        # RNG last, and not at load time: sanity-check validation and loader set-up draw from these
        # streams in a resumed run only; the stored state is the one the next batch saw originally.
        rng, self._rng = self._rng, None
        if rng:
            set_rng_state(rng)
            if not own:  # rank 0's streams on every rank: make the others' differ again
                _decorrelate_ranks(trainer)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_lightning_version()
        self._trainer = trainer
        if stage == "fit":
            _decorrelate_ranks(trainer)

    def _train_loaders(self) -> list[Any]:
        return train_loaders(getattr(self, "_trainer", None))


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
        gen = getattr(dl, "generator", None)
        sgen = getattr(getattr(dl, "sampler", None), "generator", None)
        if state.get("loader") is not None and isinstance(gen, torch.Generator):
            gen.set_state(state["loader"])
        if state.get("sampler") is not None and isinstance(sgen, torch.Generator):
            sgen.set_state(state["sampler"])


def _decorrelate_ranks(trainer: L.Trainer) -> None:
    """Seed ranks > 0 from the shared stream plus their rank: `seed_everything` gives every rank the
    same seed, so without this in-process augmentation and dropout would repeat across ranks."""
    if trainer.global_rank == 0:
        return
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) + trainer.global_rank
    torch.manual_seed(seed)
    random.seed(seed)
    import numpy as np

    np.random.seed(seed % 2**32)
