"""The Lightning internals vitlab's exact resume and signal handling rely on, in one place.

Each function names the private attribute it touches. They are tested on Lightning 2.6
(`TESTED_LIGHTNING`); `check_lightning_version` stops a run on any other version with a clear
message, since a silently changed internal would break exact resume without an error.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

log = logging.getLogger("vitlab")

TESTED_LIGHTNING = "2.6"  # major.minor


def check_lightning_version(version: str | None = None) -> None:
    """Raise RuntimeError unless Lightning is a `TESTED_LIGHTNING` release."""
    version = L.__version__ if version is None else version
    if version.split(".")[:2] != TESTED_LIGHTNING.split("."):
        raise RuntimeError(
            f"vitlab's exact resume and signal handling use Lightning internals tested on Lightning "
            f"{TESTED_LIGHTNING}.x, but Lightning {version} is installed. Install a tested release "
            f"(pip install 'lightning~={TESTED_LIGHTNING}.0'), or check vitlab/train/reliability/lightning_internals.py "
            "against this version and update TESTED_LIGHTNING."
        )


# ---- the fit loop's train loader (`fit_loop._combined_loader`, `fit_loop._data_fetcher`) -------------


def train_loaders(trainer: L.Trainer | None) -> list[Any]:
    """The train DataLoaders of the running fit (`CombinedLoader.flattened`); [] before they exist."""
    loader = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    return list(loader.flattened) if loader is not None else []


def train_loader_states(trainer: L.Trainer | None) -> list[dict[str, Any]]:
    """This rank's train loader states, as Lightning stores them (`CombinedLoader._state_dicts`)."""
    loader = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    return loader._state_dicts() if loader is not None else []


def pop_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Take the train loaders' saved states out of a checkpoint, so Lightning does not apply them
    (`loops.fit_loop.state_dict.combined_loader`)."""
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    return fit_state.pop("combined_loader", None) or None


def restore_train_loaders(trainer: L.Trainer, states: list[dict[str, Any]] | None) -> bool:
    """Apply loader `states` (None: none) and restart the fit loop's fetcher (`fit_loop._data_fetcher`)
    on them (`CombinedLoader._load_state_dicts`). False when the fit loop has no loader yet."""
    fit_loop = trainer.fit_loop
    loader, fetcher = getattr(fit_loop, "_combined_loader", None), getattr(fit_loop, "_data_fetcher", None)
    if loader is None or fetcher is None:
        return False
    if states:
        loader._load_state_dicts(states)
    iter(fetcher)
    return True


# ---- signals (`trainer._signal_connector`, Lightning's SIGTERM notifier) --------------------------------


def replace_sigterm_notifier(trainer: L.Trainer, handler: Callable[[int, Any], None]) -> bool:
    """Swap Lightning's SIGTERM notifier for `handler` in the composed SIGTERM handler it installed.

    Lightning 2.6's notifier calls `dist.broadcast` inside the signal handler, at whatever point the
    rank was interrupted; ranks interrupted at different points then run mismatched collectives
    (a deadlock under NCCL, an abort under gloo), and a rank blocked in a collective never gets to run
    it at all. Returns False when the installed handler is not Lightning's (nothing replaced).
    """
    current = signal.getsignal(signal.SIGTERM)
    if not isinstance(current, _HandlersCompose):
        return False
    handlers = list(current.signal_handlers)
    for i, h in enumerate(handlers):
        if getattr(h, "__func__", None) is _SignalConnector._sigterm_notifier_fn:
            handlers[i] = handler
            current.signal_handlers = handlers
            return True
    return False


def mark_sigterm(trainer: L.Trainer) -> None:
    """Set the flag Lightning's loops check to stop with `SIGTERMException` at the end of this batch."""
    trainer._signal_connector.received_sigterm = True


def forward_signal_to_launched_ranks(trainer: L.Trainer, signum: int) -> None:
    """Send `signum` to the ranks this process launched (Lightning's `ddp` launcher), as its notifier did."""
    launcher = getattr(trainer.strategy, "launcher", None)
    if launcher is not None:
        launcher.kill(signum)


def end_launched_ranks(trainer: L.Trainer) -> None:
    """SIGKILL the ranks this process launched, which would otherwise wait on it forever."""
    launcher = getattr(trainer.strategy, "launcher", None)
    if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
        launcher.kill(signal.SIGKILL)
