"""Progressive resizing: train at the sizes `data.img_size_schedule` lists, validate at the full size.

An epoch's size follows from `trainer.current_epoch` alone, so DDP ranks switch together and a resumed run
continues the schedule. The data module crops train images to it; this callback has the model take it
through `use_input_size` (position embeddings stay at the full grid, resampled per forward). Under
`compile` each new size costs a recompilation.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from vitlab.models.vit import VisionTransformer


class ImgSizeSchedule(Callback):
    """Applies the data module's `img_size_schedule` (nothing when it has none); see the module doc."""

    def __init__(self) -> None:
        self.active = False
        self._size: int | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        schedule = getattr(trainer.datamodule, "img_size_schedule", None)
        self.active = bool(schedule) and stage == "fit"
        if not self.active:
            return
        model = getattr(pl_module, "model", None)
        if not isinstance(model, VisionTransformer) or not getattr(pl_module, "uses_labels", True):
            raise ValueError(
                f"data.img_size_schedule needs a classifier of a vitlab ViT (ViTClassifier), not "
                f"{type(pl_module).__name__}; drop img_size_schedule"
            )
        patch = model.patch_embed.patch_size
        for epoch, size in schedule:
            if size % patch:
                lo, hi = max(patch, size // patch * patch), -(-size // patch) * patch
                raise ValueError(
                    f"data.img_size_schedule size {size} (from epoch {epoch}) is not a multiple of the model's "
                    f"patch size {patch}; use {lo} or {hi}"
                )

    def _apply(self, trainer: Trainer, pl_module: LightningModule) -> None:
        size = trainer.datamodule.img_size_at(trainer.current_epoch)
        pl_module.model.use_input_size(size)
        if size != self._size:
            rank_zero_info(f"img_size_schedule: epoch {trainer.current_epoch} trains at {size}x{size}")
            self._size = size

    # Each epoch, and before the first batch: that also covers a mid-epoch resume, where Lightning
    # skips on_train_epoch_start.
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.active:
            self._apply(trainer, pl_module)

    on_train_start = on_train_epoch_start

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.active:
            pl_module.model.use_input_size(None)

    on_fit_end = on_validation_start

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation inside an epoch (val_check_interval) hands back to training at the epoch's size.
        if self.active and not trainer.sanity_checking:
            self._apply(trainer, pl_module)
