"""The Lightning internals (with no public route) vitlab's exact resume and signal handling rely on, each
with the reason. Tested on `TESTED_LIGHTNING`: a silently changed internal would break exact resume
without an error, so `check_lightning_version` stops a run on any other version."""

from __future__ import annotations

from typing import Any

import lightning as L

TESTED_LIGHTNING = "2.6"  # major.minor


def check_lightning_version(version: str | None = None) -> None:
    """Raise RuntimeError unless Lightning is a `TESTED_LIGHTNING` release."""
    version = L.__version__ if version is None else version
    if version.split(".")[:2] != TESTED_LIGHTNING.split("."):
        raise RuntimeError(
            f"vitlab's exact resume and signal handling use Lightning internals tested on Lightning "
            f"{TESTED_LIGHTNING}.x, but Lightning {version} is installed. Install a tested release "
            f"(pip install 'lightning~={TESTED_LIGHTNING}.0'), or check "
            "vitlab/train/reliability/lightning_internals.py against this version and update TESTED_LIGHTNING."
        )


def pop_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Take the train loaders' states (rank 0's) out of a checkpoint, or Lightning would apply them on every
    rank whenever `FitLoop.setup_data` runs after the restore."""
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    return fit_state.pop("combined_loader", None) or None


def restart_fetcher(trainer: L.Trainer) -> None:
    """Make the fit loop's fetcher start a new iterator: it made its own before the loaders' states were
    restored, and a resumed epoch makes no new one."""
    iter(trainer.fit_loop._data_fetcher)


def mark_sigterm(trainer: L.Trainer) -> None:
    """Have Lightning's loops stop with `SIGTERMException` at the end of this batch: `trainer.should_stop`
    ends the epoch instead (validation runs, the epoch counts as done), so a resume would skip its rest."""
    trainer._signal_connector.received_sigterm = True
