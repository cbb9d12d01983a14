"""Training: the LightningModule, optimizer and LR schedule, and callbacks."""

from vitlab.train.callbacks import EMA, PerfMonitor, RateMeter, batch_images
from vitlab.train.module import ViTClassifier
from vitlab.train.optim import build_optimizer, layer_id, param_groups
from vitlab.train.schedule import build_scheduler, resolve_warmup_steps, warmup_schedule

__all__ = [
    "EMA", "PerfMonitor", "RateMeter", "ViTClassifier", "batch_images", "build_optimizer", "build_scheduler",
    "layer_id", "param_groups", "resolve_warmup_steps", "warmup_schedule",
]
