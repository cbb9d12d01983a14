"""The Vision Transformer of arXiv 2010.11929, in one file.

Module and parameter names follow timm (`patch_embed`, `cls_token`, `pos_embed`, `blocks`, `norm`,
`head`) so state dicts and habits carry over. Besides the paper's model it carries the small-data
options vitlab's CPU recipes use, each a flag: the tokenizers of `tokenizers.py` (the paper's
patches, its ResNet hybrid, a convolutional tokenizer as CCT arXiv 2104.05704, shifted patches),
locality self-attention (arXiv 2112.13492), sequence pooling (CCT) and DeiT's distillation token
(arXiv 2012.12877).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torchvision.ops import StochasticDepth

from vitlab.constants import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from vitlab.models.resize import infer_grid, resample_patch_kernel, resample_pos_embed, to_2tuple
from vitlab.models.tokenizers import make_tokenizer, token_grid

log = logging.getLogger("vitlab")

Pool = Literal["token", "avg", "seq"]
PosEmbed = Literal["learn", "sincos"]
Stem = Literal["patch", "conv", "spt", "resnet"]

# On the CPU, torch's fused bf16 attention kernel is several times slower than its unfused math path on
# short sequences (17 tokens: 18 ms against 4 ms forward + backward, batch 128, 3 heads) and faster on
# long ones; the crossover lies between 145 and 197 tokens on an avx512_bf16 EPYC (bench/README.md).
CPU_BF16_MATH_MAX_TOKENS = 160


def _attention_kernel(q: torch.Tensor, num_keys: int) -> contextlib.AbstractContextManager:
    """The SDPA backend for these queries: the math path for short bf16 sequences on the CPU, else torch's choice."""
    if (
        q.device.type == "cpu" and q.dtype == torch.bfloat16 and num_keys <= CPU_BF16_MATH_MAX_TOKENS
        and not torch.compiler.is_compiling()  # inductor lowers attention itself
    ):  # fmt: skip
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def sincos_pos_embed_2d(grid: tuple[int, int], dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2D sin-cos position embedding `[h*w, dim]` (big_vision's `posemb_sincos_2d`)."""
    if dim % 4:
        raise ValueError(f"embed_dim={dim} must be a multiple of 4 for the 2D sin-cos position embedding")
    h, w = grid
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4 - 1 or 1))
    y = y.flatten()[:, None] * omega[None, :]
    x = x.flatten()[:, None] * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection, through `scaled_dot_product_attention`.

    `lsa=True` gives locality self-attention: a learnable temperature and no attention to self.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        lsa: bool = False,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.lsa = lsa
        if lsa:
            self.log_scale = nn.Parameter(torch.tensor(math.log(self.scale)))

    def forward(
        self, x: torch.Tensor, return_attn: bool = False, num_queries: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`num_queries=n` attends from the first n tokens only (keys and values stay all tokens)."""
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.num_heads)
        if num_queries is not None:
            q = q[:, :, :num_queries]
        scale, mask = self.scale, None
        if self.lsa:
            q, scale = q * self.log_scale.exp(), 1.0
            mask = ~torch.eye(q.shape[2], x.shape[1], dtype=torch.bool, device=x.device)
        attn = None
        if return_attn:  # explicit path, only for analysis: hands back the probabilities
            logits = (q * scale) @ k.transpose(-2, -1)
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            attn = logits.softmax(dim=-1)
            out = F.dropout(attn, self.attn_drop, self.training) @ v
        else:
            with _attention_kernel(q, k.shape[-2]):
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=self.attn_drop if self.training else 0.0, scale=scale
                )
        out = self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)")))
        return out, attn


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        lsa: bool = False,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, drop, lsa)
        self.drop_path1 = StochasticDepth(drop_path, mode="row")
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path2 = StochasticDepth(drop_path, mode="row")

    def forward(self, x: torch.Tensor, num_queries: int | None = None) -> torch.Tensor:
        """`num_queries=n` returns only the first n tokens' outputs, computed from all tokens."""
        y = self.attn(self.norm1(x), num_queries=num_queries)[0]
        if num_queries is not None:
            x = x[:, :num_queries]
        x = x + self.drop_path1(y)
        return x + self.drop_path2(self.mlp(self.norm2(x)))

    def forward_with_attn(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, attn = self.attn(self.norm1(x), return_attn=True)
        x = x + self.drop_path1(y)
        return x + self.drop_path2(self.mlp(self.norm2(x))), attn


class VisionTransformer(nn.Module):
    """ViT: tokenizer -> [class token] [distillation token] + position embedding -> pre-norm blocks
    -> norm -> pool -> head (a distilled model: a head on each of its two prefix tokens).

    `config` holds the constructor arguments as plain data (what `save_pretrained` writes);
    `data_config` the preprocessing the weights expect (what `eval_transform` builds).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        class_token: bool = True,
        pool: Pool = "token",
        pos_embed: PosEmbed = "learn",
        representation_size: int | None = None,
        norm_eps: float = 1e-6,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        stem: Stem = "patch",
        stem_channels: int = 64,
        stem_layers: list[int] | None = None,
        lsa: bool = False,
        distilled: bool = False,
    ) -> None:
        super().__init__()
        img_size = to_2tuple(img_size)
        if pool not in ("token", "avg", "seq"):
            raise ValueError(f"unknown pool {pool!r}; choose 'token' (class token), 'avg' (GAP) or 'seq'")
        if pool == "token" and not class_token:
            raise ValueError("pool='token' needs class_token=True; use pool='avg' or 'seq' without a class token")
        if pos_embed not in ("learn", "sincos"):
            raise ValueError(f"unknown pos_embed {pos_embed!r}; choose 'learn' or 'sincos'")
        if distilled and (pool != "token" or representation_size):
            raise ValueError(
                "distilled=True reads the class and distillation tokens with a linear head each: "
                "it needs pool='token' and no representation_size"
            )
        if stem == "resnet" and stem_layers is None:
            stem_layers = [3, 4, 9]  # the paper's R50 with stage 4 folded into stage 3
        self.config: dict[str, Any] = dict(
            img_size=list(img_size), patch_size=patch_size, in_chans=in_chans, num_classes=num_classes,
            embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
            class_token=class_token, pool=pool, pos_embed=pos_embed, representation_size=representation_size,
            norm_eps=norm_eps, drop_rate=drop_rate, attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate,
            stem=stem, stem_channels=stem_channels, lsa=lsa,
        )  # fmt: skip
        # Written only when used, so configs (and checkpoints) of plain models read as before.
        if stem_layers is not None:
            self.config["stem_layers"] = list(stem_layers)
        if distilled:
            self.config["distilled"] = True
        self.data_config: dict[str, Any] = dict(
            img_size=list(img_size), mean=list(IMAGENET_INCEPTION_MEAN), std=list(IMAGENET_INCEPTION_STD),
            interpolation="bicubic", crop_pct=0.9, class_names=None,
        )  # fmt: skip
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.pool = pool
        self.distilled = distilled
        self.num_prefix_tokens = int(class_token) + int(distilled)
        self.grad_checkpointing = False
        # Another input size without another model (progressive resizing; `use_input_size`); None: img_size.
        self.input_size: tuple[int, int] | None = None

        self.patch_embed = make_tokenizer(stem, img_size, patch_size, in_chans, embed_dim, stem_channels, stem_layers)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        num_pos = self.num_prefix_tokens + self.patch_embed.grid_size[0] * self.patch_embed.grid_size[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, num_pos, embed_dim), requires_grad=pos_embed == "learn")
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth grows with depth
        block_args = (embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate)
        self.blocks = nn.Sequential(*(Block(*block_args, d, norm_eps, lsa) for d in dpr))
        # GAP models normalise after pooling, as timm's `fc_norm` (and big_vision) do.
        self.norm = nn.LayerNorm(embed_dim, eps=norm_eps) if pool != "avg" else nn.Identity()
        self.fc_norm = nn.LayerNorm(embed_dim, eps=norm_eps) if pool == "avg" else nn.Identity()
        self.attn_pool = nn.Linear(embed_dim, 1) if pool == "seq" else None
        self.pre_logits = nn.Identity()
        if representation_size:
            fc = nn.Linear(embed_dim, representation_size)
            self.pre_logits = nn.Sequential(OrderedDict(fc=fc, act=nn.Tanh()))
        self.head = nn.Linear(representation_size or embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = self._new_head(num_classes) if distilled else None
        self.init_weights()
        # A checkpoint saved at another input size (or patch size) loads resampled: `vitlab validate
        # --data.img_size=S` evaluates a model trained at another size.
        self.register_load_state_dict_pre_hook(_fit_checkpoint_to_size)

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self.patch_embed.init_weights()
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)
        with torch.no_grad():
            if self.config["pos_embed"] == "sincos":
                self.pos_embed.zero_()
                grid = sincos_pos_embed_2d(self.patch_embed.grid_size, self.embed_dim)
                self.pos_embed[0, self.num_prefix_tokens :].copy_(grid)
            else:
                nn.init.trunc_normal_(self.pos_embed, std=0.02)

    # ---- the model -------------------------------------------------------------------------------

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_size is None:
            x, pos_embed = self.patch_embed(x), self.pos_embed  # the tokenizer checks x against img_size
        else:
            if x.ndim != 4 or tuple(x.shape[-2:]) != self.input_size:
                h, w = self.input_size
                raise ValueError(f"expected images [B, C, {h}, {w}] (use_input_size), got {tuple(x.shape)}")
            grid = token_grid(self.input_size, self.patch_embed.patch_size)
            pos_embed = self._pos_embed_for(self.pos_embed, self.patch_embed.grid_size, grid)
            x = self.patch_embed.tokenize(x)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token) if t is not None]
        if prefix:
            x = torch.cat([*prefix, x], dim=1)
        return self.pos_drop(x + pos_embed)

    def _run_blocks(self, x: torch.Tensor, num_queries: int | None = None) -> torch.Tensor:
        """Embedded tokens through the blocks; `num_queries` is passed to the last one."""
        ckpt = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            nq = num_queries if i == last else None
            x = checkpoint(blk, x, nq, use_reentrant=False) if ckpt else blk(x, nq)
        return x

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images `[B, C, H, W]` -> all tokens after the final norm `[B, prefix + h*w, D]`."""
        return self.norm(self._run_blocks(self.embed(x)))

    def pool_tokens(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool == "token":
            return x[:, 0]
        if self.pool == "avg":
            return x[:, self.num_prefix_tokens :].mean(dim=1)
        return (self.seq_pool_weights(x).transpose(1, 2) @ x).squeeze(1)

    def seq_pool_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence pooling's learned weights over the tokens `[B, N, 1]` of `forward_features`."""
        return self.attn_pool(x).softmax(dim=1)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens from `forward_features` -> logits (or the pooled representation).

        A distilled model predicts with the mean of its two heads' logits, as DeiT's code, timm
        (`VisionTransformerDistilled`) and transformers (`DeiTForImageClassificationWithTeacher`) do.
        """
        if self.distilled:  # the mean of the two prefix tokens, or of the two heads' logits
            return (x[:, 0] + x[:, 1]) / 2 if pre_logits else sum(self.forward_heads(x)) / 2
        x = self.pre_logits(self.fc_norm(self.pool_tokens(x)))
        return x if pre_logits else self.head(x)

    def forward_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens -> (class-head logits, distillation-head logits) of a distilled model: what
        distillation trains, the first against the labels, the second against the teacher."""
        if not self.distilled:
            raise ValueError("forward_heads needs a distilled model (distilled=True): it has no distillation head")
        return self.head(x[:, 0]), self.head_dist(x[:, 1])

    def _prefix_features(self, x: torch.Tensor) -> torch.Tensor:
        """The prefix tokens after the final norm; the last block computes only them (the heads of
        a class-token model read nothing else): the same outputs and gradients for about 1/depth
        less work."""
        return self.norm(self._run_blocks(self.embed(x), num_queries=self.num_prefix_tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> logits, equal to `forward_head(forward_features(x))`."""
        if self.pool != "token":
            return self.forward_head(self.forward_features(x))
        return self.forward_head(self._prefix_features(x))

    def forward_distilled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images -> both heads' logits (class head, distillation head) of a distilled model."""
        return self.forward_heads(self._prefix_features(x))

    @torch.no_grad()
    def forward_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the attention probabilities of every block, `[depth, B, heads, N, N]`."""
        x = self.embed(x)
        maps = []
        for blk in self.blocks:
            x, attn = blk.forward_with_attn(x)
            maps.append(attn)
        return self.forward_head(self.norm(x)), torch.stack(maps)

    # ---- fine-tuning -----------------------------------------------------------------------------

    def set_image_size(self, img_size: int | tuple[int, int], patch_size: int | None = None,
                       **resample_kwargs: Any) -> None:
        """Resample the model to a new input size, in place (the fine-tune core): the position
        embeddings to the new token grid and, with `patch_size`, the patch kernel by FlexiViT's
        pseudo-inverse resize (arXiv 2212.08013; stem='patch' only). `resample_kwargs` go to
        `resample_pos_embed`. The same result as timm's `set_input_size(img_size, patch_size)`."""
        img_size = to_2tuple(img_size)
        old_grid = self.patch_embed.grid_size
        if patch_size is not None and patch_size != self.patch_embed.patch_size:
            token_grid(img_size, patch_size)  # fail before changing anything
            self.patch_embed.set_patch_size(patch_size)
            self.config["patch_size"] = patch_size
        self.patch_embed.set_grid(img_size)
        self.config["img_size"] = list(img_size)
        self.data_config["img_size"] = list(img_size)
        if self.patch_embed.grid_size == old_grid:
            return
        self.pos_embed = nn.Parameter(self._pos_embed_for(self.pos_embed.detach(), old_grid, **resample_kwargs),
                                      requires_grad=self.pos_embed.requires_grad)  # fmt: skip

    def use_input_size(self, img_size: int | tuple[int, int] | None) -> None:
        """Take inputs of `img_size` from now on without changing any parameter (progressive resizing).

        Each forward then resamples the position embeddings from the stored full grid (sin-cos ones are
        drawn for the new grid), differentiably: the gradients reach the full-grid parameter, and since
        every size is resampled from that grid, never from another resample, nothing is lost. None (or
        the model's own img_size) goes back to img_size. `set_image_size` instead resizes the model for good.
        """
        size = self.patch_embed.img_size if img_size is None else to_2tuple(img_size)
        token_grid(size, self.patch_embed.patch_size)  # a size the patch does not divide: a ValueError naming it
        self.input_size = None if size == self.patch_embed.img_size else size

    def _pos_embed_for(
        self,
        pos_embed: torch.Tensor,
        old_grid: tuple[int, int],
        new_grid: tuple[int, int] | None = None,
        **resample_kwargs: Any,
    ) -> torch.Tensor:
        """`pos_embed` of grid `old_grid` for `new_grid` (default: the model's grid): resampled, or sin-cos
        drawn anew."""
        new_grid = new_grid or self.patch_embed.grid_size
        if self.config["pos_embed"] == "sincos":
            new = pos_embed.new_zeros(1, self.num_prefix_tokens + new_grid[0] * new_grid[1], self.embed_dim)
            new[0, self.num_prefix_tokens :] = sincos_pos_embed_2d(new_grid, self.embed_dim)
            return new
        return resample_pos_embed(
            pos_embed, new_grid, old_grid=old_grid, num_prefix_tokens=self.num_prefix_tokens, **resample_kwargs
        )

    def reset_head(self, num_classes: int) -> None:
        """Swap in a zero-initialised linear head (both heads of a distilled model) and drop the
        pre-logits layer (paper, section 3.2)."""
        self.pre_logits = nn.Identity()
        self.config.update(representation_size=None, num_classes=num_classes)
        self.num_classes = num_classes
        self.head = self._new_head(num_classes)
        if self.distilled:
            self.head_dist = self._new_head(num_classes)

    def _new_head(self, num_classes: int) -> nn.Module:
        """A zero-initialised linear head in the model's dtype and on its device (a bf16 or GPU model
        keeps working after the swap)."""
        if num_classes <= 0:
            return nn.Identity()
        head = nn.Linear(self.embed_dim, num_classes, device=self.pos_embed.device, dtype=self.pos_embed.dtype)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return head

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter names kept out of weight decay besides norms and biases."""
        return {"pos_embed", "cls_token", "dist_token"}


def _fit_checkpoint_to_size(model: VisionTransformer, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """`load_state_dict` pre-hook: a checkpoint's position embeddings of another token grid are
    resampled to the model's (sin-cos ones drawn anew), and a patch kernel of another size is
    PI-resized, as `set_image_size` does; each change is logged. Other mismatches are left to
    `load_state_dict` to report."""
    key, kernel_key = f"{prefix}pos_embed", f"{prefix}patch_embed.proj.weight"
    kernel = state_dict.get(kernel_key)
    if model.patch_embed.stem == "patch" and isinstance(kernel, torch.Tensor) and kernel.ndim == 4:
        old, new = tuple(kernel.shape[-2:]), model.patch_embed.proj.kernel_size
        if old != tuple(new) and kernel.shape[:2] == model.patch_embed.proj.weight.shape[:2]:
            state_dict[kernel_key] = resample_patch_kernel(kernel, new)
            log.warning("patch %d -> %d: kernel PI-resized (the checkpoint's patch size differs from the model's)",
                        old[0], new[0])  # fmt: skip
    pos = state_dict.get(key)
    if not isinstance(pos, torch.Tensor) or pos.ndim != 3 or pos.shape == model.pos_embed.shape:
        return
    if pos.shape[-1] != model.embed_dim or pos.shape[1] <= model.num_prefix_tokens:
        return
    grid = model.patch_embed.grid_size
    old_grid = infer_grid(pos.shape[1] - model.num_prefix_tokens, like=grid)
    state_dict[key] = model._pos_embed_for(pos.detach(), old_grid)
    h, w = model.patch_embed.img_size
    how = "drawn anew (sin-cos)" if model.config["pos_embed"] == "sincos" else "resampled"
    log.warning("pos_embed %s from the checkpoint's %dx%d token grid to %dx%d (img_size %dx%d)",
                how, *old_grid, *grid, h, w)  # fmt: skip
