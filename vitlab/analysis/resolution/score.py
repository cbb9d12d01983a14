"""Scoring a model on a validation split with ViTClassifier's own evaluation step (val/acc1, val/loss),
through `Trainer.validate`: the same hooks, metrics and device transfer as `vitlab validate`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import lightning as L

from vitlab.models import VisionTransformer

Limit = int | float | None


class _CountImages(L.Callback):
    """Images scored: ViTClassifier's metrics give fractions, the table also says of how many."""

    def __init__(self) -> None:
        self.images = 0

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        from vitlab.data.batch import split_batch

        self.images += int(split_batch(batch)[0].shape[0])


def evaluation_module(model: VisionTransformer) -> L.LightningModule:
    """A ViTClassifier around `model` (the same object, not a copy), for its validation step."""
    from vitlab.train import ViTClassifier

    module = ViTClassifier(model_args=dict(model.config), num_classes=model.num_classes)
    module.model = model  # the resampled weights; the module built its own model of the same config
    # Scoring only: none of the objective's own callbacks (its validation figures would be drawn at every size).
    module.configure_callbacks = list  # type: ignore[method-assign]
    return module


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """No "GPU available..." banner for every size's Trainer."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def score(
    model: VisionTransformer,
    datamodule: L.LightningDataModule,
    accelerator: str = "auto",
    precision: str = "32-true",
    limit_batches: Limit = None,
) -> tuple[float, float, int]:
    """(top-1, NLL, images) of `model` on `datamodule`'s validation split: ViTClassifier's val/acc1 and
    val/loss over the first `limit_batches` batches (a fraction as Lightning's `limit_val_batches`; None: all)."""
    if datamodule.num_classes != model.num_classes:
        raise ValueError(
            f"the data has {datamodule.num_classes} classes but the checkpoint's head {model.num_classes}; "
            "score each checkpoint on its own data (--data once per --ckpt)"
        )
    names = model.data_config.get("class_names")
    if names and list(names) != list(datamodule.class_names):
        raise ValueError("the data's class names differ from the checkpoint's (another class order?); "
                         "score each checkpoint on the data it was trained on")  # fmt: skip
    counter = _CountImages()
    with _quiet_lightning():
        trainer = L.Trainer(
            accelerator=accelerator, devices=1, precision=precision, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, callbacks=[counter],
            limit_val_batches=1.0 if limit_batches is None else limit_batches,
        )  # fmt: skip
        trainer.validate(evaluation_module(model), datamodule=datamodule, verbose=False)
    metrics = trainer.callback_metrics
    return float(metrics["val/acc1"]), float(metrics["val/loss"]), counter.images
