"""Export a vitlab model to ONNX for ONNX Runtime: `model.onnx` with a dynamic batch axis, plus a
`config.json` stating the opset, the input and output names and the preprocessing.

Needs the optional `onnx` and `onnxscript` packages (`pip install 'vitlab[onnx]'`): torch's
exporter writes the graph through them.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from vitlab.interop.errors import ExportError
from vitlab.models.vit import VisionTransformer

OPSET = 18
INPUT_NAME = "pixel_values"
OUTPUT_NAME = "logits"
_NEEDS = ("onnx", "onnxscript")


def _check_installed() -> None:
    missing = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(
            f"ONNX export needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            "installed; install them with: pip install 'vitlab[onnx]'"
        )


def onnx_config(model: VisionTransformer) -> dict[str, Any]:
    c, d = model.config, model.data_config
    return {
        "format": "onnx", "opset": OPSET, "file": "model.onnx",
        "input": {"name": INPUT_NAME, "shape": ["batch", c["in_chans"], *c["img_size"]], "dtype": "float32"},
        "output": {"name": OUTPUT_NAME, "shape": ["batch", c["num_classes"]]},
        "data": d, "model": c,
    }  # fmt: skip


def export_onnx(model: VisionTransformer, directory: str | Path) -> Path:
    """Write `model.onnx` (opset `OPSET`, input `pixel_values` [batch, C, H, W] float32, normalised as
    `data_config` says; output `logits`) and `config.json`. Returns the folder."""
    _check_installed()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = model.config
    example = torch.zeros(2, c["in_chans"], *c["img_size"])  # batch 2: a batch of 1 would be specialised
    model = copy.deepcopy(model).float().cpu().eval()  # the caller's model keeps its dtype, device and mode
    torch.onnx.export(
        model, (example,), str(directory / "model.onnx"), dynamo=True, opset_version=OPSET,
        input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], dynamic_shapes=({0: "batch"},),
        external_data=False, verbose=False,
    )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(onnx_config(model), indent=2) + "\n")
    return directory
