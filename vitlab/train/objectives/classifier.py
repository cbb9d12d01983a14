"""`ViTClassifier`: the LightningModule that pretrains and fine-tunes a vitlab ViT.

The model is built in `__init__`, not `configure_model`: the checkpoint's `state_dict` then loads
straight into a freshly constructed module (`Trainer.fit(ckpt_path=...)`, `load_from_checkpoint`),
and callbacks that copy the module at setup (EMA) see the whole model. vitlab's models fit in host
memory, and FSDP wraps layers that already exist, so nothing needs deferred construction;
`configure_model` only applies `torch.compile`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy

from vitlab.data.batch import split_batch
from vitlab.models import VisionTransformer, create_model
from vitlab.models.variants import variant_config
from vitlab.train.objectives.optim import ViTOptimization

_COMPILE_PREFIX = "_orig_mod."


def _plain(obj: Any) -> Any:
    """JSON round trip: plain dicts/lists/numbers/strings only, so `torch.load(weights_only=True)` reads it."""
    return json.loads(json.dumps(obj))


def _grid(config: Mapping[str, Any]) -> list[int]:
    h, w = config["img_size"] if isinstance(config["img_size"], Sequence) else (config["img_size"],) * 2
    return [h // config["patch_size"], w // config["patch_size"]]


def _peek_source_config(path: str) -> dict[str, Any] | None:
    """The model config a vitlab source records (Lightning `.ckpt`, `save_pretrained` folder), or the
    input size, patch size and classes a timm / transformers `config.json` beside the weights states
    (hub repos), for the init log; None for formats that record none (state dicts, .npz)."""
    from vitlab.interop.hub import is_remote, peek_hub_config, resolve_source

    try:
        p = resolve_source(path).path if is_remote(path) else Path(path)  # a hub name or URL: its cached file
        sidecar = p / "config.json" if p.is_dir() else p.with_name("config.json")
        if sidecar.is_file() and (p.is_dir() or p.suffix in (".safetensors", ".bin")):
            meta = json.loads(sidecar.read_text())
            return dict(meta["model"]) if meta.get("format") == "vitlab" else peek_hub_config(sidecar)
        if p.suffix == ".ckpt" and p.is_file():  # mmap: only the small metadata is actually read
            return dict(torch.load(p, map_location="cpu", weights_only=True, mmap=True)["vitlab"]["model_config"])
    except Exception:  # noqa: BLE001 - this only feeds a log line
        return None
    return None


def _dropped_tensors(path: str, kept: list[str]) -> list[str] | None:
    """The tensors of a vitlab Lightning `.ckpt` that the initialised model does not take: a replaced
    head, a pretraining objective's own parts (masked patch prediction's `mask_token`, `mpp_head.*`).
    For the init log; None for other formats, whose loaders take every tensor or fail."""
    p = Path(path)  # a hub name or URL is never a Lightning checkpoint
    if p.suffix != ".ckpt" or not p.is_file():
        return None
    try:  # mmap: only the tensor index is read
        names = list(torch.load(p, map_location="cpu", weights_only=True, mmap=True)["state_dict"])
    except Exception:  # noqa: BLE001 - this only feeds a log line
        return None
    taken = {f"model.{k}" for k in kept}
    return sorted(k.removeprefix("model.") for k in names if k not in taken)


class FiniteMean(Metric):
    """Weighted mean of the finite values it is given, kept on the device: torchmetrics' `MeanMetric`
    reads each update's NaN check on the host (a sync per training step), and with that check disabled
    it ignores the weights. A non-finite loss (a step the non-finite guard skips) is left out."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: float = 1.0) -> None:
        finite = torch.isfinite(value)
        self.total += torch.where(finite, value, 0.0).sum().to(self.total.dtype) * weight
        self.weight += finite.sum().to(self.weight.dtype) * weight

    def compute(self) -> torch.Tensor:
        return self.total / self.weight


def log_training_step(
    module: L.LightningModule, loss: torch.Tensor, acc: torch.Tensor, loss_mean: Metric, acc_mean: Metric, n: int
) -> None:
    """The training logs every vitlab module writes: loss and acc1 per step under their plain names
    (on_step + on_epoch would rename them `_step`/`_epoch`), their epoch means from the metric
    objects (which torchmetrics reduces across ranks), and the learning rate.

    None of it makes the host wait for the device at a step that is not written to the loggers, except
    the progress bar's running loss: Lightning turns every progress-bar value into a Python number at
    each step, so the loss goes to the bar only when there is one (`enable_progress_bar=false`: none).
    """
    trainer = module._trainer
    bar = trainer is not None and trainer.progress_bar_callback is not None
    module.log("train/loss", loss.detach(), on_step=True, on_epoch=False, prog_bar=bar, batch_size=n)
    module.log("train/acc1", acc, on_step=True, on_epoch=False, batch_size=n)
    module.log("train/loss_epoch", loss_mean, on_step=False, on_epoch=True, batch_size=n)
    module.log("train/acc1_epoch", acc_mean, on_step=False, on_epoch=True, batch_size=n)
    if trainer is not None and trainer.optimizers:
        lr = max(g["lr"] for g in trainer.optimizers[0].param_groups)
        # A host tensor: Lightning would copy a Python float to the device, and wait for it, every step.
        module.log("lr", torch.tensor(lr, dtype=torch.float64), on_step=True, on_epoch=False, batch_size=n)


def log_eval_step(module: L.LightningModule, stage: str, n: int, **metrics: Metric | None) -> None:
    """The evaluation logs every vitlab module writes: `{stage}/{name}` of each metric object, which
    torchmetrics reduces across ranks at the epoch's end (None: not measured); loss and acc1 on the
    progress bar during validation."""
    for name, metric in metrics.items():
        if metric is not None:
            bar = stage == "val" and name in ("loss", "acc1")
            module.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=bar, batch_size=n)


def prepare_model(model: VisionTransformer, grad_checkpointing: bool, data_config: Mapping[str, Any] | None) -> None:
    """What every vitlab module does to the model it built: activation checkpointing, and the data's
    preprocessing (linked by the CLI) recorded in `model.data_config`, with the one input size the model takes."""
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    if data_config:
        model.data_config.update(_plain(data_config))
    model.data_config["img_size"] = list(model.config["img_size"])


def vitlab_record(model: VisionTransformer) -> dict[str, Any]:
    """What a vitlab checkpoint records under `"vitlab"` for `load_pretrained` to rebuild the model."""
    return _plain({"model_config": model.config, "data_config": model.data_config})


class ViTClassifier(ViTOptimization):
    """Image classification with a vitlab ViT: cross-entropy (label smoothing, soft targets),
    AdamW/SGD with weight-decay groups and optional layer-wise LR decay, warm-up + cosine/linear
    per-step schedule, micro-averaged top-1 and (above 5 classes) top-5 accuracy.

    Every argument is plain data, so the hyperparameters in a checkpoint load with
    `torch.load(weights_only=True)`. `num_classes`, `img_size` and `data_config` are meant to be
    linked from the data by the CLI. `init_from` initialises the weights from a pretrained source
    (resampled position embeddings, new zero-initialised head); it is not a resume. The optimizer
    settings (`lr`, `layer_decay`, ...) are `ViTOptimization`'s keyword arguments.
    """

    # Read by `vitlab.train.run.callbacks.EMA`: no `configure_model` call is needed to see all layers.
    builds_model_in_init = True
    # The callbacks a `vitlab fit` of this objective adds to its config (run/defaults.py), so config.yaml lists
    # them; not `configure_callbacks`, which every plain Trainer.fit of the module would run, and no record shows.
    run_callbacks = ("vitlab.train.run.figures.ValidationFigures",)  # prediction grid, confusion matrix, attention

    def __init__(
        self,
        arch: str = "vit_tiny_patch16",
        model_args: dict[str, Any] | None = None,
        num_classes: int | None = None,
        img_size: int | None = None,
        init_from: str | None = None,
        label_smoothing: float = 0.0,
        grad_checkpointing: bool = False,
        compile: bool = False,
        class_names: list[str] | None = None,
        data_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Fail on a bad value now, not after the data is set up.
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1) (got {label_smoothing})")
        super().__init__(**kwargs)  # the optimizer settings (ViTOptimization)
        self.save_hyperparameters()
        self.init_summary: dict[str, str] | None = None  # what `init_from` changed, for the run's logs

        self.model = self._build_model()
        nc = self.model.num_classes
        if nc < 2:
            raise ValueError(f"a classifier needs num_classes >= 2 (got {nc})")
        if class_names is not None and len(class_names) != nc:
            raise ValueError(f"{len(class_names)} class_names for {nc} classes")
        # average="micro": plain fraction of correct samples (the torchmetrics default is macro).
        # The training step's metrics run every step: no host reads (input validation, NaN checks).
        self.train_loss = FiniteMean()
        self.train_acc1 = MulticlassAccuracy(nc, top_k=1, average="micro", validate_args=False)
        self.val_loss = MeanMetric()
        self.val_acc1 = MulticlassAccuracy(nc, top_k=1, average="micro")
        self.test_loss = MeanMetric()
        self.test_acc1 = MulticlassAccuracy(nc, top_k=1, average="micro")
        # Top-5 only says something with more than 5 classes (with 5 or fewer it is always 100%).
        self.val_acc5 = MulticlassAccuracy(nc, top_k=5, average="micro") if nc > 5 else None
        self.test_acc5 = MulticlassAccuracy(nc, top_k=5, average="micro") if nc > 5 else None

        self._compiled = False

    # ---- model -----------------------------------------------------------------------------------

    def _build_model(self) -> VisionTransformer:
        hp = self.hparams
        args = dict(hp.model_args or {})
        if hp.num_classes is not None:
            args["num_classes"] = hp.num_classes
        if hp.img_size is not None:
            args["img_size"] = hp.img_size
        model = self._init_from_pretrained(hp.init_from, args) if hp.init_from else create_model(hp.arch, **args)
        prepare_model(model, hp.grad_checkpointing, hp.data_config)
        if hp.class_names is not None:
            model.data_config["class_names"] = list(hp.class_names)
        return model

    def _init_from_pretrained(self, path: str, args: dict[str, Any]) -> VisionTransformer:
        from vitlab.interop import load_pretrained, resolve_source  # imported only when used
        from vitlab.interop.eval_size import TEST_KEYS

        # A hub name or URL is fetched once and pinned (hf-hub:ORG/NAME@<commit>, URL#sha256=<hex>): the
        # checkpoint's hyperparameters and the init summary then name exactly the weights this run started from.
        path = resolve_source(path).pinned
        self.hparams["init_from"] = path
        source = _peek_source_config(path)
        config = dict(args)  # a new input size or class count resamples / replaces, the rest builds the model
        expected = {**variant_config(self.hparams.arch), **(self.hparams.model_args or {})}
        if expected.get("distilled"):  # a plain ViT source gets a distillation token copied from its class token
            config["distilled"] = True
        # A new patch size and input size are applied together after loading (kernel PI-resized, position
        # embeddings resampled once from the source's grid, as timm's set_input_size does).
        img_size, patch_size = config.pop("img_size", None), config.pop("patch_size", None)
        # As trained: the source's recorded test size is its own, and the grid is resampled once, below.
        model = load_pretrained(path, num_classes=config.pop("num_classes", None), config=config, use_test_size=False)
        for key in TEST_KEYS:  # this run records its own (`vitlab resolution`)
            model.data_config.pop(key, None)
        if not isinstance(model, VisionTransformer):
            raise TypeError(f"load_pretrained returned {type(model).__name__}, expected a VisionTransformer")
        old_patch = model.patch_embed.patch_size
        model.set_image_size(img_size or model.config["img_size"], patch_size=patch_size)
        # `arch` still names the size: a mismatch is almost always a wrong path or a wrong arch.
        for key in ("embed_dim", "depth", "num_heads"):
            if model.config[key] != expected[key]:
                raise ValueError(
                    f"init_from={path!r} holds a model with {key}={model.config[key]}, but arch="
                    f"{self.hparams.arch!r} (with model_args) has {key}={expected[key]}; set arch to match"
                )
        new_grid, new_classes = _grid(model.config), model.config["num_classes"]
        old_grid = _grid(source) if source else "not recorded"
        old_classes = source["num_classes"] if source else "not recorded"
        fmt = lambda g: "x".join(map(str, g)) if isinstance(g, list) else g  # noqa: E731
        self.init_summary = {
            "init_from": str(path),
            "pos_embed_grid": f"{fmt(old_grid)} -> {fmt(new_grid)}",
            "num_classes": f"{old_classes} -> {new_classes}",
        }
        new_patch = model.patch_embed.patch_size
        if new_patch != old_patch:
            self.init_summary["patch_size"] = f"{old_patch} -> {new_patch} (kernel PI-resized)"
        head = " (new zero-initialised head, pre-logits dropped)" if old_classes != new_classes else ""
        new = [k for k in model.state_dict() if k.startswith(("head.", "head_dist."))] if head else []
        if model.distilled and source is not None and not source.get("distilled"):
            # copies of the class token and head (interop.architecture.add_distillation_token)
            new = ["dist_token", *(k for k in model.state_dict() if k.startswith("head_dist.") and k not in new), *new]
        kept = [k for k in model.state_dict() if k not in new]
        dropped = _dropped_tensors(path, kept)
        listed = (", ".join(dropped) or "none") if dropped is not None else "not listed for this format"
        self.init_summary.update(tensors_kept=str(len(kept)), tensors_new=", ".join(new) or "none",
                                 tensors_dropped=listed)  # fmt: skip
        rank_zero_info(
            f"init_from {path}: "
            f"{f'patch {old_patch} -> {new_patch}, kernel PI-resized; ' if new_patch != old_patch else ''}"
            f"position-embedding grid {old_grid} -> {new_grid}, "
            f"classes {old_classes} -> {new_classes}{head}; tensors: {len(kept)} kept"
            f"{' (pos_embed resampled)' if old_grid != new_grid else ''}, new: {', '.join(new) or 'none'}, "
            f"dropped: {listed}"
        )
        model.train()  # the loader hands back an eval-mode model
        return model

    def configure_model(self) -> None:
        # In-place `Module.compile` keeps parameter names (no `_orig_mod.`) and the module identity;
        # the flag makes the hook idempotent across fit/validate/test.
        if self.hparams.compile and not self._compiled:
            self.model.compile()
            self._compiled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    # ---- steps -----------------------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy with label smoothing; `target` is class indices [B] or probabilities [B, C]
        (MixUp/CutMix); smoothing applies to both, so the collate should not smooth again."""
        if target.ndim == 2 and target.shape != logits.shape:
            raise ValueError(f"soft targets of shape {tuple(target.shape)} for logits {tuple(logits.shape)}")
        return F.cross_entropy(logits.float(), target, label_smoothing=self.hparams.label_smoothing)

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(training loss, the logits the model predicts with, further per-step scalars to log);
        subclasses with another objective (distillation) override this, not `training_step`."""
        logits = self(x)
        return self.loss(logits, y), logits, {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = split_batch(batch)
        loss, logits, extra = self.compute_loss(x, y)
        hard = y.argmax(dim=1) if y.ndim == 2 else y
        n = x.shape[0]
        for name, value in extra.items():
            self.log(f"train/{name}", value.detach(), on_step=True, on_epoch=False, batch_size=n)
        acc1 = self.train_acc1(logits.detach(), hard)
        self.train_loss.update(loss.detach(), n)
        log_training_step(self, loss, acc1, self.train_loss, self.train_acc1, n)
        return loss

    def _eval_step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = split_batch(batch)
        logits = self(x)
        hard = y.argmax(dim=1) if y.ndim == 2 else y
        n = x.shape[0]
        # Evaluation loss is the plain NLL (no smoothing), comparable across recipes.
        loss, acc1, acc5 = (getattr(self, f"{stage}_{name}") for name in ("loss", "acc1", "acc5"))
        loss.update(F.cross_entropy(logits.float(), hard), n)
        acc1.update(logits, hard)
        if acc5 is not None:
            acc5.update(logits, hard)
        log_eval_step(self, stage, n, loss=loss, acc1=acc1, acc5=acc5)
        return logits.detach()  # the logits, for callbacks (confusion matrix)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Class probabilities [B, C]."""
        x, _ = split_batch(batch, targets=False)
        return self(x).float().softmax(dim=-1)

    # ---- checkpoints -----------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs after the callbacks' hooks, so this also sees the EMA callback's swapped state_dict.
        for key in ("state_dict", "current_model_state"):
            if key in checkpoint:
                checkpoint[key] = {k.replace(_COMPILE_PREFIX, ""): v for k, v in checkpoint[key].items()}
        checkpoint["vitlab"] = vitlab_record(self.model)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Map saved `model.<name>` keys back onto a model that was wrapped by `torch.compile(model)`.
        own = {k.replace(_COMPILE_PREFIX, ""): k for k in self.state_dict()}
        if any(k != v for k, v in own.items()):
            for key in ("state_dict", "current_model_state"):
                if key in checkpoint:
                    checkpoint[key] = {own.get(k, k): v for k, v in checkpoint[key].items()}
