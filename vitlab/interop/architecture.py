"""What every format converter shares: tensor access with checks, architecture inference, building.

Each converter turns a peer's checkpoint into vitlab parameter names (which equal timm's) plus the
part of the model config (`VisionTransformer` constructor arguments) that the shapes cannot tell,
e.g. the norm eps; then `build_model` infers the rest of the config from the shapes, builds the
model and loads it strictly.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vitlab.interop.errors import CheckpointError
from vitlab.models.resize import to_2tuple
from vitlab.models.resnet import resnet_stride
from vitlab.models.variants import VARIANTS
from vitlab.models.vit import VisionTransformer

# timm's rule for resampling position embeddings, the default for every source.
TIMM_RESAMPLE: dict[str, Any] = {"mode": "bicubic", "antialias": True, "align_corners": False}

# Public ViTs keep 64 dims per head, except the wide ones below (ViT-H/g/G, SigLIP so400m).
_HEADS_BY_DIM = {dim: heads for dim, _, heads, _ in VARIANTS.values()} | {1152: 16, 1408: 16, 1664: 16}

MAX_LISTED = 12
log = logging.getLogger(__name__)


def default_num_heads(embed_dim: int) -> int | None:
    return _HEADS_BY_DIM.get(embed_dim, embed_dim // 64 if embed_dim % 64 == 0 else None)


# Wrappers a training run may leave on parameter names: DDP and torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_prefix(keys: Iterable[str], prefixes: Sequence[str] = WRAPPER_PREFIXES) -> dict[str, str]:
    """new name -> old name, removing any of `prefixes` repeatedly while every key carries it."""
    names = {k: k for k in keys}
    changed = True
    while changed and names:
        changed = False
        for p in prefixes:
            if all(k.startswith(p) for k in names):
                names = {k[len(p) :]: v for k, v in names.items()}
                changed = True
    return names


def _listing(items: list[str]) -> str:
    shown = items[:MAX_LISTED]
    more = f" ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return ", ".join(shown) + more


class Source:
    """One checkpoint's tensors by name: checked (floating point) and cast to float32 as they are taken.

    Remembers what was taken, so a converter can report tensors it did not understand.
    """

    def __init__(self, tensors: Mapping[str, Any], format: str, path: str | None = None) -> None:
        self.tensors = dict(tensors)
        self.format = format
        self.path = path
        self.used: set[str] = set()

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(message, format=self.format, path=self.path)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def take(self, key: str, index: int | None = None, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
        if key not in self.tensors:
            raise self.error(f"missing tensor {key!r}")
        self.used.add(key)
        value = self.tensors[key]
        t = _to_float_tensor(value, key, self)
        if index is not None:
            if t.ndim == 0 or t.shape[0] <= index:
                raise self.error(f"{key} has shape {tuple(t.shape)}; expected a stacked leading axis over blocks")
            t = t[index]
        if ndim is not None:
            allowed = (ndim,) if isinstance(ndim, int) else ndim
            if t.ndim not in allowed:
                raise self.error(
                    f"{key} has shape {tuple(t.shape)} (rank {t.ndim}); expected rank {' or '.join(map(str, allowed))}"
                )
        return t

    def skip(self, *keys: str) -> None:
        self.used.update(k for k in keys if k in self.tensors)

    def finish(self) -> None:
        """Fail on tensors the converter did not map: they belong to parts vitlab does not implement."""
        rest = [k for k in self.tensors if k not in self.used]
        if rest:
            raise self.error(
                f"{len(rest)} tensor(s) do not map onto vitlab's ViT (a variant with parts it does not "
                f"implement?): {_listing(rest)}"
            )


def _to_float_tensor(value: Any, key: str, src: Source) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "V" and value.dtype.itemsize == 2:  # bfloat16 stored as raw 2-byte words
            return torch.from_numpy(np.ascontiguousarray(value).view(np.int16)).view(torch.bfloat16).float()
        if value.dtype.kind != "f":
            raise src.error(f"tensor {key!r} has dtype {value.dtype}; expected floating point weights")
        return torch.from_numpy(np.ascontiguousarray(value)).float()
    if not isinstance(value, torch.Tensor):
        raise src.error(f"entry {key!r} is a {type(value).__name__}, not a tensor")
    if not value.is_floating_point():
        raise src.error(f"tensor {key!r} has dtype {value.dtype}; expected floating point weights")
    return value.float()


@dataclass
class Converted:
    """A checkpoint in vitlab names, with what is needed to rebuild its model."""

    format: str
    state_dict: dict[str, torch.Tensor]
    path: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # vitlab name -> the source name(s), for messages
    config: dict[str, Any] = field(default_factory=dict)  # constructor args the file states
    complete: bool = False  # `config` holds every constructor argument (vitlab checkpoints): no inference
    data_config: dict[str, Any] = field(default_factory=dict)
    resample: dict[str, Any] = field(default_factory=lambda: dict(TIMM_RESAMPLE))  # the family's own rule

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(message, format=self.format, path=self.path)

    def put(self, name: str, tensor: torch.Tensor, source: str) -> None:
        self.state_dict[name] = tensor
        self.sources[name] = source


def infer_config(sd: Mapping[str, torch.Tensor], config: Mapping[str, Any], err: Any) -> dict[str, Any]:
    """Constructor arguments from the shapes of a vitlab-named state dict; `config` fills what shapes cannot."""
    cfg: dict[str, Any] = {}
    in_chans = int(config.get("in_chans", 3))
    if any(k.startswith("patch_embed.backbone.") for k in sd):
        dim, in_chans, patch, hybrid = _resnet_stem(sd, err)
        cfg.update(hybrid)
    elif "patch_embed.proj.weight" in sd and "patch_embed.norm.weight" in sd:
        dim, patch_dim = sd["patch_embed.proj.weight"].shape
        patch = math.isqrt(patch_dim // (5 * in_chans))
        if 5 * in_chans * patch * patch != patch_dim:
            raise err(
                f"patch_embed.proj.weight {tuple(sd['patch_embed.proj.weight'].shape)} fits no shifted-patch "
                f"stem with in_chans={in_chans}"
            )
        cfg.update(stem="spt")
    elif "patch_embed.proj.weight" in sd:
        w = sd["patch_embed.proj.weight"]
        if w.ndim != 4 or w.shape[-1] != w.shape[-2]:
            raise err(f"patch_embed.proj.weight has shape {tuple(w.shape)}; expected [dim, chans, p, p]")
        dim, in_chans, patch = w.shape[0], w.shape[1], w.shape[-1]
    elif "patch_embed.convs.0.0.weight" in sd:
        stages = len({m.group(1) for k in sd if (m := re.match(r"patch_embed\.convs\.(\d+)\.", k))})
        dim = sd[f"patch_embed.convs.{stages - 1}.0.weight"].shape[0]
        in_chans = sd["patch_embed.convs.0.0.weight"].shape[1]
        patch = 2**stages
        cfg.update(stem="conv", stem_channels=sd["patch_embed.convs.0.0.weight"].shape[0] if stages > 1 else 64)
    else:
        raise err("no patch embedding found (patch_embed.proj.weight)")

    blocks = sorted({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    if not blocks:
        raise err("no transformer blocks found (blocks.N.*)")
    if blocks != list(range(len(blocks))):
        raise err(f"transformer block indices are not 0..{len(blocks) - 1}: {blocks}")
    fc1 = sd.get("blocks.0.mlp.fc1.weight")
    hidden = fc1.shape[0] if fc1 is not None else 4 * dim
    mlp_ratio = hidden / dim
    if int(dim * mlp_ratio) != hidden:  # keep int(dim * ratio) exact against float rounding
        mlp_ratio = (hidden + 0.5) / dim

    class_token = "cls_token" in sd
    distilled = "dist_token" in sd  # DeiT: a second prefix token with its own head
    found = {"avg": "fc_norm.weight" in sd, "seq": "attn_pool.weight" in sd, "token": class_token}
    pool = next((p for p, here in found.items() if here), None)
    if pool is None:
        raise err(
            "no class token and no fc_norm: the model pools the tokens after the final norm (GAP after norm), "
            "which vitlab's ViT does not implement (its GAP models normalise after pooling, as timm's fc_norm)"
        )

    num_heads = config.get("num_heads") or default_num_heads(dim)
    if not num_heads:
        raise err(
            f"num_heads is not stored in the checkpoint and embed_dim={dim} does not follow the "
            f"64-dims-per-head convention; pass config={{'num_heads': ...}}"
        )

    if "pos_embed" not in sd:
        raise err("no position embedding found (pos_embed)")
    pos = sd["pos_embed"]
    if pos.ndim != 3 or pos.shape[0] != 1:
        raise err(f"pos_embed has shape {tuple(pos.shape)}; expected [1, tokens, dim]")
    cells = pos.shape[1] - int(class_token) - int(distilled)
    if config.get("img_size") is not None:
        h, w = to_2tuple(config["img_size"])
        if (h // patch) * (w // patch) != cells:
            raise err(
                f"img_size {h}x{w} with patch {patch} gives {(h // patch) * (w // patch)} grid tokens, "
                f"but pos_embed {tuple(pos.shape)} holds {cells}"
            )
        img_size = [h, w]
    else:
        side = math.isqrt(cells)
        if side * side != cells:
            raise err(
                f"pos_embed {tuple(pos.shape)} holds {cells} grid tokens, not a square grid; "
                f"pass config={{'img_size': (height, width)}}"
            )
        img_size = [side * patch, side * patch]

    pre = sd.get("pre_logits.fc.weight")
    head = sd.get("head.weight")
    cfg.update(
        img_size=img_size,
        patch_size=int(patch),
        in_chans=int(in_chans),
        embed_dim=int(dim),
        depth=len(blocks),
        num_heads=int(num_heads),
        mlp_ratio=mlp_ratio,
        qkv_bias="blocks.0.attn.qkv.bias" in sd,
        class_token=class_token,
        pool=pool,
        representation_size=int(pre.shape[0]) if pre is not None else None,
        num_classes=int(head.shape[0]) if head is not None else 0,
        lsa="blocks.0.attn.log_scale" in sd,
        distilled=distilled,
        norm_eps=config.get("norm_eps", 1e-6),
    )
    return cfg


def _resnet_stem(sd: Mapping[str, torch.Tensor], err: Any) -> tuple[int, int, int, dict[str, Any]]:
    """embed_dim, in_chans, total stride and the stem arguments of a ResNet hybrid (timm's
    `patch_embed.backbone.*`): root width, blocks per stage, projection kernel on the feature map."""
    roots = ("patch_embed.backbone.stem.conv.weight", "patch_embed.backbone.conv.weight")  # with stages, root only
    root = next((k for k in roots if k in sd), None)
    if root is None or "patch_embed.proj.weight" not in sd:
        raise err(f"a ResNet hybrid needs its root conv ({' or '.join(roots)}) and patch_embed.proj.weight")
    depths: dict[int, int] = {}
    for k in sd:
        if m := re.match(r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.", k):
            depths[int(m.group(1))] = max(depths.get(int(m.group(1)), 0), int(m.group(2)) + 1)
    if sorted(depths) != list(range(len(depths))):
        raise err(f"ResNet stage indices are not 0..{len(depths) - 1}: {sorted(depths)}")
    proj = sd["patch_embed.proj.weight"]
    width, in_chans = sd[root].shape[:2]
    patch = resnet_stride(len(depths)) * proj.shape[-1]
    layers = [depths[i] for i in range(len(depths))]
    return proj.shape[0], in_chans, patch, dict(stem="resnet", stem_layers=layers, stem_channels=int(width))


def add_distillation_token(conv: Converted) -> None:
    """A plain class-token ViT -> a distilled (DeiT) one: the distillation token and its position
    embedding start as copies of the class token's, the distillation head as a copy of the class
    head. Both heads then predict alike at the first step, and the distillation loss trains them
    apart: a pretrained encoder becomes a distilled student without a random token in it."""
    sd = conv.state_dict
    pos = sd["pos_embed"]
    conv.put("dist_token", sd["cls_token"].clone(), "cls_token (copied)")
    conv.put("pos_embed", torch.cat([pos[:, :1], pos[:, :1], pos[:, 1:]], dim=1), "pos_embed (class row repeated)")
    for part in ("weight", "bias"):
        if f"head.{part}" in sd:
            conv.put(f"head_dist.{part}", sd[f"head.{part}"].clone(), f"head.{part} (copied)")
    log.info("%s: a plain ViT made distilled: dist_token, its position and head_dist copied from the class "
             "token's", conv.path or conv.format)  # fmt: skip


def _check_fit(model: VisionTransformer, conv: Converted) -> None:
    expected = model.state_dict()
    sd = conv.state_dict

    def name(k: str) -> str:
        src = conv.sources.get(k)
        return f"{k} (from {src})" if src and src != k else k

    mismatched = [
        f"{name(k)}: checkpoint {tuple(sd[k].shape)}, model expects {tuple(v.shape)}"
        for k, v in expected.items()
        if k in sd and sd[k].shape != v.shape
    ]
    missing = [k for k in expected if k not in sd]
    unexpected = [name(k) for k in sd if k not in expected]
    if not (mismatched or missing or unexpected):
        return
    c = model.config
    lines = [
        f"tensors do not fit the ViT built from it (embed_dim={c['embed_dim']}, depth={c['depth']}, "
        f"num_heads={c['num_heads']}, patch_size={c['patch_size']}, img_size={c['img_size']}):"
    ]
    lines += [f"  shape mismatch: {m}" for m in mismatched[:MAX_LISTED]]
    if len(mismatched) > MAX_LISTED:
        lines.append(f"  ... and {len(mismatched) - MAX_LISTED} more shape mismatches")
    if missing:
        lines.append(f"  missing: {_listing(missing)}")
    if unexpected:
        lines.append(f"  unexpected: {_listing(unexpected)}")
    raise conv.error("\n".join(lines))


def build_model(conv: Converted, config: Mapping[str, Any]) -> VisionTransformer:
    """Infer (or take the stored) config, build the model without initialising it, and load strictly.

    `config`: the caller's constructor arguments, which win over the file's and the inferred ones.
    `distilled=True` over a plain ViT gives it a distillation token (`add_distillation_token`).
    """
    if config.get("distilled") and "dist_token" not in conv.state_dict and "cls_token" in conv.state_dict:
        add_distillation_token(conv)
        conv.config["distilled"] = True
    if conv.complete:
        cfg = {**conv.config, **config}
    else:
        known = {**conv.config, **config}
        try:
            cfg = {**infer_config(conv.state_dict, known, conv.error), **known}
        except CheckpointError:
            raise
        except (KeyError, IndexError, TypeError, ValueError) as e:  # tensors of unexpected rank or absent
            raise conv.error(f"cannot infer the architecture from the tensor shapes ({type(e).__name__}: {e})") from e
    # Own, freshly allocated (aligned) memory: safetensors hands out views into one file buffer, whose
    # alignment changes which CPU kernels run (and so the last bits of some outputs).
    conv.state_dict = {k: v.clone(memory_format=torch.contiguous_format) for k, v in conv.state_dict.items()}
    try:
        with torch.device("meta"):  # skip the random init: every tensor is replaced by the checkpoint's
            model = VisionTransformer(**cfg)
    except (TypeError, ValueError) as e:
        raise conv.error(f"cannot build a ViT from config {cfg}: {e}") from e
    _check_fit(model, conv)
    model.load_state_dict(conv.state_dict, strict=True, assign=True)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):  # a tensor outside the state dict
        model = VisionTransformer(**cfg)
        model.load_state_dict(conv.state_dict, strict=True)
    data = {**model.data_config, **conv.data_config}
    data["img_size"] = list(model.patch_embed.img_size)
    model.data_config = data
    return model
