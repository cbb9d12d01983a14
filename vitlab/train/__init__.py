"""Training, in three rooms with arrows one way (run -> objectives, run -> reliability; those two share only
`grad_step`): `objectives/` (what is learned: the LightningModules, optimizer, LR schedule), `reliability/`
(what keeps a run safe) and `run/` (how a run is assembled: defaults, figures, EMA, throughput)."""

from vitlab.train.objectives.classifier import ViTClassifier
from vitlab.train.objectives.distill import DistillClassifier
from vitlab.train.objectives.mpp import MaskedPatchPretraining
from vitlab.train.objectives.optim import build_optimizer, layer_id, param_groups
from vitlab.train.objectives.schedule import build_scheduler, resolve_warmup_steps, warmup_schedule
from vitlab.train.run.callbacks import EMA, PerfMonitor, batch_images, flops_per_image

__all__ = [
    "EMA", "DistillClassifier", "MaskedPatchPretraining", "PerfMonitor", "ViTClassifier", "batch_images",
    "build_optimizer", "build_scheduler", "flops_per_image", "layer_id", "param_groups", "resolve_warmup_steps",
    "warmup_schedule",
]
