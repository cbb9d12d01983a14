"""Masked patch prediction: the paper's self-supervised pretraining (arXiv 2010.11929, section 4.6 and
appendix B.1.2), as a LightningModule of its own, feeding the same fine-tune stage as supervised runs.

Half the patch embeddings of each image are corrupted (of those, 80% replaced by a learned `[mask]`
embedding, 10% by the embedding of another patch of the batch, 10% left as they are), and a linear
head on each corrupted patch's output token predicts either its 3-bit mean colour (512 classes,
cross-entropy; the paper's better target) or its pixels (L1/L2 regression, SimMIM-style).

The encoder is vitlab's `VisionTransformer`, unchanged and stored as `model.*`, with no class head
(`num_classes=0`); the mask token and the prediction head live outside it (`mask_token`, `mpp_head.*`).
A checkpoint therefore loads with `model.init_from` / `load_pretrained` like any vitlab checkpoint:
the encoder is kept, the pretraining-only tensors are left behind, and the classifier gets a new head.

The corruption also reaches the pixels the tokenizer reads (see `MaskedPatchPretraining.forward`):
with the paper's patch tokenizer that changes nothing, and a convolutional tokenizer, whose receptive
field spans the neighbouring patches, cannot read a corrupted patch through its neighbours.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torchmetrics import MeanMetric

from vitlab.data.batch import denormalize, split_batch
from vitlab.models import VisionTransformer, create_model
from vitlab.train.objectives.classifier import log_eval_step, log_training_step, prepare_model, vitlab_record
from vitlab.train.objectives.optim import ViTOptimization, param_groups

Target = Literal["color", "pixels"]

# What happened to each patch embedding (`Corruption.kind`).
CLEAN, MASKED, RANDOM, KEPT = 0, 1, 2, 3


# ---- targets ---------------------------------------------------------------------------------------


def mean_color_ids(images: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """Each patch's mean colour as a class id: `[B, 3, H, W]` in [0, 1] -> `[B, h*w]` (row-major patches).

    Each channel's patch mean `m` is quantised to `q = min(floor(m * 2**bits), 2**bits - 1)` and the
    id is `(q_R * 2**bits + q_G) * 2**bits + q_B`; with 3 bits: `64 q_R + 8 q_G + q_B` in [0, 511]
    (black 0, pure blue 7, pure green 56, pure red 448, white 511).
    """
    levels = 2**bits
    means = F.avg_pool2d(images.float(), patch_size)  # [B, 3, h, w]
    q = (means * levels).floor().clamp(0, levels - 1).long()
    return ((q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]).flatten(1)


def color_of_ids(ids: torch.Tensor, bits: int = 3) -> torch.Tensor:
    """Class ids -> the RGB centres of their colour bins, `[..., 3]` in [0, 1]."""
    levels = 2**bits
    q = torch.stack([ids // (levels * levels), ids // levels % levels, ids % levels], dim=-1)
    return (q.float() + 0.5) / levels


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`[B, C, H, W]` -> `[B, h*w, p*p*C]`, patches in the tokenizer's row-major order."""
    return rearrange(images, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch_size, p2=patch_size)


def unpatchify(patches: torch.Tensor, patch_size: int, grid: tuple[int, int]) -> torch.Tensor:
    """Inverse of `patchify`."""
    return rearrange(patches, "b (h w) (p1 p2 c) -> b c (h p1) (w p2)", h=grid[0], w=grid[1], p1=patch_size,
                     p2=patch_size)  # fmt: skip


# ---- corruption -------------------------------------------------------------------------------------


class Corruption(NamedTuple):
    kind: torch.Tensor  # [B, N]: CLEAN / MASKED / RANDOM / KEPT
    source: torch.Tensor  # [B, N]: flat index (b * N + n) of the patch each position shows (its own, or another's)


def draw_corruption(
    batch: int,
    num_patches: int,
    corrupt_ratio: float = 0.5,
    mask_ratio: float = 0.8,
    random_ratio: float = 0.1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Corruption:
    """Choose `round(corrupt_ratio * N)` of each image's N patches (exactly that many, uniformly); each
    chosen one independently becomes the mask (`mask_ratio`), another patch of the batch, uniform over
    the other B*N - 1 (`random_ratio`), or stays as it is (the rest)."""
    b, n = batch, num_patches
    k = int(corrupt_ratio * n + 0.5)
    order = torch.rand(b, n, device=device, generator=generator).argsort(dim=1)
    corrupted = torch.zeros(b, n, dtype=torch.bool, device=device).scatter_(1, order[:, :k], True)
    u = torch.rand(b, n, device=device, generator=generator)
    kind = torch.where(u < mask_ratio, MASKED, torch.where(u < mask_ratio + random_ratio, RANDOM, KEPT))
    kind = torch.where(corrupted, kind, CLEAN)
    own = torch.arange(b * n, device=device).view(b, n)
    other = torch.randint(0, max(b * n - 1, 1), (b, n), device=device, generator=generator)
    other = other + (other >= own).long()  # skip over one's own position
    return Corruption(kind, torch.where(kind == RANDOM, other, own))


def apply_corruption(patches: torch.Tensor, c: Corruption, fill: torch.Tensor | float) -> torch.Tensor:
    """`[B, N, F]` patches (embeddings or pixels): each position takes its source's row (another
    patch's, where RANDOM), and MASKED positions `fill` (a `[F]`-broadcastable tensor or a number)."""
    b, n, f = patches.shape
    out = patches.reshape(b * n, f)[c.source.flatten()].view(b, n, f)
    fill = torch.as_tensor(fill, dtype=out.dtype, device=out.device).expand(b, n, f)
    return torch.where((c.kind == MASKED)[..., None], fill, out)


# ---- the module --------------------------------------------------------------------------------------


class MaskedPatchPretraining(ViTOptimization):
    """Self-supervised pretraining of a vitlab ViT by masked patch prediction; see the module docstring.

    `arch` / `model_args` / `img_size` build the encoder exactly as `ViTClassifier` does (so the
    fine-tune recipe names the same architecture); `data_config` (mean/std) is linked from the data
    by the CLI and undoes the normalisation for the mean-colour target and the figure. Labels are
    never read. Logged: `train/loss`, `val/loss`, and as `train/acc1` / `val/acc1` the masked-patch
    accuracy, the fraction of corrupted patches whose 3-bit mean colour is predicted exactly (for
    the pixel target: the mean colour of the predicted pixels), which is also what the best
    checkpoint is chosen by. The optimizer settings are `ViTOptimization`'s keyword arguments; under
    `layer_decay` the prediction head learns at the top layer's rate and the mask token at the tokenizer's.
    """

    builds_model_in_init = True  # read by `vitlab.train.run.callbacks.EMA`
    uses_labels = False  # read by the CLI: labelled and unlabelled data both do
    # Added to a `vitlab fit` config (run/defaults.py): the corrupted and predicted patches (a prediction grid
    # means nothing here).
    run_callbacks = ("vitlab.train.run.figures.MaskedPatchFigures",)

    def __init__(
        self,
        arch: str = "vit_tiny_patch16",
        model_args: dict[str, Any] | None = None,
        img_size: int | None = None,
        target: Target = "color",
        pixel_loss: Literal["l1", "l2"] = "l1",
        corrupt_ratio: float = 0.5,
        mask_ratio: float = 0.8,
        random_ratio: float = 0.1,
        color_bits: int = 3,
        grad_checkpointing: bool = False,
        compile: bool = False,
        data_config: dict[str, Any] | None = None,
        num_classes: int | None = None,
        class_names: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if target not in ("color", "pixels"):
            raise ValueError(f"unknown target {target!r}; choose 'color' (3-bit mean colour) or 'pixels'")
        if pixel_loss not in ("l1", "l2"):
            raise ValueError(f"unknown pixel_loss {pixel_loss!r}; choose 'l1' or 'l2'")
        if not 0.0 < corrupt_ratio < 1.0:
            raise ValueError(f"corrupt_ratio must lie in (0, 1) (got {corrupt_ratio})")
        if mask_ratio < 0 or random_ratio < 0 or mask_ratio + random_ratio > 1.0:
            raise ValueError(
                f"mask_ratio={mask_ratio} and random_ratio={random_ratio} must be >= 0 and sum to at most 1 "
                "(the rest of the corrupted patches are left as they are)"
            )
        if not 1 <= color_bits <= 8:
            raise ValueError(f"color_bits must lie in [1, 8] (got {color_bits})")
        super().__init__(**kwargs)  # the optimizer settings (ViTOptimization)
        # The CLI links the data's class count and names into every model; labels play no part here.
        self.save_hyperparameters(ignore=["num_classes", "class_names"])

        self.model = self._build_encoder()
        dim, patch = self.model.embed_dim, self.patch_size
        in_chans = self.model.config["in_chans"]
        if in_chans != 3:
            raise ValueError(f"masked patch prediction reads RGB patches (mean colours), but in_chans={in_chans}")
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        out = 2 ** (3 * color_bits) if target == "color" else patch * patch * in_chans
        head = nn.Linear(dim, out)
        nn.init.trunc_normal_(head.weight, std=0.02)
        nn.init.zeros_(head.bias)
        # GAP encoders leave their tokens unnormalised (the norm follows the pooling): give the head one.
        unnormalised = isinstance(self.model.norm, nn.Identity)
        self.mpp_head = nn.Sequential(nn.LayerNorm(dim), head) if unnormalised else head

        self.train_loss, self.train_acc = MeanMetric(), MeanMetric()
        self.val_loss, self.val_acc = MeanMetric(), MeanMetric()
        self.test_loss, self.test_acc = MeanMetric(), MeanMetric()
        self._compiled = False

    def _build_encoder(self) -> VisionTransformer:
        hp = self.hparams
        args = {**(hp.model_args or {}), "num_classes": 0}
        if hp.img_size is not None:
            args["img_size"] = hp.img_size
        model = create_model(hp.arch, **args)
        # Pooling and heads take no part in patch prediction: frozen, so DDP finds no unused
        # parameters and the fine-tune starts them from their initialisation.
        for name in ("attn_pool", "fc_norm", "pre_logits", "head", "head_dist"):
            part = getattr(model, name, None)
            if isinstance(part, nn.Module):
                part.requires_grad_(False)
        prepare_model(model, hp.grad_checkpointing, hp.data_config)
        model.data_config["class_names"] = None  # an encoder without classes
        return model

    def configure_model(self) -> None:
        # The blocks only, in place (parameter names unchanged): the corruption around the tokenizer
        # changes every step and stays eager. The flag makes the hook idempotent across fit/validate/test.
        if self.hparams.compile and not self._compiled:
            for block in self.model.blocks:
                block.compile()
            self._compiled = True

    @property
    def patch_size(self) -> int:
        return int(self.model.patch_embed.patch_size)

    # ---- the objective ---------------------------------------------------------------------------

    def _unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Model inputs -> pixels in [0, 1] (the data's mean/std undone)."""
        return denormalize(x, self.model.data_config["mean"], self.model.data_config["std"]).clamp(0.0, 1.0)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, Corruption]:
        """Images -> (head outputs for every patch `[B, N, out]`, the corruption applied): to the pixels
        the tokenizer reads (masked patches set to 0, the data's mean colour; random ones replaced by their
        source patch) and to the patch embeddings (masked ones replaced by the mask token); see the module
        docstring for why both."""
        hp = self.hparams
        p, grid = self.patch_size, self.model.patch_embed.grid_size
        c = draw_corruption(x.shape[0], grid[0] * grid[1], hp.corrupt_ratio, hp.mask_ratio, hp.random_ratio,
                            generator, x.device)  # fmt: skip
        x = unpatchify(apply_corruption(patchify(x, p), c, 0.0), p, grid)
        masked = (c.kind == MASKED)[..., None]

        def mask(module: nn.Module, inputs: Any, tokens: torch.Tensor) -> torch.Tensor:
            return torch.where(masked, self.mask_token.to(tokens.dtype), tokens)

        # Between the tokenizer and the prefix tokens + position embedding: the encoder's own forward
        # (checkpointing, prefix tokens, final norm) runs unchanged around it.
        handle = self.model.patch_embed.register_forward_hook(mask)
        try:
            tokens = self.model.forward_features(x)
        finally:
            handle.remove()
        return self.mpp_head(tokens[:, self.model.num_prefix_tokens :]), c

    def objective(
        self, x: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, Corruption]:
        """(loss, masked-patch accuracy, corrupted patch count, head outputs, corruption) for images `x`."""
        hp = self.hparams
        out, c = self(x, generator)
        chosen = c.kind != CLEAN
        pixels = self._unnormalize(x)
        colors = mean_color_ids(pixels, self.patch_size, hp.color_bits)[chosen]
        pred = out[chosen].float()
        if hp.target == "color":
            loss = F.cross_entropy(pred, colors)
            guess = pred.argmax(dim=-1)
        else:
            target = patchify(x.float(), self.patch_size)[chosen]
            loss = F.l1_loss(pred, target) if hp.pixel_loss == "l1" else F.mse_loss(pred, target)
            guess = self._predicted_colors(out, c)[chosen]
        acc = (guess == colors).float().mean()
        return loss, acc, int(chosen.sum()), out, c

    def _predicted_colors(self, out: torch.Tensor, c: Corruption) -> torch.Tensor:
        """Colour ids the head predicts for every patch `[B, N]` (argmax, or the predicted pixels' mean)."""
        if self.hparams.target == "color":
            return out.argmax(dim=-1)
        images = self._unnormalize(unpatchify(out.float(), self.patch_size, self.model.patch_embed.grid_size))
        return mean_color_ids(images, self.patch_size, self.hparams.color_bits)

    # ---- steps -------------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = split_batch(batch, targets=False)
        loss, acc, n, _, _ = self.objective(x)
        self.train_loss.update(loss.detach(), n)
        self.train_acc.update(acc, n)
        log_training_step(self, loss, acc, self.train_loss, self.train_acc, x.shape[0])
        return loss

    def _eval_step(self, batch: Any, batch_idx: int, stage: str) -> None:
        x, _ = split_batch(batch, targets=False)
        # The same corruption of the same batch at every validation, so epochs compare.
        generator = torch.Generator(device=x.device).manual_seed(batch_idx * 1009 + self.global_rank)
        loss, acc, n, _, _ = self.objective(x, generator)
        loss_metric, acc_metric = getattr(self, f"{stage}_loss"), getattr(self, f"{stage}_acc")
        loss_metric.update(loss, n)
        acc_metric.update(acc, n)
        log_eval_step(self, stage, x.shape[0], loss=loss_metric, acc1=acc_metric)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, "test")

    # ---- optimisation -------------------------------------------------------------------------------

    def optimizer_groups(self) -> list[dict[str, Any]]:
        hp = self.hparams
        groups = param_groups(self.model, hp.weight_decay, layer_decay=hp.layer_decay, lr=hp.lr)
        for group in param_groups(self.mpp_head, hp.weight_decay, lr=hp.lr):  # above the last block: scale 1
            group["params"] = [(f"mpp_head.{name}", p) for name, p in group["params"]]
            groups.append(group)
        # The mask token stands in for tokenizer outputs: layer 0's scale (`layer_id`).
        scale = hp.layer_decay ** (len(self.model.blocks) + 1) if hp.layer_decay is not None else 1.0
        groups.append({"params": [("mask_token", self.mask_token)], "weight_decay": 0.0, "lr": hp.lr * scale,
                       "lr_scale": scale})  # fmt: skip
        return groups

    # ---- checkpoints ------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["vitlab"] = vitlab_record(self.model)  # what `load_pretrained` reads to rebuild the encoder
