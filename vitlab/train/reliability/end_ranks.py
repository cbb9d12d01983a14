"""`EndRanksOnFailure`: rank 0's failure ends the ranks it launched."""

from __future__ import annotations

import logging
import signal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger("vitlab")


class EndRanksOnFailure(Callback):
    """When rank 0 of `--trainer.devices=N` (which launched the other ranks) fails, end those ranks, or one
    left waiting in a collective holds its GPU until the process-group timeout. Lightning falls short:
    `trainer/call.py::_call_and_handle_interrupt` kills them on KeyboardInterrupt only and re-raises anything
    else with them alive. torchrun and SLURM end the ranks they launch on their own. SIGTERM is left alone:
    every rank saves and exits on its own."""

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        procs = getattr(trainer.strategy.launcher, "procs", None)  # the children Lightning's launcher started
        if procs and not isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            log.error("rank 0 failed (%s: %s); ending the %d ranks it started", type(exception).__name__, exception,
                      len(procs))  # fmt: skip
            trainer.strategy.launcher.kill(signal.SIGKILL)
