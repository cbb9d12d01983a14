"""`export`: write a vitlab model in the format another runtime loads (vitlab, HF transformers, timm, ONNX).

Each format module writes its own files; this one holds what they share: which model options each
format can express, checked before anything is written, so an export is never a silently
different model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vitlab.interop.errors import ExportError
from vitlab.models.vit import VisionTransformer

log = logging.getLogger(__name__)

FORMATS = ("vitlab", "hf", "timm", "onnx")
# ONNX traces the forward pass, so it takes every option; vitlab's own format stores the config.
_ALL = frozenset(FORMATS)
_TRACED = frozenset({"vitlab", "onnx"})
# Formats whose model takes one input size (transformers' ViT refuses another without
# `interpolate_pos_encoding`; an ONNX graph is traced at one): written at the recorded test size, the
# trained size kept in their config. vitlab and timm keep the trained weights and record both sizes.
_FIXED_SIZE = frozenset({"hf", "onnx"})


def _options(config: Mapping[str, Any]) -> list[tuple[str, frozenset[str]]]:
    """Each option the model uses that some format cannot express, with the formats that can."""
    found: list[tuple[str, frozenset[str]]] = []

    def need(used: bool, option: str, formats: frozenset[str]) -> None:
        if used:
            found.append((option, formats))

    stem = config.get("stem", "patch")
    need(stem in ("conv", "spt"), f"stem={stem!r} (a tokenizer other than patches)", _TRACED)
    if stem == "resnet":  # timm registers a few hybrids; HF none
        from vitlab.interop.timm import TIMM_HYBRIDS, hybrid_layers, timm_hybrid

        known = timm_hybrid(config) is not None
        shown = f"stem='resnet' (a ResNet hybrid, stages {list(hybrid_layers(config))}, root width " \
                f"{config.get('stem_channels', 64)})" + ("" if known else f"; timm's hybrids have root width 64 and "
                f"stages {' or '.join(str(list(k)) for k in TIMM_HYBRIDS)}")  # fmt: skip
        need(True, shown, _TRACED | ({"timm"} if known else set()))
    need(config.get("pool") == "seq", "pool='seq' (sequence pooling)", _TRACED)
    need(config.get("pool") == "avg", "pool='avg' (average pooling)", _TRACED | {"timm"})
    need(not config.get("class_token", True), "class_token=False", _TRACED | {"timm"})
    need(bool(config.get("lsa")), "lsa=True (locality self-attention)", _TRACED)
    need(config.get("pos_embed", "learn") == "sincos", "pos_embed='sincos' (fixed 2D sin-cos)", _TRACED)
    need(bool(config.get("representation_size")), "representation_size (a pre-logits layer)", _TRACED)
    need(bool(config.get("distilled")), "distilled=True (a distillation token and head)", _TRACED | {"timm"})
    need(config.get("num_classes", 1) <= 0, "num_classes=0 (no classification head)", _ALL - {"hf"})
    need(config.get("norm_eps", 1e-6) != 1e-6, f"norm_eps={config.get('norm_eps')} (timm's ViT fixes 1e-6)",
         _ALL - {"timm"})  # fmt: skip
    return found


def check_expressible(model: VisionTransformer, format: str) -> None:
    """Raise `ExportError` naming every option of `model` that `format` cannot express."""
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    missing = [(opt, ok) for opt, ok in _options(model.config) if format not in ok]
    if missing:
        lines = [f"{opt}: export it as {' or '.join(f for f in FORMATS if f in ok)}" for opt, ok in missing]
        raise ExportError(
            f"the {format} format cannot express this model, which uses:\n  " + "\n  ".join(lines)
        )


def export(model: VisionTransformer | str | Path, format: str, out: str | Path) -> Path:
    """Write `model` (or the checkpoint at that path, any format `load_pretrained` reads) into the
    folder `out` in `format`: "vitlab", "hf", "timm" or "onnx". Returns the folder.

    A recorded test size is kept: vitlab and timm write the trained weights with both sizes (timm's
    `input_size` and `test_input_size`), hf and onnx the model at its test size (the HF image
    processor's size) with the trained size in their `config.json`."""
    from vitlab.interop import hf, onnx, timm, vitlab_format
    from vitlab.interop.eval_size import at_test_size, eval_size_of
    from vitlab.interop.load import load_pretrained

    if not isinstance(model, VisionTransformer):
        model = load_pretrained(model, use_test_size=False)  # as trained: each format records the test size
    check_expressible(model, format)
    if format in _FIXED_SIZE:
        model = at_test_size(model, f"the {format} export")
    elif (test := eval_size_of(model.data_config)) is not None:
        h, w = model.patch_embed.img_size
        log.warning("the %s export: the weights at %dx%d, with the recorded test size %s", format, h, w, test)
    writers: dict[str, Callable[[VisionTransformer, Path], Path]] = {
        "vitlab": vitlab_format.save_pretrained, "hf": hf.export_hf, "timm": timm.export_timm,
        "onnx": onnx.export_onnx,
    }  # fmt: skip
    return writers[format](model, Path(out))
