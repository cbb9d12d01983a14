"""`EndRanksOnFailure`: rank 0's failure ends the ranks it launched."""

from __future__ import annotations

import logging
import signal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger("vitlab")


class EndRanksOnFailure(Callback):
    """When rank 0 of `--trainer.devices=N` (which launched the other ranks) fails, end those ranks:
    Lightning does so for Ctrl-C only (`_SubprocessScriptLauncher.kill` from `_interrupt`), and a rank left
    waiting in a collective holds its GPU until the process-group timeout. torchrun and SLURM launch ranks
    themselves and end them on their own. SIGTERM is left alone: every rank saves and exits on its own."""

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            return
        launcher = trainer.strategy.launcher
        procs = getattr(launcher, "procs", None)
        if isinstance(launcher, _SubprocessScriptLauncher) and procs:
            log.error("rank 0 failed (%s: %s); ending the %d ranks it started", type(exception).__name__, exception,
                      len(procs))  # fmt: skip
            launcher.kill(signal.SIGKILL)
