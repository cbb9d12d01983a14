"""Fault tolerance for training runs: atomic checkpoints, exact resume, preemption signals,
non-finite loss handling, run-folder checks and secret redaction.

What a run gets (wired by `vitlab.train.run.run_callbacks` / `run_plugins`):

- `AtomicCheckpointIO`: every checkpoint is written to a temporary file in its own folder, fsynced and
  renamed over the final name, so a kill at any moment leaves either the old or the new file, never
  a torn one; loading uses `torch.load(weights_only=True)`.
- `LastCheckpoint`: keeps `<run>/checkpoints/last.ckpt` current: every N optimizer steps (optional),
  after every validation / train epoch, at the end of training, and on SIGTERM / SIGUSR1.
- `ExactResume`: stores the global RNG streams in each checkpoint and restores them on resume, so
  augmentation drawn in the main process continues exactly; applies the saved train-loader state.
- `NonFiniteGuard`: a NaN/Inf loss (or gradient) never reaches the weights; it stops the run with a
  message naming the step, learning rate and last good checkpoint, or skips up to N such steps.
- `RunDirCheck` / `check_run_dir`: a run folder that cannot be written, or a disk without room for a
  few checkpoints, fails at the start with a message naming the folder and the sizes.
- `RedactSecrets` / `redact`: credentials from the environment (and values under secret-looking keys)
  never reach config.yaml, saved hyperparameters, checkpoints or log records.

Mid-epoch resume is exact only when the train loader is stateful (`stateful_loader`): Lightning saves
`loader.state_dict()` in the checkpoint and restores it before the first batch of the resumed run.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, WeightAveraging
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

log = logging.getLogger("vitlab")

REDACTED = "<redacted>"
TMP_SUFFIX = ".tmp"


# ---- secrets ------------------------------------------------------------------------------------

# Environment variable names that hold credentials (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...).
# Whole-word matches only: TOKENIZERS_PARALLELISM is not a secret.
_SECRET_ENV = re.compile(
    r"(?:^|_)(?:API_?KEY|KEY_?ID|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|ACCESS_?KEY|PRIVATE_?KEY|AUTH)(?:_|$)",
    re.IGNORECASE,
)
# Config / hparam keys whose value is a credential whatever it looks like.
_SECRET_KEY = re.compile(
    r"(?:^|[-_.])(?:api[-_]?key|apikey|token|secret|password|passwd|credentials?|access[-_]?key|private[-_]?key)"
    r"(?:$|[-_.])",
    re.IGNORECASE,
)
# user:password@ inside a URL.
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^/\s:@]+:)[^@\s/]+@")
# Short values ("1", "true") would redact half of every file; real credentials are longer.
_MIN_SECRET_LEN = 8


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the credential-like variables in `environ` (default: os.environ), longest first."""
    env = os.environ if environ is None else environ
    found = {v for k, v in env.items() if _SECRET_ENV.search(k) and len(v) >= _MIN_SECRET_LEN}
    return sorted(found, key=len, reverse=True)


def _is_secret_key(key: Any) -> bool:
    return isinstance(key, str) and bool(_SECRET_KEY.search(key.rsplit(".", 1)[-1]))


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every known secret value and URL password replaced by `<redacted>`."""
    for value in secret_values() if secrets is None else secrets:
        if value and value in text:
            text = text.replace(value, REDACTED)
    return _URL_PASSWORD.sub(rf"\1{REDACTED}@", text)


def redact(obj: Any, secrets: Iterable[str] | None = None) -> Any:
    """A copy of `obj` (dicts, lists, tuples, jsonargparse Namespaces, strings; anything else as is)
    with secret values and the values of secret-looking keys replaced by `<redacted>`."""
    secrets = secret_values() if secrets is None else list(secrets)
    return _redact(obj, secrets)


def _redact(obj: Any, secrets: list[str]) -> Any:
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    if isinstance(obj, Mapping):
        out = {k: REDACTED if _is_secret_key(k) and v is not None else _redact(v, secrets) for k, v in obj.items()}
        try:
            return type(obj)(out)  # AttributeDict, OrderedDict...
        except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
            return out
    if hasattr(obj, "clone") and hasattr(obj, "items") and callable(getattr(obj, "items")):  # jsonargparse Namespace
        ns = obj.clone()
        for key, value in obj.items():
            ns[key] = REDACTED if _is_secret_key(key) and value is not None else _redact(value, secrets)
        return ns
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_redact(v, secrets) for v in obj)
    if isinstance(obj, list):
        return [_redact(v, secrets) for v in obj]
    return obj


def keep_argv_out_of_trackers(argv: Sequence[str] | None = None) -> bool:
    """wandb records the command line (`sys.argv`) in its run metadata. When the command line carries
    a secret, turn that collection off for this process (`WANDB__DISABLE_META`, read when wandb starts)
    and say so. Returns True when it did."""
    args = list(sys.argv[1:] if argv is None else argv)
    joined = "\n".join(args)
    if redact_text(joined) == joined:
        return False
    os.environ["WANDB__DISABLE_META"] = "true"
    log.warning(
        "a credential appears on the command line: wandb's system metadata (which records the command line) "
        "is off for this run; pass credentials through the environment instead"
    )
    return True


class SecretLogFilter(logging.Filter):
    """Rewrites log records that contain a secret before any handler writes them."""

    def __init__(self, secrets: Iterable[str] | None = None) -> None:
        super().__init__()
        self.secrets = secret_values() if secrets is None else list(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is the handler's problem, not ours
            return True
        clean = redact_text(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_LOGGERS = ("", "lightning", "lightning.pytorch", "lightning.fabric", "vitlab")


class RedactSecrets(Callback):
    """Keeps credentials out of everything a run writes.

    At setup (before `SaveConfigCallback` writes config.yaml and before the loggers record
    hyperparameters) it redacts the config the save-config callback holds (a redacted copy) and the
    LightningModule's and DataModule's hparams (in place: the attributes the objects were built with
    keep their values), and installs `SecretLogFilter` on the log handlers. `AtomicCheckpointIO`
    redacts the hyperparameters of each checkpoint once more. A checkpoint whose hparams held a secret
    (say, an `init_from` URL with a password) therefore does not rebuild by itself from them.
    """

    def __init__(self) -> None:
        self._filter: SecretLogFilter | None = None
        self._handlers: list[logging.Handler] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        secrets = secret_values()
        for cb in trainer.callbacks:
            if isinstance(cb, SaveConfigCallback):
                cb.config = redact(cb.config, secrets)
        for holder in (pl_module, trainer.datamodule):
            if holder is None:
                continue
            for attr in ("_hparams", "_hparams_initial"):  # hparams_initial is what the loggers record
                hp = getattr(holder, attr, None)
                if isinstance(hp, dict):
                    hp.update(redact(dict(hp), secrets))
        self._install_filter(secrets)

    def _install_filter(self, secrets: list[str]) -> None:
        self._remove_filter()
        self._filter = SecretLogFilter(secrets)
        for name in _LOGGERS:
            for handler in logging.getLogger(name).handlers:
                handler.addFilter(self._filter)
                self._handlers.append(handler)

    def _remove_filter(self) -> None:
        if self._filter is not None:
            for handler in self._handlers:
                handler.removeFilter(self._filter)
        self._filter, self._handlers = None, []

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_filter()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_filter()


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
      are not restored mid-epoch.) Rank 0's states are stored.
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

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

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


# ---- stateful data loading ---------------------------------------------------------------------


def stateful_loader(loader: DataLoader) -> DataLoader:
    """The same loader as a `torchdata.stateful_dataloader.StatefulDataLoader`, whose
    `state_dict()` / `load_state_dict()` Lightning stores in checkpoints and restores on resume, so a
    run resumed mid-epoch sees exactly the batches the interrupted one had not yet trained on.

    A loader that is already stateful is returned as is. Shuffling keeps the loader's own generator
    (torchdata's RandomSampler checkpoints it); any other sampler must be deterministic per epoch
    (DistributedSampler is), because it is fast-forwarded on restore.
    """
    if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
        return loader
    if type(loader) is not DataLoader:  # a subclass's own behaviour would be lost in the copy
        raise TypeError(f"{type(loader).__name__} is not a plain DataLoader; derive it from StatefulDataLoader instead")
    from torchdata.stateful_dataloader import StatefulDataLoader

    kwargs: dict[str, Any] = dict(
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device,
    )  # fmt: skip
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    sampler = loader.sampler
    if loader.batch_size is None:  # a custom batch_sampler, or no batching
        kwargs["batch_sampler" if loader.batch_sampler is not None else "batch_size"] = loader.batch_sampler
    else:
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
        if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
            gen = sampler.generator if sampler.generator is not None else loader.generator
            kwargs.update(shuffle=True, generator=gen)
        elif type(sampler) is not SequentialSampler and not _is_iterable_dataset(loader):
            kwargs["sampler"] = sampler
    return StatefulDataLoader(loader.dataset, **kwargs)


def _is_iterable_dataset(loader: DataLoader) -> bool:
    return isinstance(loader.dataset, torch.utils.data.IterableDataset)


# ---- non-finite loss ----------------------------------------------------------------------------


class NonFiniteLossError(RuntimeError):
    """Training hit a NaN/Inf loss or gradient; the message names the step, LR and last good checkpoint."""


class NonFiniteGuard(Callback):
    """Keeps a NaN/Inf loss (or, without a GradScaler, a NaN/Inf gradient) from reaching the weights.

    The check runs after backward and before the optimizer step (`on_before_optimizer_step`), so the
    bad step is never applied. `action="stop"` raises `NonFiniteLossError` naming the global step, the
    learning rate and the last good checkpoint (nothing is saved: last.ckpt keeps the last good
    state). `action="skip"` drops the gradients instead (torch optimizers leave parameters whose
    `.grad` is None untouched: no update, no weight decay, no moment update) and carries on; after
    `max_skips` skipped steps in the run, the next one stops. A skipped batch still counts as a global
    step and advances the LR schedule.

    Costs one host-device synchronisation per optimizer step. With fp16 AMP the GradScaler already
    skips steps with overflowing gradients, so only the loss is checked there.
    """

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_skips: int = 0, check_grads: bool = True) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"NonFiniteGuard action must be 'stop' or 'skip', got {action!r}")
        if max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {max_skips}")
        self.action = action
        self.max_skips = max_skips
        self.check_grads = check_grads
        self.skipped = 0
        self._bad_loss: float | None = None  # the first non-finite loss since the last optimizer step

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._bad_loss is None and not bool(torch.isfinite(loss.detach()).all()):
            self._bad_loss = float(loss.detach().float().reshape(-1)[0])

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        what = None
        if self._bad_loss is not None:
            what = f"loss is {self._bad_loss}"
        elif self.check_grads and getattr(trainer.precision_plugin, "scaler", None) is None:
            bad = _nonfinite_grad(optimizer)
            if bad is not None:
                what = f"gradient of {bad} is not finite (loss was finite)"
        self._bad_loss = None
        # Every rank must take the same decision, or their optimizer steps (and collectives) diverge.
        bad_anywhere = trainer.strategy.reduce_boolean_decision(what is not None, all=False)
        if not bad_anywhere:
            return
        what = what or "another rank saw a non-finite loss or gradient"
        if self.action == "skip" and self.skipped < self.max_skips:
            optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            if trainer.is_global_zero:
                log.warning("NonFiniteGuard: %s at global step %d; skipped this optimizer step (%d of max_skips=%d)",
                            what, trainer.global_step, self.skipped, self.max_skips)  # fmt: skip
            return
        optimizer.zero_grad(set_to_none=True)  # whatever happens next, these gradients must not be applied
        raise NonFiniteLossError(self._message(trainer, optimizer, what))

    def _message(self, trainer: L.Trainer, optimizer: torch.optim.Optimizer, what: str) -> str:
        lrs = sorted({float(g["lr"]) for g in optimizer.param_groups})
        lr = f"{lrs[-1]:.6g}" if len(lrs) == 1 else f"{lrs[-1]:.6g} (groups {lrs[0]:.6g}..{lrs[-1]:.6g})"
        ckpt = last_good_checkpoint(trainer)
        where = f"last good checkpoint: {ckpt}" if ckpt else "no checkpoint has been saved yet"
        skipped = ""
        if self.action == "skip":
            skipped = f" after skipping {self.skipped} step(s) (max_skips={self.max_skips})"
        return (
            f"non-finite training: {what} at global step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch {trainer.fit_loop.epoch_loop.batch_idx}), learning rate {lr}{skipped}. The step was not applied "
            f"and nothing was saved; {where}. Resume from it with --ckpt_path after lowering the learning rate or "
            "fixing the data, or use NonFiniteGuard(action='skip', max_skips=N) to skip such batches."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))


def _nonfinite_grad(optimizer: torch.optim.Optimizer) -> str | None:
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return None
    # One fused reduction (and one sync) instead of one per tensor.
    norms = torch._foreach_norm(grads) if hasattr(torch, "_foreach_norm") else [g.norm() for g in grads]
    if bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):
        return None
    for g in optimizer.param_groups:
        for i, p in enumerate(g["params"]):
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return f"parameter {i} of a group with lr {g['lr']:.3g} (shape {tuple(p.shape)})"
    return "a parameter"


def last_good_checkpoint(trainer: L.Trainer) -> str | None:
    """The most recent checkpoint file the run's checkpoint callbacks wrote (last.ckpt first)."""
    candidates: list[str] = []
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    callbacks.sort(key=lambda cb: not isinstance(cb, LastCheckpoint))
    for cb in callbacks:
        candidates += [cb.last_model_path, cb.best_model_path]
    existing = [p for p in candidates if p and os.path.isfile(p)]
    return max(existing, key=os.path.getmtime) if existing else None


# ---- run folder and disk space ----------------------------------------------------------------------


class RunDirError(RuntimeError):
    """The run folder cannot be written, or its disk lacks room for the run's checkpoints."""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_run_dir(run_dir: _PATH, need_bytes: int = 0, what: str = "") -> None:
    """Create `run_dir` if needed, prove it writable (create + delete a probe file) and, when
    `need_bytes` > 0, that its filesystem has that much free space. Raises RunDirError otherwise."""
    run_dir = str(run_dir)
    if not _is_local_file_protocol(run_dir):
        return  # remote stores: no cheap, meaningful probe
    path = Path(run_dir).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".vitlab-write-probe-")
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise RunDirError(
            f"run folder {path} is not writable ({type(exc).__name__}: {exc.strerror or exc}); "
            "choose another --run_dir or fix its permissions"
        ) from exc
    if need_bytes > 0:
        free = shutil.disk_usage(path).free
        if free < need_bytes:
            raise RunDirError(
                f"not enough free disk space for run folder {path}: about {_fmt_bytes(need_bytes)} needed"
                f"{' (' + what + ')' if what else ''}, {_fmt_bytes(free)} available; free some space or "
                "choose another --run_dir"
            )


def checkpoint_size_estimate(pl_module: torch.nn.Module, optimizer_slots: float = 2.0, averaged: bool = False) -> int:
    """Bytes one training checkpoint takes: weights + buffers + optimizer state (`optimizer_slots`
    copies of the trainable weights: 2 for Adam/AdamW, 1 for SGD with momentum) + an averaged copy
    (EMA) when `averaged`."""
    weights = sum(t.numel() * t.element_size() for t in pl_module.parameters())
    weights += sum(t.numel() * t.element_size() for t in pl_module.buffers())
    trainable = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
    return int(weights + optimizer_slots * trainable + (weights if averaged else 0))


class RunDirCheck(Callback):
    """At the start of fit (rank 0 checks, every rank raises): the run folder is writable and its disk
    has room for `keep` checkpoints (best, last and the temporary copy of an atomic write) plus
    `margin_bytes` for logs. `run_dir` defaults to the trainer's default_root_dir."""

    def __init__(self, run_dir: _PATH | None = None, keep: int = 3, margin_bytes: int = 64 * 2**20) -> None:
        self.run_dir = run_dir
        self.keep = keep
        self.margin_bytes = margin_bytes

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        error = None
        if trainer.is_global_zero:
            run_dir = self.run_dir if self.run_dir is not None else trainer.default_root_dir
            hp = getattr(pl_module, "hparams", {})
            slots = 1.0 if hp.get("optimizer") == "sgd" else 2.0
            averaged = any(isinstance(cb, WeightAveraging) for cb in trainer.callbacks)
            per_ckpt = checkpoint_size_estimate(pl_module, slots, averaged)
            need = self.keep * per_ckpt + self.margin_bytes
            what = f"{self.keep} checkpoints of ~{_fmt_bytes(per_ckpt)} (weights + optimizer state) + logs"
            try:
                check_run_dir(run_dir, need, what)
            except RunDirError as exc:
                error = str(exc)
        error = trainer.strategy.broadcast(error, src=0)
        if error:
            raise RunDirError(error)
