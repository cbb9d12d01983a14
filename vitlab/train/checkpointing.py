"""Atomic checkpoint IO and exact resume, so a run killed at any moment (SIGKILL included) leaves a
loadable last.ckpt and continues from it as if it had never stopped: never a torn file, the same batches,
the same augmentation. Loading uses `weights_only=True`, so opening a checkpoint cannot run code."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from vitlab.train.redaction import redact, secret_values

log = logging.getLogger("vitlab")

TMP_SUFFIX = ".tmp"


# ---- atomic checkpoints ---------------------------------------------------------------------------


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


# ---- last.ckpt: periodic, epoch end, signals --------------------------------------------------------


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class LastCheckpoint(ModelCheckpoint):
    """Keeps `last.ckpt` current; the only writer of it in a vitlab run.

    Saves `<dirpath>/last.ckpt` (default dirpath: `<default_root_dir>/checkpoints`, i.e. the run's
    checkpoint folder) after every `every_n_train_steps` optimizer steps (so a kill loses at most that
    many steps), after every validation (or every train epoch without validation) and at the end of
    training; stock `ModelCheckpoint(save_last=True)` next to a monitor only refreshes last.ckpt when
    the monitored metric improves.

    Signals: Lightning turns SIGTERM into `trainer.received_sigterm`, finishes the current batch and
    exits through `SIGTERMException` (a `SystemExit`, exit status 0). This callback saves last.ckpt at
    that batch's end (or, for a signal during validation, when the exception passes), so
    `vitlab fit ... --ckpt_path last` continues exactly there. SIGUSR1 (SLURM's preemption warning,
    `#SBATCH --signal=USR1@90`) is handled the same way; under SLURM with auto-requeue Lightning's own
    USR1 handler still runs first (hpc checkpoint + `scontrol requeue`).

    The checkpoint files are written atomically: at setup it installs `AtomicCheckpointIO` unless the
    strategy carries a custom CheckpointIO, and it removes temporary files a killed run left behind.
    """

    def __init__(
        self, dirpath: _PATH | None = None, every_n_train_steps: int | None = None, save_on_signal: bool = True
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must be >= 0 or None, got {every_n_train_steps}")
        super().__init__(
            dirpath=dirpath, monitor=None, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps or 0,
            enable_version_counter=False,
        )  # fmt: skip
        self.save_on_signal = save_on_signal
        self._prev_usr1: Any = None
        self._usr1_installed = False

    # The state key must not depend on the step interval, or changing it between a run and its
    # resume would drop this callback's state (and its last_model_path).
    @property
    def state_key(self) -> str:
        return self._generate_state_key(role="last")

    def _use_default_dir(self, trainer: L.Trainer) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.realpath(os.path.join(str(trainer.default_root_dir), "checkpoints"))
            self._fs = get_filesystem(self.dirpath)

    @property
    def last_path(self) -> str | None:
        if self.dirpath is None:
            return None
        return os.path.join(str(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        # `ckpt_path="last"` is resolved before setup; resolve the default folder here too.
        self._use_default_dir(trainer)
        return super()._find_last_checkpoints(trainer)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._use_default_dir(trainer)
        super().setup(trainer, pl_module, stage)
        if not use_atomic_io(trainer):
            rank_zero_warn(
                f"{type(trainer.strategy.checkpoint_io).__name__} is not vitlab's AtomicCheckpointIO: "
                "a kill during a checkpoint write may leave a torn file"
            )
        if stage == "fit" and trainer.is_global_zero and _is_local_file_protocol(str(self.dirpath)):
            for p in remove_stale_temp_files(self.dirpath):
                log.info("removed a partial checkpoint left by an interrupted run: %s", p)

    # ---- saving ----------------------------------------------------------------------------------

    def save_last_now(self, trainer: L.Trainer) -> str | None:
        """Write last.ckpt unless it already holds this global step (or saving makes no sense now)."""
        if self._should_skip_saving_checkpoint(trainer):
            return None
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        return self.last_model_path

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # Lightning raises SIGTERMException right after this batch; the loop state saved here is the
        # same as a periodic save's, which resumes exactly. Under DDP the ranks learn of the signal at
        # different batches (Lightning broadcasts it), so there the save waits for `on_exception`,
        # which every rank reaches, instead of adding a collective to every step.
        if self.save_on_signal and trainer.world_size == 1 and trainer.received_sigterm:
            path = self.save_last_now(trainer)
            if path and trainer.is_global_zero:
                log.warning("termination signal: saved %s at global step %d; resume with --ckpt_path last",
                            path, trainer.global_step)  # fmt: skip

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._should_save_on_train_epoch_end(trainer):
            self.save_last_now(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_save_on_train_epoch_end(trainer):
            self.save_last_now(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_usr1()
        # Only a termination signal saves here: after any other error the state may be what broke.
        if not (self.save_on_signal and isinstance(exception, SIGTERMException)):
            return
        if trainer.sanity_checking or trainer.global_step == 0:
            return
        path = self.save_last_now(trainer)
        if trainer.is_global_zero:
            where = path or self.last_path
            log.warning("termination signal: %s holds global step %d; resume with --ckpt_path last",
                        where, trainer.global_step)  # fmt: skip

    # ---- SIGUSR1 -----------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # After Lightning registered its handlers (SLURM requeue on USR1, its SIGTERM notifier).
        if self.save_on_signal and hasattr(signal, "SIGUSR1") and _is_main_thread():
            self._prev_usr1 = signal.getsignal(signal.SIGUSR1)
            signal.signal(signal.SIGUSR1, self._on_usr1)
            self._usr1_installed = True

    def _on_usr1(self, signum: int, frame: Any) -> None:
        if callable(self._prev_usr1):
            self._prev_usr1(signum, frame)
        # Same path as SIGTERM: Lightning's handler sets `received_sigterm` (and tells DDP children).
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):
            handler(signal.SIGTERM, frame)
        else:  # no fit in progress any more: nothing to save, behave like the default action
            raise SystemExit(128 + signum)

    def _restore_usr1(self) -> None:
        if self._usr1_installed and _is_main_thread():
            if signal.getsignal(signal.SIGUSR1) == self._on_usr1:
                signal.signal(signal.SIGUSR1, self._prev_usr1 if self._prev_usr1 is not None else signal.SIG_DFL)
            self._usr1_installed = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_usr1()
        self.save_last_now(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_usr1()


# ---- exact resume ------------------------------------------------------------------------------------


class ExactResume(Callback):
    """Makes a resumed run continue exactly where its checkpoint was taken (same batches, same
    augmentation, same later epochs), and takes over restoring the train loader's state:

    - RNG: the global torch / numpy / python (and CUDA) streams are stored in every checkpoint and
      restored just before the first batch of the resumed run. With `num_workers=0` the train
      transforms draw from them. (Workers seed themselves from the loader's generator; their streams
      are not restored mid-epoch.) Rank 0's states are stored; every other rank then derives its own
      streams from them, so in-process augmentation and dropout keep differing across ranks.
    - Loader generators: the shuffling generator of each train loader is stored too, because
      restoring a torchdata StatefulDataLoader rewinds it to the start of the epoch, so every later
      epoch would be shuffled differently from the uninterrupted run.
    - Loader position: the loader state Lightning stores (`loader.state_dict()`) is applied here,
      because Lightning 2.6 drops it when `configure_optimizers` reads
      `trainer.estimated_stepping_batches` (ViTClassifier does; lightning#20550), and a state taken at
      the end of an epoch is dropped, because a StatefulDataLoader restored from it yields an empty
      next epoch.
    """

    def __init__(self) -> None:
        self._rng: dict[str, Any] | None = None
        self._generators: list[dict[str, Any]] | None = None
        self._loader_states: list[dict[str, Any]] | None = None

    # ---- saving ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"rng": _get_rng_state(), "generators": self._generator_states()}

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

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Runs before Lightning restores its loops: take the loader states out so they are applied
        # once, here, at the right moment.
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        states = fit_state.pop("combined_loader", None)
        self._loader_states = states or None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fit_loop = trainer.fit_loop
        loader, fetcher = getattr(fit_loop, "_combined_loader", None), getattr(fit_loop, "_data_fetcher", None)
        states, self._loader_states = self._loader_states, None
        generators, self._generators = self._generators, None
        if loader is not None and fetcher is not None and (states or generators):
            dls = list(loader.flattened)
            if states and _epoch_consumed(states, dls, trainer.num_training_batches):
                states = None  # saved at the end of an epoch: the next epoch starts fresh
            if states:
                loader._load_state_dicts(states)
                iter(fetcher)  # the restored iterator rewinds the generators to the epoch start...
                _set_generator_states(dls, generators)  # ...so put them where the original run had them
            else:
                _set_generator_states(dls, generators)  # the next epoch shuffles from the saved generator
                iter(fetcher)
        # RNG last, and not at load time: sanity-check validation and loader set-up draw from these
        # streams in a resumed run only; the stored state is the one the next batch saw originally.
        rng, self._rng = self._rng, None
        if rng:
            _set_rng_state(rng)
            _decorrelate_ranks(trainer)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage == "fit":
            _decorrelate_ranks(trainer)

    def _train_loaders(self) -> list[Any]:
        trainer = getattr(self, "_trainer", None)
        loader = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
        return list(loader.flattened) if loader is not None else []


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


def _get_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _plain_python_state(random.getstate())}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {
            "kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss),
        }  # fmt: skip
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(_python_state(state["python"]))
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain_python_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_state(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
