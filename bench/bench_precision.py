"""Training speed of the CPU recipes' model under 32-true and bf16-mixed, in one process, interleaved.

For each recipe's model (the pretraining recipe at 32 px, the fine-tune recipe at 72 px, with their batch
size): training images/s of the module's own step (forward, loss, backward, clipping at the recipe's
norm, fused AdamW step) in float32 and under bf16 autocast, eager and (with --compile) with the model
compiled, and the bf16/fp32 ratio. Random images: the data path is timed elsewhere (bench_data.py).
bf16 is fast only on CPUs with avx512_bf16 or AMX (`vitlab.train.run.defaults.cpu_has_fast_bf16`).

    python bench/bench_precision.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]  # the tree this script sits in is the one measured
from common import environment  # noqa: E402

from vitlab.train import ViTClassifier  # noqa: E402
from vitlab.train.objectives.optim import build_optimizer, param_groups  # noqa: E402
from vitlab.train.run.defaults import cpu_has_fast_bf16  # noqa: E402

RECIPES = {  # recipe, number of classes of its data
    "pretrain_tinyimagenet_32px": ("recipes/pretrain/tinyimagenet_vit_cpu.yaml", 200),
    "finetune_imagenette_72px": ("recipes/finetune/imagenette_72px_cpu.yaml", 10),
}


def build(recipe: str, num_classes: int, batch: int | None, compile_: bool) -> tuple[Any, ...]:
    cfg = yaml.safe_load((REPO / recipe).read_text())
    keep = ("arch", "model_args", "optimizer", "lr", "weight_decay")
    model_args = {k: v for k, v in cfg["model"].items() if k in keep}
    data = cfg["data"]["init_args"]
    module = ViTClassifier(**model_args, num_classes=num_classes, img_size=data["img_size"])
    if compile_:
        module.model.compile()
    module.train()
    hp = module.hparams
    groups = param_groups(module.model, hp.weight_decay, lr=hp.lr)
    optimizer = build_optimizer(groups, hp.optimizer, lr=hp.lr, weight_decay=hp.weight_decay)
    b = batch or data["batch_size"]
    x = torch.randn(b, 3, data["img_size"], data["img_size"])
    y = torch.randint(num_classes, (b,))
    return module, optimizer, x, y, float(cfg["trainer"].get("gradient_clip_val") or 0.0)


def train_step(module: ViTClassifier, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               clip: float, bf16: bool) -> None:  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        loss, _, _ = module.compute_loss(x, y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(name: str, args: argparse.Namespace, compile_: bool) -> dict[str, Any]:
    recipe, classes = RECIPES[name]
    torch.manual_seed(0)
    module, optimizer, x, y, clip = build(recipe, classes, args.batch, compile_)
    modes = {"32-true": False, "bf16-mixed": True}
    start = time.perf_counter()
    for bf16 in modes.values():  # warm-up (and compilation) of both modes
        for _ in range(args.warmup):
            train_step(module, optimizer, x, y, clip, bf16)
    warmup_s = time.perf_counter() - start
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):  # interleaved, so load changes hit both modes alike
        for mode, bf16 in modes.items():
            t = time.perf_counter()
            for _ in range(args.iters):
                train_step(module, optimizer, x, y, clip, bf16)
            rates[mode].append(args.iters * x.shape[0] / (time.perf_counter() - t))
    med = {m: statistics.median(r) for m, r in rates.items()}
    return {
        "row": name, "compiled": compile_, "batch": x.shape[0], "img_size": x.shape[-1], "warmup_s": round(warmup_s, 1),
        "img_per_s": {m: round(v, 1) for m, v in med.items()},
        "spread": {m: round((max(r) - min(r)) / statistics.median(r), 3) for m, r in rates.items()},
        "bf16_over_fp32": round(med["bf16-mixed"] / med["32-true"], 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(RECIPES), help=f"comma-separated, from: {', '.join(RECIPES)}")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the recipe's)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=3, help="steps per timed repeat")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="also time the model under torch.compile (slow to compile on a small CPU)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(torch.device("cpu"))
    print(f"CPU bf16 fast path (avx512_bf16 / AMX): {cpu_has_fast_bf16()}; threads {torch.get_num_threads()}")
    results = []
    for name in args.rows.split(","):
        for compile_ in (False, True) if args.compile else (False,):
            res = measure(name, args, compile_)
            results.append(res)
            ips = res["img_per_s"]
            print(f"{name:28s} {'compiled' if compile_ else 'eager':8s} batch {res['batch']:4d}  "
                  f"32-true {ips['32-true']:8.1f} img/s  bf16-mixed {ips['bf16-mixed']:8.1f} img/s  "
                  f"bf16/fp32 {res['bf16_over_fp32']:.2f}x  (spread {res['spread']}, "
                  f"warm-up {res['warmup_s']} s)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
