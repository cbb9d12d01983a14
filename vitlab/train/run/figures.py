"""Figures a run logs while it trains: sample predictions, last-layer attention, the confusion matrix,
masked patch prediction's patches, and where a fine-tune run started from.

Images go to TensorBoard and to any logger with `log_image(key, images, step)` (wandb); the latest PNGs
also to `<run_dir>/figures/`, so a CSV-only run has them. Only rank 0 draws; the confusion matrix is
summed across ranks, so it covers the whole validation set.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, WeightAveraging
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from matplotlib.patches import Rectangle
from torchmetrics.classification import MulticlassConfusionMatrix

from vitlab.analysis.commands import class_names
from vitlab.analysis.plots import new_figure, save_figure
from vitlab.data.batch import denormalize, split_batch
from vitlab.train.objectives.mpp import (
    CLEAN, KEPT, MASKED, RANDOM, MaskedPatchPretraining, apply_corruption, color_of_ids, patchify, unpatchify,
)  # fmt: skip

log = logging.getLogger("vitlab")

def _vit(pl_module: L.LightningModule) -> Any:
    return getattr(pl_module, "model", pl_module)


def _short(name: str, n: int = 14) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def _rgb(pixels: torch.Tensor) -> np.ndarray:
    """Pixels `[B, C, H, W]` -> RGB arrays `[B, H, W, 3]` in [0, 1]."""
    return pixels[:, :3].detach().float().clamp(0.0, 1.0).permute(0, 2, 3, 1).cpu().numpy()


def last_layer_attention(model: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits `[B, classes]` and the last block's attention to the patches, `[B, h, w]`, heads averaged,
    from the rows the model pools: the class token's, the mean of the patch rows (GAP), or the rows
    weighted by the learned pooling weights (sequence pooling)."""
    from vitlab.analysis.rollout import pooling_weights

    logits, attn = model.forward_attention(x)
    a = attn[-1].float().mean(dim=1)  # [B, N, N], heads averaged
    row = (pooling_weights(model, x).unsqueeze(1) @ a)[:, 0, int(model.num_prefix_tokens) :]
    h, w = model.patch_embed.grid_size
    return logits.float(), row.reshape(-1, h, w)


def _image_grid(images: np.ndarray, draw: Any, title: str, cell_height: float, title_room: float, hspace: float) -> Any:
    """A near-square grid with `draw(ax, i)` called for each image's cell; empty cells stay blank."""
    cols = max(1, math.ceil(math.sqrt(len(images))))
    rows = math.ceil(len(images) / cols)
    height = cell_height * rows + 0.35
    fig = new_figure((1.7 * cols, height), dpi=100)
    for i, ax in enumerate(fig.subplots(rows, cols, squeeze=False).ravel()):
        ax.set_axis_off()
        if i < len(images):
            ax.imshow(images[i], interpolation="nearest")
            draw(ax, i)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1.0 - title_room / height, wspace=0.1, hspace=hspace)
    fig.suptitle(title, fontsize=9, y=1.0 - 0.06 / height, va="top")
    return fig


def plot_prediction_grid(images: np.ndarray, targets: Sequence[int], preds: Sequence[int], names: Sequence[str]) -> Any:
    """Each image titled `true / pred`, green when right and red when wrong."""

    def draw(ax: Any, i: int) -> None:
        ok = int(targets[i]) == int(preds[i])
        ax.set_title(
            f"{_short(names[targets[i]])}\n→ {_short(names[preds[i]])}", fontsize=7, color="green" if ok else "red"
        )

    return _image_grid(images, draw, "validation samples: true → predicted", 1.9, 0.75, 0.5)


def plot_attention_grid(images: np.ndarray, heat: torch.Tensor, preds: Sequence[int], names: Sequence[str]) -> Any:
    """Each image with its last-layer attention map over it, each map stretched to its own [min, max]:
    early attention is nearly uniform, and one scale would paint every image the same colour."""
    up = F.interpolate(heat[:, None].float().cpu(), size=images.shape[1:3], mode="bilinear", align_corners=False)[:, 0]
    lo, hi = (v.view(-1, 1, 1) for v in up.flatten(1).aminmax(dim=1))
    up = ((up - lo) / (hi - lo).clamp_min(1e-12)).numpy()

    def draw(ax: Any, i: int) -> None:
        ax.imshow(up[i], cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0, interpolation="bilinear")
        ax.set_title(_short(names[preds[i]]), fontsize=7)

    return _image_grid(images, draw, "last-layer attention to the patches (heads averaged)", 1.8, 0.6, 0.3)


def plot_confusion_matrix(matrix: torch.Tensor | np.ndarray, names: Sequence[str]) -> Any:
    """Counts (rows: true class, columns: predicted), coloured by the row fraction (per-class recall)."""
    m = np.asarray(matrix, dtype=np.int64)
    n = m.shape[0]
    frac = m / np.maximum(m.sum(axis=1, keepdims=True), 1)
    side = min(12.0, max(4.0, 0.35 * n + 2.0))
    fig = new_figure((side + 1.0, side), dpi=100, layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(frac, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    if n <= 30:  # beyond that the numbers are unreadable anyway
        for i in range(n):
            for j in range(n):
                if m[i, j]:
                    ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if frac[i, j] > 0.5 else "black")  # fmt: skip
    if n <= 50:
        labels = [_short(s, 16) for s in names]
        ax.set_xticks(range(n), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(n), labels, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    acc = np.trace(m) / max(m.sum(), 1)
    ax.set_title(f"confusion matrix: {m.sum()} images, top-1 {100 * acc:.2f}%", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8, label="fraction of the true class")
    return fig


def _full_weights(trainer: L.Trainer) -> AbstractContextManager:
    """Under FSDP, gather the whole model on rank 0 for a plain forward (a collective: every rank enters)."""
    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False, rank0_only=True)
    return nullcontext()


@contextmanager
def _evaluating(trainer: L.Trainer, module: torch.nn.Module) -> Iterator[None]:
    """`module` in eval mode under the run's precision, put back as it was."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            yield
    finally:
        module.train(was_training)


class ValidationFigures(Callback):
    """Predictions and last-layer attention on fixed images after every `every_n_epochs`-th validation,
    drawn from the weights validated (EMA's under EMA); the confusion matrix at the end of fit/validate.

    The images, taken in the first validation (rank 0's share), are spread over the classes: the first
    of each class, then the next of each (a class-sorted folder would otherwise show one class). The
    confusion matrix reads the logits `validation_step` returns (else a second forward) and is skipped
    above `max_classes` classes (a 21k x 21k matrix is gigabytes per rank).
    """

    def __init__(
        self, num_images: int = 16, every_n_epochs: int = 1, confusion_matrix: bool = True, max_classes: int = 100,
        save_png: bool = True,
    ) -> None:  # fmt: skip
        if num_images < 0:
            raise ValueError(f"num_images must be >= 0, got {num_images}")
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        self.num_images = num_images
        self.every_n_epochs = every_n_epochs
        self.confusion_matrix = confusion_matrix
        self.max_classes = max_classes
        self.save_png = save_png
        self.confmat: MulticlassConfusionMatrix | None = None
        self._by_class: dict[int, list[torch.Tensor]] = {}  # candidates, in the order they arrived
        self._classes = self._per_class = 1  # how many classes the grid shows, and images of each
        self.images: torch.Tensor | None = None  # the fixed sample [n, C, H, W] (normalised, CPU), once taken
        self.targets: torch.Tensor | None = None
        self._frozen = False
        self._confmat_updates = 0
        self._warned_fsdp = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        model = _vit(pl_module)
        nc = int(getattr(model, "num_classes", 0) or 0)
        self._classes = max(1, min(nc, self.num_images)) if nc > 0 else max(1, self.num_images)
        self._per_class = math.ceil(self.num_images / self._classes)
        if self.confusion_matrix and self.confmat is None and 2 <= nc <= self.max_classes:
            self.confmat = MulticlassConfusionMatrix(nc)
        elif self.confusion_matrix and nc > self.max_classes:
            log.info("ValidationFigures: %d classes > max_classes=%d, no confusion matrix", nc, self.max_classes)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._frozen:  # the order is fixed, so restarting the capture yields the same images
            self._by_class = {}
        if self.confmat is not None:
            self.confmat = self.confmat.to(pl_module.device)
            self.confmat.reset()
            self._confmat_updates = 0

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        x, y = split_batch(batch)
        y = y.argmax(dim=1) if y.ndim == 2 else y
        if trainer.is_global_zero and not self._frozen and self.num_images and not trainer.sanity_checking:
            self._collect(x, y)
        if self.confmat is None or trainer.sanity_checking:
            return
        logits = self._logits(trainer, pl_module, outputs, x)
        if logits is not None:
            self.confmat.update(logits.argmax(dim=-1), y.to(logits.device))
            self._confmat_updates += 1

    def _collect(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Keep up to `_per_class` images of each of the first `_classes` classes seen; freeze when full."""
        for img, label in zip(x, y.tolist()):
            if label not in self._by_class and len(self._by_class) >= self._classes:
                continue
            kept = self._by_class.setdefault(label, [])
            if len(kept) < self._per_class:
                kept.append(img.detach().cpu())
        full = [kept for kept in self._by_class.values() if len(kept) >= self._per_class]
        if len(full) >= self._classes:
            self._freeze()

    def _freeze(self) -> None:
        """Round-robin over the classes in the order they were seen: the first of each, then the next."""
        picks = [(kept[rank], label) for rank in range(self._per_class) for label, kept in self._by_class.items()
                 if rank < len(kept)][: self.num_images]  # fmt: skip
        if picks:
            self.images = torch.stack([img for img, _ in picks])
            self.targets = torch.tensor([label for _, label in picks])
        self._by_class = {}
        self._frozen = True

    def _logits(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, x: torch.Tensor) -> Any:
        if isinstance(outputs, Mapping):
            outputs = outputs.get("logits")
        if isinstance(outputs, torch.Tensor) and outputs.ndim == 2 and outputs.shape[0] == x.shape[0]:
            return outputs.detach()
        if isinstance(trainer.strategy, FSDPStrategy):
            # A direct forward would skip FSDP's unsharding; the module must return its logits.
            if not self._warned_fsdp:
                log.warning("ValidationFigures: under FSDP the confusion matrix needs validation_step to return logits")
                self._warned_fsdp = True
            return None
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            return pl_module(x).detach()

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.num_images:
            return
        if not self._frozen and trainer.is_global_zero:
            self._freeze()
        off_epoch = trainer.state.fn == TrainerFn.FITTING and (trainer.current_epoch + 1) % self.every_n_epochs
        if off_epoch or not (self.save_png or trainer.loggers):  # the same on every rank: FSDP ranks stay in step
            return
        with _full_weights(trainer):
            if trainer.is_global_zero and self.images is not None:
                self._draw_samples(trainer, pl_module)

    def _validated(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        """The module holding the weights validation used: a weight-averaging callback (EMA) whose hook
        ran before this one has already swapped them back into its averaged copy."""
        for cb in trainer.callbacks[: trainer.callbacks.index(self)]:
            if isinstance(cb, WeightAveraging) and getattr(cb, "_average_model", None) is not None:
                return cb._average_model.module
        return pl_module

    def _draw_samples(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = _vit(self._validated(trainer, pl_module))
        param = next(model.parameters())
        x = self.images.to(param.device, dtype=param.dtype if param.is_floating_point() else None)
        y = self.targets
        with _evaluating(trainer, model):
            if hasattr(model, "forward_attention"):
                logits, heat = last_layer_attention(model, x)
            else:
                logits, heat = model(x).float(), None
        preds = logits.argmax(dim=-1).cpu().tolist()
        names = class_names(model, logits.shape[-1])
        dc = getattr(model, "data_config", None) or {}
        rgb = _rgb(denormalize(x, dc.get("mean"), dc.get("std")))
        self._emit(trainer, "val/predictions", plot_prediction_grid(rgb, y.tolist(), preds, names))
        if heat is not None:
            self._emit(trainer, "val/attention", plot_attention_grid(rgb, heat, preds, names))

    def _emit(self, trainer: L.Trainer, tag: str, fig: Any) -> None:
        fig.canvas.draw()
        image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(tag, image, global_step=trainer.global_step, dataformats="HWC")
            elif callable(getattr(logger, "log_image", None)):
                logger.log_image(key=tag, images=[image], step=trainer.global_step)
        if self.save_png:
            save_figure(fig, Path(trainer.default_root_dir) / "figures" / f"{tag.split('/')[-1]}.png")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log_confusion_matrix(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING and not trainer.sanity_checking:
            self._log_confusion_matrix(trainer, pl_module)

    def _log_confusion_matrix(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.confmat is None:
            return
        # compute() is a collective: the ranks first agree whether any saw data, so all enter it or none.
        if not trainer.strategy.reduce_boolean_decision(self._confmat_updates > 0, all=False):
            return
        matrix = self.confmat.compute().cpu()
        if trainer.is_global_zero:
            names = class_names(_vit(pl_module), matrix.shape[0])
            self._emit(trainer, "val/confusion_matrix", plot_confusion_matrix(matrix, names))


class FinetuneSource(Callback):
    """Records where a fine-tune run started (the module's `init_summary`: source, position-embedding
    grid and class count before and after): as hyperparameters (CSV's hparams.yaml, wandb's config) and
    as TensorBoard text (Lightning wrote its hparams table before this runs)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = getattr(pl_module, "init_summary", None)
        if not trainer.is_global_zero or not isinstance(summary, Mapping) or not summary:
            return
        summary = {str(k): str(v) for k, v in summary.items()}
        text = "  \n".join(f"**{k}**: `{v}`" for k, v in summary.items())
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("finetune/source", text, global_step=trainer.global_step)
            else:
                logger.log_hyperparams({f"finetune/{k}": v for k, v in summary.items()})
                logger.save()  # CSV writes hparams.yaml on save


def _outline(ax: Any, cells: np.ndarray, grid: tuple[int, int], patch: int, color: str) -> None:
    for n in np.flatnonzero(cells):
        r, col = divmod(int(n), grid[1])
        ax.add_patch(Rectangle((col * patch - 0.5, r * patch - 0.5), patch, patch, fill=False, lw=0.8, ec=color))


def plot_masked_patches(
    images: np.ndarray, corrupted: np.ndarray, predicted: np.ndarray, kind: np.ndarray, grid: tuple[int, int],
    patch: int, predicted_title: str,
) -> Any:  # fmt: skip
    """Three rows: the images, their corrupted patches (grey: [mask]; outlined: all corrupted, red where
    kept or replaced by another patch) and the images with the corrupted patches predicted."""
    n = len(images)
    fig = new_figure((1.25 * n + 0.2, 4.3), dpi=100)
    axes = fig.subplots(3, n, squeeze=False)
    rows = [(images, "images"), (corrupted, "corrupted patches"), (predicted, predicted_title)]
    for r, (row, title) in enumerate(rows):
        for i in range(n):
            ax = axes[r, i]
            ax.set_axis_off()
            ax.imshow(row[i], interpolation="nearest")
            if r == 1:
                _outline(ax, kind[i] == MASKED, grid, patch, "white")
                _outline(ax, (kind[i] == RANDOM) | (kind[i] == KEPT), grid, patch, "red")
            if i == 0:
                ax.set_title(title, fontsize=8, loc="left")
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.93, wspace=0.05, hspace=0.2)
    return fig


class MaskedPatchFigures(ValidationFigures):
    """Fixed validation images beside their corrupted patches and the predictions filled into them
    (`val/masked_patches`); capture, cadence and loggers as `ValidationFigures`, no confusion matrix."""

    def __init__(self, num_images: int = 8, every_n_epochs: int = 1, save_png: bool = True) -> None:
        super().__init__(num_images, every_n_epochs, confusion_matrix=False, save_png=save_png)

    def _draw_samples(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, MaskedPatchPretraining):
            raise TypeError(f"MaskedPatchFigures needs a MaskedPatchPretraining module, got {type(pl_module).__name__}")
        param = next(pl_module.parameters())
        x = self.images.to(param.device, dtype=param.dtype)
        generator = torch.Generator(device=x.device).manual_seed(0)  # the same corruption every time
        with _evaluating(trainer, pl_module):
            out, c = pl_module(x, generator)
        p, grid = pl_module.patch_size, pl_module.model.patch_embed.grid_size
        pixels = pl_module._unnormalize(x)
        patches = patchify(pixels, p)
        chosen = (c.kind != CLEAN)[..., None]
        # Corrupted view: what each position holds now ([mask] drawn grey, another patch's pixels).
        held = apply_corruption(patches, c, 0.5)
        if pl_module.hparams.target == "color":
            colors = color_of_ids(out.argmax(dim=-1), pl_module.hparams.color_bits)  # [B, N, 3]
            guess = colors.repeat(1, 1, p * p)  # (p1 p2 c) order: the colour repeated per pixel
            title = "predicted mean colours"
        else:
            guess = patchify(pl_module._unnormalize(unpatchify(out.float(), p, grid)), p)
            title = "predicted pixels"
        filled = torch.where(chosen, guess, patches)
        rgb = [_rgb(unpatchify(t, p, grid)) for t in (patches, held, filled)]
        fig = plot_masked_patches(*rgb, c.kind.cpu().numpy(), grid, p, title)
        self._emit(trainer, "val/masked_patches", fig)
