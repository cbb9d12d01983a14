"""The ResNet stem of the paper's hybrid ViT (arXiv 2010.11929, section 3.1).

A BiT-style ResNet (arXiv 1912.11370) without pre-activation: weight-standardised convolutions,
GroupNorm with 32 groups, TF "SAME" padding (the padding Google's Flax code trained with, so its
weights give the same features), bottleneck blocks. The paper's R50 keeps stages (3, 4, 9): stage 4
is dropped and its layers moved to stage 3, which leaves an output stride of 16. Module names follow
timm's `ResNetV2` (`stem.conv`, `stages.N.blocks.M.conv1`...) so hybrid checkpoints carry over.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def pad_same(x: torch.Tensor, kernel_size: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """TF "SAME" padding for the input's own size: output = ceil(input / stride), extra pixel at the end."""
    pads = []
    for size in (x.shape[-1], x.shape[-2]):  # F.pad takes the last dimension first
        total = max((math.ceil(size / stride) - 1) * stride + kernel_size - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads, value=value)


class StdConv2dSame(nn.Conv2d):
    """Conv2d whose kernel is standardised per output channel (zero mean, unit variance) at every call."""

    def __init__(self, in_chans: int, out_chans: int, kernel_size: int, stride: int = 1, eps: float = 1e-8) -> None:
        super().__init__(in_chans, out_chans, kernel_size, stride=stride, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(self.weight, dim=(1, 2, 3), keepdim=True, correction=0)
        weight = (self.weight - mean) * torch.rsqrt(var + self.eps)
        k, s = self.kernel_size[0], self.stride[0]
        return F.conv2d(pad_same(x, k, s), weight, None, s)


class GroupNormAct(nn.GroupNorm):
    """GroupNorm (32 groups), then ReLU unless `act=False`."""

    def __init__(self, channels: int, act: bool = True, groups: int = 32, eps: float = 1e-5) -> None:
        super().__init__(groups, channels, eps=eps)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return F.relu(x) if self.act else x


class MaxPool2dSame(nn.Module):
    """3x3 stride-2 max pooling with "SAME" padding (padded with -inf, so the padding never wins)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, 2)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1, each followed by GroupNorm; ReLU after the residual sum."""

    def __init__(self, in_chans: int, out_chans: int, stride: int = 1, project: bool = False) -> None:
        super().__init__()
        mid = out_chans // 4
        self.downsample = None  # the projection shortcut: strided 1x1 conv and GroupNorm
        if project:
            self.downsample = nn.Sequential(OrderedDict(conv=StdConv2dSame(in_chans, out_chans, 1, stride),
                                                        norm=GroupNormAct(out_chans, act=False)))  # fmt: skip
        self.conv1 = StdConv2dSame(in_chans, mid, 1)
        self.norm1 = GroupNormAct(mid)
        self.conv2 = StdConv2dSame(mid, mid, 3, stride)
        self.norm2 = GroupNormAct(mid)
        self.conv3 = StdConv2dSame(mid, out_chans, 1)
        self.norm3 = GroupNormAct(out_chans, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.norm1(self.conv1(x))
        x = self.norm2(self.conv2(x))
        return F.relu(self.norm3(self.conv3(x)) + shortcut)


def resnet_stage(in_chans: int, out_chans: int, depth: int, stride: int) -> nn.Sequential:
    """`depth` bottlenecks, the first projecting and striding, under `blocks` (timm's names)."""
    blocks = [Bottleneck(in_chans if i == 0 else out_chans, out_chans, stride if i == 0 else 1, project=i == 0)
              for i in range(depth)]  # fmt: skip
    return nn.Sequential(OrderedDict(blocks=nn.Sequential(*blocks)))


def resnet_root(in_chans: int, width: int) -> nn.Sequential:
    """7x7 stride-2 conv, GroupNorm + ReLU, 3x3 stride-2 max pool: output stride 4."""
    return nn.Sequential(OrderedDict(conv=StdConv2dSame(in_chans, width, 7, 2), norm=GroupNormAct(width),
                                     pool=MaxPool2dSame()))  # fmt: skip


class ResNet(nn.Module):
    """Root + bottleneck stages; stage i has 4 * width * 2**i output channels, and every stage after
    the first halves the resolution."""

    def __init__(self, layers: Sequence[int], in_chans: int = 3, width: int = 64) -> None:
        super().__init__()
        self.stem = resnet_root(in_chans, width)
        self.stages = nn.Sequential()
        chans = width
        for i, depth in enumerate(layers):
            out = 4 * width * 2**i
            self.stages.add_module(str(i), resnet_stage(chans, out, depth, stride=1 if i == 0 else 2))
            chans = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


def resnet_stride(num_stages: int) -> int:
    """Output stride: 4 from the root, then x2 for every stage after the first."""
    return 4 * 2 ** max(num_stages - 1, 0)


def resnet_backbone(layers: Sequence[int], in_chans: int = 3, width: int = 64) -> tuple[nn.Module, int, int]:
    """The backbone for `layers` with its output channels and stride. No stages: the root alone (as
    timm's `R+ViT-Ti` hybrid, whose backbone then *is* the root, hence the different names)."""
    if any(d < 1 for d in layers):
        raise ValueError(f"stem_layers={list(layers)}: every ResNet stage needs at least one block")
    backbone = ResNet(layers, in_chans, width) if layers else resnet_root(in_chans, width)
    out_chans = 4 * width * 2 ** (len(layers) - 1) if layers else width
    stride = resnet_stride(len(layers))
    for m in backbone.modules():  # He init for ReLU nets, as BiT
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return backbone, out_chans, stride
