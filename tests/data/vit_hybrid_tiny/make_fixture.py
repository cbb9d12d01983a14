"""Writes tests/data/vit_hybrid_tiny/: a tiny random transformers ViTHybridForImageClassification
(transformers 4.44.2; the class is gone from transformers 5) and its logits on a fixed input.

Run with transformers 4.44.2 importable: `python tests/data/vit_hybrid_tiny/make_fixture.py tests/data/vit_hybrid_tiny`.
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import ViTHybridConfig, ViTHybridForImageClassification

out = Path(sys.argv[1])
torch.manual_seed(0)
config = ViTHybridConfig(
    backbone_config=dict(model_type="bit", layer_type="bottleneck", depths=[1], out_features=["stage1"],
                         embedding_size=32, hidden_sizes=[128], embedding_dynamic_padding=True,
                         global_padding="same"),
    backbone_featmap_shape=[1, 128, 8, 8], hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=64, image_size=32, patch_size=1, num_labels=3,
    id2label={0: "cat", 1: "dog", 2: "bird"}, label2id={"cat": 0, "dog": 1, "bird": 2},
)
model = ViTHybridForImageClassification(config)
with torch.no_grad():  # non-zero norms, biases and head: a wrong mapping cannot hide behind them
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
model.eval()
model.save_pretrained(out, safe_serialization=True)
x = torch.randn(2, 3, 32, 32)
with torch.no_grad():
    logits = model(pixel_values=x).logits
save_file({"pixel_values": x, "logits": logits}, str(out / "expected.safetensors"))
print(logits)
