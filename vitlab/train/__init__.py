"""Training, in three rooms with arrows one way (run -> objectives, run -> reliability; both of those import
only `grad_step`, the optimizer step's shared gradient norm and skip flag, never `run`):

- `objectives/`: what is learned and how it is optimised: the classifier, masked patch prediction, DeiT
  distillation, the optimizer and the LR schedule (LightningModules).
- `reliability/`: what keeps a run safe: last.ckpt and signals, exact resume, the signal watchdog, atomic
  checkpoint IO, the non-finite and run-folder guards, credential redaction, the Lightning internals used.
- `run/`: how a run is assembled: the default loggers, callbacks and plugins, figures, EMA and throughput,
  the image-size schedule, host-sync counting.
"""

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
