"""`load_pretrained`: one loader for every checkpoint format vitlab reads."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitlab.interop import hf, jax_npz, timm, torchvision, vitlab_format
from vitlab.interop.architecture import TIMM_RESAMPLE, Converted, build_model
from vitlab.interop.errors import CheckpointError
from vitlab.interop.eval_size import set_test_size
from vitlab.interop.files import RawCheckpoint, read_checkpoint, unwrap_state_dict
from vitlab.interop.hub import resolve_source
from vitlab.models.resize import to_2tuple
from vitlab.models.vit import VisionTransformer

_CONSTRUCTOR_ARGS = set(inspect.signature(VisionTransformer.__init__).parameters) - {"self"}
_KNOWN_LAYOUTS = (
    "vitlab/timm (`patch_embed.proj.weight`, `blocks.N.*`), HF transformers "
    "(`[vit.]embeddings.patch_embeddings.projection.weight`), torchvision (`conv_proj.weight`, "
    "`encoder.pos_embedding`), Google .npz (`[params/]embedding/kernel`)"
)


def load_pretrained(
    path: str | Path,
    *,
    img_size: int | tuple[int, int] | None = None,
    num_classes: int | None = None,
    config: Mapping[str, Any] | None = None,
    resample: str | Mapping[str, Any] | None = None,
    use_test_size: bool = True,
) -> VisionTransformer:
    """Load a ViT checkpoint of any supported format into a vitlab `VisionTransformer` (eval mode).

    `path`: a vitlab `save_pretrained` folder or its `model.safetensors`, a vitlab Lightning `.ckpt`,
    a timm / HF transformers / torchvision state dict (`.pth`, `.bin`, `.safetensors`) or a Google
    `.npz`; or a public one by name: `hf-hub:ORG/NAME[@REVISION]` (a timm or transformers repo) or
    an `https://` URL of such a file, fetched once into its cache (`vitlab.interop.hub`). The
    format is detected from the tensor names and the architecture inferred from their shapes.
    `config`: `VisionTransformer` constructor arguments, the same word as `model.config`; they
    set what shapes cannot tell (`num_heads` for torch formats, `img_size` for a non-square grid,
    `in_chans`) and override the rest (`drop_path_rate`...).

    `img_size`: resample the position embeddings to this input size, with timm's rule (bicubic,
    antialias) unless `resample="family"` (the source's own rule) or a dict of
    `resample_pos_embed` arguments is given. `num_classes`: swap in a zero-initialised head.

    A checkpoint that records a test size (`vitlab resolution` chose it on the validation split) loads
    at that size when `img_size` is not given, and says so in one log line; `data_config` then holds
    the test `img_size`/`crop_pct` and the trained ones as `train_img_size`/`train_crop_pct`
    (`vitlab.interop.eval_size`). `use_test_size=False` loads the model as trained.
    """
    config = dict(config or {})
    unknown = sorted(set(config) - _CONSTRUCTOR_ARGS)
    if unknown:
        raise TypeError(f"unknown VisionTransformer argument(s) in config: {', '.join(unknown)}")
    source = resolve_source(path)
    raw = read_checkpoint(source.path, name=source.label)
    conv = convert(raw, config)
    model = build_model(conv, config)
    if img_size is not None and to_2tuple(img_size) != tuple(model.patch_embed.img_size):
        model.set_image_size(img_size, **_resample_rule(resample, conv))
    elif img_size is None and use_test_size:
        set_test_size(model, source.label or str(path))
    if num_classes is not None and num_classes != model.num_classes:
        model.reset_head(num_classes)
        model.data_config["class_names"] = None  # the old names describe the old head
    return model.eval()


def _resample_rule(resample: str | Mapping[str, Any] | None, conv: Converted) -> dict[str, Any]:
    if resample is None or resample == "timm":
        return dict(TIMM_RESAMPLE)
    if resample == "family":
        return dict(conv.resample)
    if isinstance(resample, Mapping):
        return {**TIMM_RESAMPLE, **resample}
    raise ValueError(f"resample={resample!r}; use None/'timm', 'family' or a dict of resample_pos_embed arguments")


def convert(raw: RawCheckpoint, config: Mapping[str, Any]) -> Converted:
    """Detect the format of a read checkpoint and convert it to vitlab names (`config`: the caller's)."""
    path, obj = raw.label, raw.obj
    if raw.kind == "npz":
        if jax_npz.looks_like(list(obj)):
            return jax_npz.convert(obj, path, config)
        raise _not_a_vit(list(obj), path)
    if vitlab_format.is_lightning(obj):
        return vitlab_format.convert_lightning(obj, path)
    tensors = unwrap_state_dict(obj, path)
    keys = list(tensors)
    if vitlab_format.is_native_sidecar(raw.sidecar) and timm.looks_like(keys):
        return vitlab_format.convert_saved(tensors, raw.sidecar, path)  # type: ignore[arg-type]
    if timm.looks_like(keys):
        return timm.convert(tensors, path, config, raw.sidecar)
    if hf.looks_like(keys):
        return hf.convert(tensors, path, raw.sidecar, raw.processor)
    if torchvision.looks_like(keys):
        return torchvision.convert(tensors, path)
    if jax_npz.looks_like(keys):  # Flax names in a torch/safetensors container
        return jax_npz.convert(tensors, path, config)
    raise _not_a_vit(keys, path)


def _not_a_vit(keys: list[str], path: str) -> CheckpointError:
    shown = ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "")
    return CheckpointError(
        f"not a ViT checkpoint vitlab recognises ({len(keys)} tensors: {shown}); known layouts: {_KNOWN_LAYOUTS}",
        path=path,
    )
