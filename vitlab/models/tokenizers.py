"""Tokenizers: image `[B, C, H, W]` -> tokens `[B, h*w, D]`, one small module per kind.

Every tokenizer has the same interface: `patch_size` (its total stride in pixels), `img_size`,
`grid_size` (the token grid, `img_size / patch_size`), `set_grid(img_size)`, and `stem` (its name in
`VisionTransformer(stem=...)`). The model sits each one at `patch_embed`, so parameter names stay
`patch_embed.proj.weight`, `patch_embed.convs.0.0.weight`, `patch_embed.backbone.stem.conv.weight`...
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from vitlab.models.resize import resample_patch_kernel
from vitlab.models.resnet import resnet_backbone


def token_grid(img_size: tuple[int, int], patch_size: int) -> tuple[int, int]:
    """The token grid of `img_size`; a ValueError naming the nearest valid sizes when it does not divide."""
    h, w = img_size
    p = patch_size
    if h % p or w % p or h < 1 or w < 1:
        raise ValueError(
            f"img_size {h}x{w} is not a multiple of patch_size {p}; "
            f"use e.g. {max(p, h // p * p)}x{max(p, w // p * p)} or {max(p, -(-h // p) * p)}x{max(p, -(-w // p) * p)}"
        )
    return (h // p, w // p)


class Tokenizer(nn.Module):
    """The shared part: the input checks and the grid bookkeeping."""

    stem: ClassVar[str]

    def __init__(self, img_size: tuple[int, int], patch_size: int, in_chans: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.set_grid(img_size)

    def set_grid(self, img_size: tuple[int, int]) -> None:
        self.grid_size = token_grid(img_size, self.patch_size)
        self.img_size = (img_size[0], img_size[1])

    def set_patch_size(self, patch_size: int) -> None:
        """Change the patch size in place, resampling what depends on it; only `PatchEmbed` can."""
        raise ValueError(
            f"stem={self.stem!r} cannot change its patch size ({self.patch_size} -> {patch_size}): "
            f"{self.fixed_patch_reason()}; keep patch_size={self.patch_size} and change img_size instead "
            "(the token grid follows it), or use stem='patch'"
        )

    def fixed_patch_reason(self) -> str:
        return "its weights are not a kernel over one patch"

    def check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4:
            raise ValueError(f"expected a batch of images [B, C, H, W], got a tensor of shape {tuple(x.shape)}")
        _, c, h, w = x.shape
        if c != self.in_chans:
            raise ValueError(
                f"image has {c} channels but the model expects in_chans={self.in_chans}; "
                f"convert the images (e.g. to RGB) or build the model with in_chans={c}"
            )
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(
                f"image size {h}x{w} is not a multiple of the patch size {p}; "
                f"resize or crop to a multiple of {p}, e.g. {max(p, h // p * p)}x{max(p, w // p * p)}"
            )
        if (h, w) != self.img_size:
            raise ValueError(
                f"image size {h}x{w} differs from the model's img_size {self.img_size[0]}x{self.img_size[1]}; "
                f"resize the images, or call model.set_image_size(({h}, {w})) to resample the position embeddings"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return self.tokenize(x)

    def tokenize(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def init_weights(self) -> None:
        """Tokenizer-specific init, run after the model's generic Linear/LayerNorm init."""


def _lecun_normal_(conv: nn.Conv2d) -> None:
    # lecun-normal, as the paper's Flax code initialises its patch projection
    w = conv.weight
    nn.init.trunc_normal_(w, std=math.sqrt(1.0 / w[0].numel()) / 0.87962566103423978)
    nn.init.zeros_(conv.bias)


class PatchEmbed(Tokenizer):
    """The paper's tokenizer: non-overlapping patches, each linearly projected (a strided conv)."""

    stem = "patch"

    def __init__(self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__(img_size, patch_size, in_chans)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def tokenize(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)

    def init_weights(self) -> None:
        _lecun_normal_(self.proj)

    def set_patch_size(self, patch_size: int) -> None:
        """A new patch size with the kernel PI-resized (`resample_patch_kernel`); set the grid after."""
        if patch_size == self.patch_size:
            return
        if patch_size < 1:
            raise ValueError(f"patch_size must be >= 1, got {patch_size}")
        old = self.proj
        proj = nn.Conv2d(old.in_channels, old.out_channels, patch_size, patch_size, bias=old.bias is not None,
                         device=old.weight.device, dtype=old.weight.dtype)  # fmt: skip
        with torch.no_grad():
            proj.weight.copy_(resample_patch_kernel(old.weight, patch_size))
            if old.bias is not None:
                proj.bias.copy_(old.bias)
        proj.requires_grad_(old.weight.requires_grad)
        self.proj = proj
        self.patch_size = patch_size


class ConvTokenizer(Tokenizer):
    """log2(patch_size) stages of conv3x3-ReLU-maxpool (CCT, arXiv 2104.05704)."""

    stem = "conv"

    def __init__(
        self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int, channels: int = 64
    ) -> None:
        stages = int(math.log2(patch_size)) if patch_size > 0 else 0
        if 2**stages != patch_size or stages < 1:
            raise ValueError(f"stem='conv' needs a power-of-two patch_size >= 2 (got {patch_size})")
        super().__init__(img_size, patch_size, in_chans)
        chans = [in_chans] + [channels] * (stages - 1) + [embed_dim]
        self.convs = nn.Sequential(*(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
            for a, b in itertools.pairwise(chans)
        ))  # fmt: skip

    def tokenize(self, x: torch.Tensor) -> torch.Tensor:
        # Channels-last: oneDNN's and cuDNN's fast convolution layout (the recipes' training steps run
        # 1.4-1.5x faster on a CPU, bench/README.md), and the NHWC output flattens to tokens without a copy.
        x = x.contiguous(memory_format=torch.channels_last)
        return self.convs(x).flatten(2).transpose(1, 2)

    def fixed_patch_reason(self) -> str:
        return (f"its patch size is its number of conv-and-pool stages (log2 {self.patch_size} = {len(self.convs)}), "
                "not a kernel to resample")


class ShiftedPatchTokenizer(Tokenizer):
    """Shifted patch tokenization (arXiv 2112.13492): the image and its four half-patch diagonal
    shifts concatenated, then patches flattened, LayerNorm and a linear map."""

    stem = "spt"

    def __init__(self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__(img_size, patch_size, in_chans)
        patch_dim = 5 * in_chans * patch_size * patch_size
        self.norm = nn.LayerNorm(patch_dim)
        self.proj = nn.Linear(patch_dim, embed_dim)

    def tokenize(self, x: torch.Tensor) -> torch.Tensor:
        s, (h, w) = self.patch_size // 2, x.shape[-2:]
        padded = F.pad(x, (s, s, s, s))
        diagonals = ((-s, -s), (-s, s), (s, -s), (s, s))
        shifts = [padded[..., s + dy : s + dy + h, s + dx : s + dx + w] for dy, dx in diagonals]
        x = torch.cat([x, *shifts], dim=1)
        x = rearrange(x, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=self.patch_size, p2=self.patch_size)
        return self.proj(self.norm(x))

    def fixed_patch_reason(self) -> str:
        return "its LayerNorm normalises each flattened patch over its own pixels, which has no resampled equivalent"


class HybridEmbed(Tokenizer):
    """The paper's hybrid: a ResNet feature map, then a patch projection of it (a 1x1 conv for R50+ViT,
    whose tokens are the stride-16 feature-map cells). `patch_size` is the total stride, ResNet stride
    times projection kernel, so the token grid (and the position-embedding grid) is img / patch_size."""

    stem = "resnet"

    def __init__(
        self,
        img_size: tuple[int, int],
        patch_size: int,
        in_chans: int,
        embed_dim: int,
        layers: Sequence[int] = (3, 4, 9),
        width: int = 64,
    ) -> None:
        backbone, feature_dim, stride = resnet_backbone(layers, in_chans, width)
        if patch_size % stride:
            raise ValueError(
                f"stem='resnet' with stem_layers={list(layers)} has stride {stride}; patch_size={patch_size} "
                f"(the total stride) must be a multiple of it, e.g. {stride} for a 1x1 projection"
            )
        super().__init__(img_size, patch_size, in_chans)
        self.backbone = backbone
        kernel = patch_size // stride
        self.proj = nn.Conv2d(feature_dim, embed_dim, kernel_size=kernel, stride=kernel)

    def tokenize(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.backbone(x)).flatten(2).transpose(1, 2)

    def fixed_patch_reason(self) -> str:
        stride = self.patch_size // self.proj.kernel_size[0]
        return (f"its patch size is the ResNet's stride ({stride}) times the projection's kernel "
                f"({self.proj.kernel_size[0]}), and the ResNet's convolutions are not patch kernels")

    def init_weights(self) -> None:
        _lecun_normal_(self.proj)


STEMS = ("patch", "conv", "spt", "resnet")


def make_tokenizer(
    stem: str,
    img_size: tuple[int, int],
    patch_size: int,
    in_chans: int,
    embed_dim: int,
    stem_channels: int = 64,
    stem_layers: Sequence[int] | None = None,
) -> Tokenizer:
    """The tokenizer `VisionTransformer(stem=...)` names."""
    if stem_layers is not None and stem != "resnet":
        raise ValueError(f"stem_layers is the ResNet's stage depths and needs stem='resnet' (got stem={stem!r})")
    if stem == "patch":
        return PatchEmbed(img_size, patch_size, in_chans, embed_dim)
    if stem == "conv":
        return ConvTokenizer(img_size, patch_size, in_chans, embed_dim, stem_channels)
    if stem == "spt":
        return ShiftedPatchTokenizer(img_size, patch_size, in_chans, embed_dim)
    if stem == "resnet":
        layers = (3, 4, 9) if stem_layers is None else tuple(stem_layers)
        return HybridEmbed(img_size, patch_size, in_chans, embed_dim, layers, stem_channels)
    raise ValueError(f"unknown stem {stem!r}; choose one of {', '.join(repr(s) for s in STEMS)}")
