"""DeiT distillation (arXiv 2012.12877): a distilled ViT student learns from a frozen teacher.

The student (`distilled=True`) has two prefix tokens with a head each. Training loss, with
`alpha = distill_alpha` (DeiT: 1/2):

- hard (DeiT's best): `(1 - alpha) * CE(class head, labels) + alpha * CE(distillation head, teacher's argmax)`
- soft: `(1 - alpha) * CE(class head, labels) + alpha * tau^2 * KL(softmax(teacher / tau) || softmax(dist / tau))`

The soft KL term is summed over classes and divided by the batch size (`distill_kl_reduction:
batchmean`, the KL divergence per sample, as its definition reads). DeiT's code divides the summed
KL by batch x classes instead (`deit`: 1/classes of it, e.g. 1/1000 on ImageNet), so its published
`alpha` / `tau` reproduce only with `distill_kl_reduction: deit`.

The student predicts with the mean of its two heads' logits (what the model's `forward` returns,
as DeiT, timm and transformers do); the training accuracy and validation measure that. The
teacher is any checkpoint `load_pretrained` reads (a path, `hf-hub:ORG/NAME`, a URL), or a
torchvision CNN's state dict (`teacher_arch` names the torchvision model; a path or a URL); it
runs in eval mode without gradients, on the student's (augmented) images converted to its own
input transform: the student's normalisation undone, resized to the teacher's input size,
normalised with the teacher's mean and std. It is read when fitting starts (a missing or unfitting
teacher stops the run before the first step) and kept out of the module's parameters, state dict and
checkpoints: validating, testing or exporting a distilled student never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from vitlab.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from vitlab.data.batch import denormalize
from vitlab.train.objectives.classifier import ViTClassifier

Distillation = Literal["hard", "soft"]
KLReduction = Literal["batchmean", "deit"]


def distillation_loss(
    cls_logits: torch.Tensor,
    dist_logits: torch.Tensor,
    target: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: Distillation = "hard",
    alpha: float = 0.5,
    tau: float = 1.0,
    label_smoothing: float = 0.0,
    kl_reduction: KLReduction = "batchmean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, class-head loss, distillation-head loss). `target` is class indices or probabilities
    (MixUp/CutMix); label smoothing applies to the class head only, as in DeiT. `kl_reduction` (soft
    only): `batchmean` divides the summed KL by the batch size, `deit` by batch x classes (DeiT's code)."""
    cls_loss = F.cross_entropy(cls_logits.float(), target, label_smoothing=label_smoothing)
    teacher_logits = teacher_logits.float()
    if kind == "hard":
        dist_loss = F.cross_entropy(dist_logits.float(), teacher_logits.argmax(dim=-1))
    elif kind == "soft":
        student = F.log_softmax(dist_logits.float() / tau, dim=-1)
        teacher = F.log_softmax(teacher_logits / tau, dim=-1)
        kl = F.kl_div(student, teacher, reduction="sum", log_target=True)
        if kl_reduction == "batchmean":
            kl = kl / dist_logits.shape[0]
        elif kl_reduction == "deit":
            kl = kl / dist_logits.numel()
        else:
            raise ValueError(f"unknown distill_kl_reduction {kl_reduction!r}; choose 'batchmean' or 'deit'")
        dist_loss = kl * tau * tau
    else:
        raise ValueError(f"unknown distillation {kind!r}; choose 'hard' or 'soft'")
    return (1 - alpha) * cls_loss + alpha * dist_loss, cls_loss, dist_loss


def _read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A torchvision-style state dict from `.safetensors` or a `weights_only` torch file (a path or a
    URL, fetched once into the download cache), unwrapped, with DDP/compile/Lightning prefixes removed."""
    from vitlab.interop import resolve_source
    from vitlab.interop.architecture import WRAPPER_PREFIXES, strip_prefix
    from vitlab.interop.files import read_checkpoint, unwrap_state_dict

    source = resolve_source(path)
    if not source.path.is_file():
        raise FileNotFoundError(f"teacher checkpoint {path!r} does not exist")
    tensors = unwrap_state_dict(read_checkpoint(source.path, name=source.label).obj, path)
    return {new: tensors[old] for new, old in strip_prefix(tensors, (*WRAPPER_PREFIXES, "model.")).items()}


def load_teacher(path: str, arch: str | None, num_classes: int) -> tuple[nn.Module, dict[str, Any]]:
    """The teacher in eval mode without gradients, and its input transform (`mean`, `std`, `img_size`;
    `img_size` None: the student's input size)."""
    if arch is None:
        from vitlab.interop import load_pretrained

        teacher = load_pretrained(path)
        transform = {k: teacher.data_config[k] for k in ("mean", "std", "img_size")}
        out = teacher.num_classes
    else:
        import torchvision

        if arch not in torchvision.models.list_models():
            raise ValueError(f"teacher_arch={arch!r} is not a torchvision model; e.g. resnet18, resnet50")
        teacher = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        try:
            teacher.load_state_dict(_read_state_dict(path))
        except RuntimeError as e:
            raise ValueError(
                f"teacher checkpoint {path!r} does not fit torchvision's {arch} with {num_classes} classes "
                f"(the student's): {str(e).splitlines()[0]} ...; check teacher_arch and that the teacher "
                "was trained on the same classes"
            ) from e
        # torchvision's ImageNet weights expect these; a teacher trained otherwise states its own.
        transform = {"mean": list(IMAGENET_DEFAULT_MEAN), "std": list(IMAGENET_DEFAULT_STD), "img_size": None}
        out = num_classes
    if out != num_classes:
        raise ValueError(f"the teacher predicts {out} classes, the student {num_classes}: use a teacher of this data")
    teacher.eval().requires_grad_(False)
    return teacher, transform


def to_teacher_input(
    x: torch.Tensor,
    student_mean: Sequence[float],
    student_std: Sequence[float],
    teacher_mean: Sequence[float],
    teacher_std: Sequence[float],
    teacher_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """Student-normalised images -> the teacher's input: pixels back, resized, teacher-normalised."""
    shape = (1, -1, 1, 1)
    pixels = denormalize(x, student_mean, student_std)
    if teacher_size is not None and tuple(teacher_size) != tuple(x.shape[-2:]):
        pixels = F.interpolate(pixels, size=tuple(teacher_size), mode="bicubic", antialias=True, align_corners=False)
    mean = pixels.new_tensor(teacher_mean).view(shape)
    std = pixels.new_tensor(teacher_std).view(shape)
    return (pixels - mean) / std


class DistillClassifier(ViTClassifier):
    """`ViTClassifier` with DeiT distillation; see the module docstring. The student must be
    distilled (`arch: deit_*_distilled_patch16`, or `model_args: {distilled: true}`).

    Arguments besides `ViTClassifier`'s: `teacher` (checkpoint path, hub name or URL), `teacher_arch`
    (a torchvision model name for a CNN teacher; None: a ViT `load_pretrained` reads), `distillation`
    (hard/soft), `distill_alpha`, `distill_tau` and `distill_kl_reduction` (soft only), and
    `teacher_mean` / `teacher_std` / `teacher_img_size` to override the teacher's input transform when
    its checkpoint does not record it (a torchvision teacher defaults to ImageNet mean/std at the
    student's size).
    """

    def __init__(
        self,
        *args: Any,
        teacher: str,
        teacher_arch: str | None = None,
        distillation: Distillation = "hard",
        distill_alpha: float = 0.5,
        distill_tau: float = 1.0,
        distill_kl_reduction: KLReduction = "batchmean",
        teacher_mean: list[float] | None = None,
        teacher_std: list[float] | None = None,
        teacher_img_size: int | list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if distillation not in ("hard", "soft"):
            raise ValueError(f"unknown distillation {distillation!r}; choose 'hard' or 'soft'")
        if not 0.0 <= distill_alpha <= 1.0:
            raise ValueError(f"distill_alpha must lie in [0, 1] (got {distill_alpha})")
        if distill_tau <= 0:
            raise ValueError(f"distill_tau must be positive (got {distill_tau})")
        if distill_kl_reduction not in ("batchmean", "deit"):
            raise ValueError(f"unknown distill_kl_reduction {distill_kl_reduction!r}; choose 'batchmean' or 'deit'")
        super().__init__(*args, **kwargs)
        if not self.model.distilled:
            raise ValueError(
                "DistillClassifier needs a distilled student (a distillation token and head): use "
                "arch: deit_tiny_distilled_patch16 (or another *_distilled_* name) or model_args: {distilled: true}"
            )
        # A plain attribute (not a submodule): no parameters in the optimizer or the checkpoint,
        # untouched by `train()`, and not wrapped by DDP/FSDP.
        self._teacher: list[nn.Module] = []
        self.teacher_transform: dict[str, Any] = {}

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            _ = self.teacher  # read it now: a bad teacher stops the run before training

    @property
    def teacher(self) -> nn.Module:
        if not self._teacher:
            from vitlab.interop import resolve_source

            hp = self.hparams
            # A hub name or URL is pinned (commit, sha256), as `init_from` is: the checkpoint names the teacher read.
            source = resolve_source(hp.teacher).pinned
            if source != hp.teacher:
                rank_zero_info(f"teacher {hp.teacher}: {source}")
                self.hparams["teacher"] = source
            net, transform = load_teacher(source, hp.teacher_arch, self.model.num_classes)
            if hp.teacher_mean is not None:
                transform["mean"] = list(hp.teacher_mean)
            if hp.teacher_std is not None:
                transform["std"] = list(hp.teacher_std)
            if hp.teacher_img_size is not None:
                size = hp.teacher_img_size
                transform["img_size"] = [size, size] if isinstance(size, int) else list(size)
            self.teacher_transform = transform
            self._teacher.append(net)
        return self._teacher[0]

    @torch.no_grad()
    def teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The teacher's logits for a batch of student inputs (eval mode, no gradient)."""
        teacher = self.teacher
        if next(teacher.parameters()).device != x.device:  # not a submodule: Lightning does not move it
            teacher.to(x.device)
        dc = self.model.data_config
        t = self.teacher_transform
        inputs = to_teacher_input(x, dc["mean"], dc["std"], t["mean"], t["std"], t["img_size"])
        return teacher(inputs.to(next(teacher.parameters()).dtype)).float()

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        cls_logits, dist_logits = self.model.forward_distilled(x)
        hp = self.hparams
        loss, cls_loss, dist_loss = distillation_loss(
            cls_logits, dist_logits, y, self.teacher_logits(x), hp.distillation, hp.distill_alpha, hp.distill_tau,
            hp.label_smoothing, hp.distill_kl_reduction,
        )  # fmt: skip
        logits = ((cls_logits + dist_logits) / 2).detach()  # what the model predicts (its forward_head)
        return loss, logits, {"loss_cls": cls_loss, "loss_distill": dist_loss}
