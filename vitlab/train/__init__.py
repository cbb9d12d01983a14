"""Training: the LightningModule, optimizer and LR schedule, and callbacks."""

from vitlab.train.callbacks import EMA, PerfMonitor, batch_images, flops_per_image
from vitlab.train.distill import DistillClassifier
from vitlab.train.module import ViTClassifier
from vitlab.train.mpp import MaskedPatchPretraining
from vitlab.train.optim import build_optimizer, layer_id, param_groups
from vitlab.train.schedule import build_scheduler, resolve_warmup_steps, warmup_schedule

__all__ = [
    "EMA", "DistillClassifier", "MaskedPatchPretraining", "PerfMonitor", "ViTClassifier", "batch_images",
    "build_optimizer", "build_scheduler", "flops_per_image", "layer_id", "param_groups", "resolve_warmup_steps",
    "warmup_schedule",
]
