"""vitlab's ViT against timm's: same configuration, same weights, same process, interleaved.

For each row: train-step images/s (forward, cross-entropy backward, AdamW step), inference images/s
(eval, `torch.inference_mode`), the vitlab/timm ratios, and the peak memory of one step. Modes: both
eager; vitlab under `torch.compile` against timm eager and timm compiled. See bench/README.md.

    python bench/bench_model.py --quick --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

# The tree this script sits in is the one measured, installed or not.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import MiB, PeakMemory, environment, median, resolve_device, spread, timed  # noqa: E402

import vitlab  # noqa: E402

TARGET_EAGER = 1.00
TARGET_FASTEST = 1.05


@dataclass(frozen=True)
class Row:
    name: str
    variant: str  # vitlab name
    timm_name: str
    img_size: int
    patch_size: int
    num_classes: int
    batch: int
    dtype: str  # "fp32" or "bf16" (autocast)
    gpu_only: bool = False

    def overrides(self) -> dict[str, Any]:
        return dict(img_size=self.img_size, patch_size=self.patch_size, num_classes=self.num_classes)


ROWS: dict[str, Row] = {
    r.name: r
    for r in [
        Row("ti4-32", "vit_tiny_patch16", "vit_tiny_patch16_224", 32, 4, 10, 128, "fp32"),
        Row("s16-224", "vit_small_patch16", "vit_small_patch16_224", 224, 16, 1000, 32, "fp32"),
        Row("ti4-32-bf16", "vit_tiny_patch16", "vit_tiny_patch16_224", 32, 4, 10, 1024, "bf16", gpu_only=True),
        Row("s16-224-bf16", "vit_small_patch16", "vit_small_patch16_224", 224, 16, 1000, 256, "bf16", gpu_only=True),
    ]
}


@dataclass
class Candidate:
    name: str  # "vitlab", "timm", "vitlab+compile", "timm+compile"
    model: nn.Module  # owns the parameters
    fn: Callable[[torch.Tensor], torch.Tensor]  # the model, or its compiled wrapper
    opt: torch.optim.Optimizer
    train_ips: list[float] = field(default_factory=list)
    infer_ips: list[float] = field(default_factory=list)
    train_peak: int | None = None
    infer_peak: int | None = None
    peak_method: str | None = None
    error: str | None = None

    def summary(self, batch: int) -> dict[str, Any]:
        return {
            "train_ips": median(self.train_ips),
            "infer_ips": median(self.infer_ips),
            "train_ips_repeats": self.train_ips,
            "infer_ips_repeats": self.infer_ips,
            "train_spread": spread(self.train_ips),
            "infer_spread": spread(self.infer_ips),
            "train_peak_mib": None if self.train_peak is None else self.train_peak / MiB,
            "infer_peak_mib": None if self.infer_peak is None else self.infer_peak / MiB,
            "peak_method": self.peak_method,
            "error": self.error,
        }


@dataclass
class Settings:
    warmup: int
    repeats: int
    iters: int | None  # None: calibrate so one repeat lasts about min_time
    min_time: float


# ---- steps ------------------------------------------------------------------------------------


def autocast_for(row: Row, device: torch.device) -> Callable[[], ContextManager[Any]]:
    if row.dtype == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def make_steps(
    c: Candidate, x: torch.Tensor, y: torch.Tensor, autocast: Callable[[], ContextManager[Any]]
) -> tuple[Callable[[], None], Callable[[], None]]:
    def train() -> None:
        with autocast():
            loss = F.cross_entropy(c.fn(x), y)
        loss.backward()
        c.opt.step()
        c.opt.zero_grad(set_to_none=True)

    def infer() -> None:
        with torch.inference_mode(), autocast():
            c.fn(x)

    return train, infer


def run_phase(
    cands: list[Candidate],
    phase: str,
    steps: dict[str, tuple[Callable[[], None], Callable[[], None]]],
    batch: int,
    s: Settings,
    device: torch.device,
) -> int:
    """Warm up every candidate, then time them round-robin; returns the iterations per repeat."""
    idx = 0 if phase == "train" else 1
    step_time: dict[str, float] = {}
    for c in list(cands):
        c.model.train(phase == "train")
        step = steps[c.name][idx]
        try:
            # The first call compiles and (train) creates AdamW state: neither belongs in a timing.
            times = [timed(step, 1, device) for _ in range(s.warmup - 1)]
            with PeakMemory(device) as pm:  # a steady-state step
                times.append(timed(step, 1, device))
        except Exception as e:  # a compile failure must not take the eager rows down with it
            c.error = f"{phase}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            traceback.print_exc(file=sys.stderr)
            cands.remove(c)
            continue
        step_time[c.name] = min(times[1:])
        c.peak_method = pm.method
        if phase == "train":
            c.train_peak = pm.peak
        else:
            c.infer_peak = pm.peak
    iters = s.iters or max(1, math.ceil(s.min_time / max(max(step_time.values(), default=1.0), 1e-6)))
    gc.collect()
    for r in range(s.repeats):
        # Rotate the order each repeat so that every candidate takes every slot and drift is shared.
        for c in cands[r % len(cands) :] + cands[: r % len(cands)]:
            seconds = timed(steps[c.name][idx], iters, device)
            (c.train_ips if phase == "train" else c.infer_ips).append(batch * iters / seconds)
    return iters


# ---- one row ----------------------------------------------------------------------------------


def graph_breaks(model: nn.Module, x: torch.Tensor, autocast: Callable[[], ContextManager[Any]]) -> dict[str, Any]:
    """`torch._dynamo.explain` in train mode and in eval/inference mode (each run resets dynamo)."""
    out: dict[str, Any] = {}
    was_training = model.training
    try:
        for mode in ("train", "eval"):
            model.train(mode == "train")
            ctx = torch.inference_mode() if mode == "eval" else contextlib.nullcontext()
            with ctx, autocast():
                ex = torch._dynamo.explain(model)(x)
            out[mode] = ex.graph_break_count
            out[f"{mode}_reasons"] = [str(getattr(r, "reason", r)) for r in ex.break_reasons]
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    return out


def run_row(
    row: Row, device: torch.device, s: Settings, compile_: bool, seed: int, compile_timm: bool = True
) -> dict[str, Any]:
    """One row: vitlab and timm eager, and with `compile_` torch.compile(vitlab) (and, with
    `compile_timm`, torch.compile(timm): each compiled candidate costs a compile of its own)."""
    import timm

    if compile_:
        torch._dynamo.reset()  # earlier rows' cache entries would count against the recompile limit
    torch.manual_seed(seed)
    ref = timm.create_model(row.timm_name, **row.overrides())
    ours = vitlab.create_model(row.variant, **row.overrides())
    ours.load_state_dict(ref.state_dict())  # same weights, strictly
    ref.to(device)
    ours.to(device)
    x = torch.randn(row.batch, 3, row.img_size, row.img_size, device=device)
    y = torch.randint(0, row.num_classes, (row.batch,), device=device)
    autocast = autocast_for(row, device)

    with torch.inference_mode():  # confirms the two models are the same function
        ref.eval()
        ours.eval()
        parity = (ref(x[:8]).float() - ours(x[:8]).float()).abs().max().item()

    breaks: dict[str, Any] = {}
    models: list[tuple[str, nn.Module, bool]] = [("vitlab", ours, False), ("timm", ref, False)]
    if compile_:
        breaks = graph_breaks(ours, x, autocast)
        # Own copies for the compiled candidates: separate parameters and optimizer state.
        models.append(("vitlab+compile", copy.deepcopy(ours), True))
        if compile_timm:
            models.append(("timm+compile", copy.deepcopy(ref), True))

    cands: list[Candidate] = []
    for name, model, comp in models:
        # A small learning rate keeps the fixed batch from driving weights to denormals or NaN.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.05)
        cands.append(Candidate(name, model, torch.compile(model) if comp else model, opt))
    all_cands = list(cands)
    steps = {c.name: make_steps(c, x, y, autocast) for c in cands}

    train_iters = run_phase(cands, "train", steps, row.batch, s, device)
    infer_iters = run_phase(cands, "infer", steps, row.batch, s, device) if cands else 0

    n_breaks = None
    if compile_:
        counts = [breaks.get("train"), breaks.get("eval")]
        n_breaks = None if None in counts else max(counts)
    result = {
        "row": row.name,
        "model": row.variant,
        "timm_model": row.timm_name,
        "img_size": row.img_size,
        "patch_size": row.patch_size,
        "batch": row.batch,
        "dtype": row.dtype,
        "parity_max_abs_logit_diff": parity,
        "graph_breaks": breaks or None,
        # The compiled rows count only when explain saw one whole graph in both modes.
        "compile_valid": None if not compile_ else n_breaks == 0,
        "iters_per_repeat": {"train": train_iters, "infer": infer_iters},
        "repeats": s.repeats,
        "warmup": s.warmup,
        "candidates": {c.name: c.summary(row.batch) for c in all_cands},
    }
    result["comparisons"] = comparisons(result)
    del cands, all_cands, steps, models, ours, ref
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def comparisons(res: dict[str, Any]) -> list[dict[str, Any]]:
    pairs = [("vitlab", "timm", TARGET_EAGER)]
    if res["compile_valid"] is not None:
        pairs.append(("vitlab+compile", "timm", TARGET_FASTEST))
        if "timm+compile" in res["candidates"]:
            pairs.append(("vitlab+compile", "timm+compile", TARGET_FASTEST))
    out = []
    for ours, ref, target in pairs:
        a, b = res["candidates"][ours], res["candidates"][ref]
        comp: dict[str, Any] = {"vitlab": ours, "reference": ref, "target": target}
        for phase in ("train", "infer"):
            va, vb = a[f"{phase}_ips"], b[f"{phase}_ips"]
            comp[f"{phase}_ratio"] = va / vb if va and vb else None
        comp["valid"] = res["compile_valid"] is not False if ours.endswith("+compile") else True
        comp["error"] = a["error"] or b["error"]
        out.append(comp)
    return out


# ---- output -----------------------------------------------------------------------------------

HEADER = (
    f"{'row':<13}{'prec':<5}{'batch':>6}  {'vitlab':<15}{'vs':<13}"
    f"{'train img/s vitlab/ref':>24}{'ratio':>7} {'target':<12}"
    f"{'infer img/s vitlab/ref':>24}{'ratio':>7} {'target':<12}"
    f"{'peak MiB train v/r':>20}{'infer v/r':>14}{'spread':>8}"
)


def _num(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _verdict(ratio: float | None, target: float, valid: bool) -> str:
    if not valid:
        return "INVALID"
    if ratio is None:
        return "-"
    return f">={target:.2f} {'ok' if ratio >= target else 'MISS'}"


def format_row(res: dict[str, Any]) -> list[str]:
    lines = []
    gb = res["graph_breaks"]
    info = (
        f"# {res['row']}: {res['model']} vs {res['timm_model']}, {res['img_size']}px patch {res['patch_size']}, "
        f"max|logit diff| {res['parity_max_abs_logit_diff']:.1e}, "
        f"iters/repeat train {res['iters_per_repeat']['train']} infer {res['iters_per_repeat']['infer']}, "
        f"{res['repeats']} repeats after {res['warmup']} warm-up"
    )
    if gb is not None:
        if "error" in gb:
            info += f"; dynamo explain failed: {gb['error']}"
        else:
            info += f"; vitlab graph breaks train {gb['train']} eval {gb['eval']}"
    lines.append(info)
    cands = res["candidates"]
    for comp in res["comparisons"]:
        a, b = cands[comp["vitlab"]], cands[comp["reference"]]
        mode = "eager" if comp["vitlab"] == "vitlab" else "compile"
        ref = "timm eager" if comp["reference"] == "timm" else "timm compile"
        cells = []
        for phase in ("train", "infer"):
            ips = f"{_num(a[f'{phase}_ips'])} / {_num(b[f'{phase}_ips'])}"
            ratio = comp[f"{phase}_ratio"]
            cells.append(f"{ips:>24}{_num(ratio, '.3f'):>7} {_verdict(ratio, comp['target'], comp['valid']):<12}")
        mib = lambda k: f"{_num(a[k], '.0f')}/{_num(b[k], '.0f')}"  # noqa: E731
        # The worst (max - min) / median among the four timings behind this line: ratios closer to 1
        # than this are noise.
        spreads = [c[f"{p}_spread"] for c in (a, b) for p in ("train", "infer") if c[f"{p}_spread"] is not None]
        worst = f"{100 * max(spreads):.0f}%" if spreads else "-"
        lines.append(
            f"{res['row']:<13}{res['dtype']:<5}{res['batch']:>6}  {mode:<15}{ref:<13}"
            + "".join(cells)
            + f"{mib('train_peak_mib'):>20}{mib('infer_peak_mib'):>14}{worst:>8}"
        )
        if comp["error"]:
            lines.append(f"  ! {comp['error']}")
    if gb and gb.get("train", 0) + gb.get("eval", 0) > 0:
        reasons = sorted({r.splitlines()[0] for r in gb.get("train_reasons", []) + gb.get("eval_reasons", [])})
        lines.append(f"  ! compiled rows INVALID: graph breaks in vitlab: {'; '.join(reasons)[:400]}")
    return lines


# ---- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 warm-up steps, 2 repeats of 1 step")
    p.add_argument("--rows", default=None, help=f"comma-separated, from: {', '.join(ROWS)} (default: all the device runs)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:N")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also time torch.compile(vitlab) against timm eager and timm compiled")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per candidate and phase (>= 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per candidate and phase (median reported)")
    p.add_argument("--iters", type=int, default=None, help="steps per repeat (default: calibrated to --min-time)")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds one timed repeat should last at least")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.rows:
        names = [n.strip() for n in args.rows.split(",") if n.strip()]
        unknown = [n for n in names if n not in ROWS]
        if unknown:
            raise SystemExit(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
        rows = [ROWS[n] for n in names]
    else:
        rows = [r for r in ROWS.values() if device.type == "cuda" or not r.gpu_only]
    settings = Settings(
        warmup=max(2, args.warmup or (2 if args.quick else 3)),
        repeats=max(1, args.repeats or (2 if args.quick else 5)),
        iters=args.iters or (1 if args.quick else None),
        min_time=args.min_time,
    )

    env = environment(device)
    print(
        f"vitlab {vitlab.__version__} | torch {env['torch']} | timm {env['timm']} | device {device}"
        + (f" ({env['device_name']})" if "device_name" in env else f" ({env['cpu']}, {env['cpu_count']} cores)")
        + f" | threads {env['threads']}" + (f" (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})" if env["OMP_NUM_THREADS"] else "")
        + (" | quick" if args.quick else "")
    )  # fmt: skip
    print(f"targets: vitlab/timm >= {TARGET_EAGER:.2f} eager, >= {TARGET_FASTEST:.2f} for torch.compile(vitlab)")
    print(HEADER)
    results = []
    for row in rows:
        res = run_row(row, device, settings, args.compile, args.seed)
        results.append(res)
        print("\n".join(format_row(res)), flush=True)

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "environment": env,
            "settings": vars(settings) | {"quick": args.quick, "compile": args.compile, "seed": args.seed},
            "targets": {"eager": TARGET_EAGER, "fastest": TARGET_FASTEST},
            "rows": results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
