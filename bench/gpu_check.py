"""The prepared device run: one script that checks vitlab on a GPU machine in about six minutes.

Sections, in the order they run (each one wrapped: a failure is recorded with its error and the next
section runs; one that would not fit the --budget left is skipped and recorded so):

  environment   GPU, driver, versions, every vitlab module imported, the bf16 matmul rate measured here
  recipe        the GPU CIFAR-10 recipe through `vitlab fit`, shortened: accuracy, img/s, host syncs/step
  correctness   bf16 vs fp32 logits and compiled vs eager on the recipe's model; SIGKILL + resume
                against an uninterrupted run
  distributed   DDP through torchrun (NCCL on a GPU, gloo on CPU), one process, a few steps
  speed         bench_model.py's rows (fp32, bf16 autocast, compiled; vitlab against timm): img/s, MFU
  transfer      Tiny-ImageNet pretrain, then Imagenette fine-tune at twice the resolution (the CLI)

It prints one table and writes gpu_check.json, gpu_check.md and gpu_check_logs.tar.gz (the runs' logs
and configs) under --out (default $OUT). The exit status is 0 only when every check passed.
`--device cpu` runs the same checks at tiny sizes (the test's mode). The data comes from
scripts/pack_gpu_data.py (`make gpu-data`).

    python bench/gpu_check.py --data .gpudata --out /tmp/gpu-check            # on the GPU machine
    python bench/gpu_check.py --device cpu --data .gpudata --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import io
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
import yaml

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]
import bench_model  # noqa: E402
from common import sync, timed  # noqa: E402

import vitlab  # noqa: E402

CIFAR_RECIPE = "recipes/pretrain/cifar10_vit_gpu.yaml"
PRETRAIN_RECIPE = "recipes/pretrain/tinyimagenet_vit_gpu.yaml"
FINETUNE_RECIPE = "recipes/finetune/imagenette_128px_gpu.yaml"
SYNC_ENV = "VITLAB_SYNC_OUT"  # where sync_count.SyncsPerStep writes its counts


@dataclasses.dataclass(frozen=True)
class Profile:
    """Sizes and budgets (`--set FIELD=VALUE` changes one): the GPU run fits about six minutes on one
    H200, the CPU run is a test."""

    matmul_n: int
    bench_rows: list[tuple[str, bool]]  # (bench_model row, with torch.compile)
    compile_timm: bool  # the compiled row also compiles timm (one more compile, about a minute)
    bench_batch: int | None  # None: the row's own batch
    bench: bench_model.Settings
    compile_fit: bool  # torch.compile in the `vitlab fit` runs, as the recipes say
    compile_backend: str  # the compiled-vs-eager check's (CPU: aot_eager, to skip the C++ build)
    log_every: int | None  # None: the recipe's log_every_n_steps
    model_args: dict[str, Any]  # merged into every recipe's model_args (CPU: a tiny model)
    batch_size: int | None  # None: the recipe's
    recipe_epochs: int  # the schedule's length; the *_seconds caps stop a slower run early
    recipe_seconds: int
    pretrain_epochs: int
    pretrain_seconds: int
    finetune_epochs: int
    finetune_seconds: int
    transfer_val_every: int  # validate (and save last.ckpt) every N epochs in the transfer runs
    limit_batches: int | None  # CPU: at most this many train (and a quarter as many val) batches per epoch
    sync_steps: tuple[int, int]  # host syncs counted over these training steps [first, last)
    resume_steps: int
    resume_every: int
    ddp_steps: int
    check_images: int  # images for the bf16 / compile comparisons


GPU = Profile(
    matmul_n=8192,
    # One compiled row: compiling four candidates costs a minute or more per row.
    bench_rows=[("ti4-32", False), ("s16-224", False), ("ti4-32-bf16", False), ("s16-224-bf16", True)],
    bench_batch=None,
    compile_timm=False,
    bench=bench_model.Settings(warmup=3, repeats=3, iters=None, min_time=0.3),
    compile_fit=True,
    compile_backend="inductor",
    log_every=None,
    model_args={},
    batch_size=None,
    recipe_epochs=15,
    recipe_seconds=90,
    pretrain_epochs=40,
    pretrain_seconds=45,
    finetune_epochs=20,
    finetune_seconds=35,
    transfer_val_every=5,
    limit_batches=None,
    sync_steps=(20, 40),
    resume_steps=60,
    resume_every=20,
    ddp_steps=10,
    check_images=1000,  # the whole small CIFAR-10 subset
)
CPU = Profile(
    matmul_n=256,
    bench_rows=[("ti4-32", False)],
    bench_batch=8,
    compile_timm=False,
    bench=bench_model.Settings(warmup=2, repeats=1, iters=1, min_time=0.0),
    compile_fit=False,
    compile_backend="aot_eager",
    log_every=1,
    model_args={"embed_dim": 32, "depth": 1, "num_heads": 2},
    batch_size=16,
    recipe_epochs=1,
    recipe_seconds=120,
    pretrain_epochs=1,
    pretrain_seconds=120,
    finetune_epochs=1,
    finetune_seconds=120,
    transfer_val_every=1,
    limit_batches=12,
    sync_steps=(2, 4),
    resume_steps=6,
    resume_every=2,
    ddp_steps=2,
    check_images=32,
)


@dataclasses.dataclass
class Context:
    device: torch.device
    profile: Profile
    data: Path
    work: Path
    deadline: float
    fit_args: list[str]
    results: dict[str, Any] = dataclasses.field(default_factory=dict)  # what later sections reuse

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Row(dict):
    """One line of the table: check, value (a short text), ok (True/False/None: information only)."""

    def __init__(self, check: str, value: str, ok: bool | None = None, **numbers: Any) -> None:
        super().__init__(check=check, value=value, ok=ok, **numbers)


# ---- environment --------------------------------------------------------------------------------


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, iters: int = 10) -> float:
    """Mean rate of `iters` n x n x n products on random data, after three warm-ups."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    seconds = timed(lambda: a @ b, iters, device)
    return 2 * n**3 * iters / seconds / 1e12


def import_all_modules() -> dict[str, str]:
    """Import every vitlab module: an API this torch / torchvision / Lightning lacks fails here first.
    Returns {module: error} for those that fail."""
    import importlib
    import pkgutil

    broken = {}
    for info in pkgutil.walk_packages(vitlab.__path__, "vitlab."):
        try:
            importlib.import_module(info.name)
        except Exception as e:
            broken[info.name] = f"{type(e).__name__}: {e}"[:200]
    return broken


def section_environment(ctx: Context) -> list[Row]:
    import torchvision

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
        "lightning": L.__version__, "vitlab": vitlab.__version__, "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }  # fmt: skip
    for name in ("torchmetrics", "timm", "numpy", "jsonargparse", "webdataset", "torchdata", "datasets"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:  # a missing optional package is information, not a failure
            env[name] = f"not importable: {type(e).__name__}: {e}"[:200]
    broken = import_all_modules()
    env["wandb_imported"] = "wandb" in sys.modules  # every vitlab module is loaded now: none may need wandb
    if ctx.cuda:
        env["gpu"] = torch.cuda.get_device_name(ctx.device)
        env["driver"] = _driver()
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
    else:
        env["gpu"], env["driver"] = None, None
    peak = matmul_tflops(ctx.device, ctx.profile.matmul_n, torch.bfloat16)
    ctx.results["peak_tflops"] = peak
    ctx.results["environment"] = env
    return [
        Row("device", env["gpu"] or f"cpu ({platform.machine()}, {env['cpu_count']} cores)", True, **env),
        Row("driver", env["driver"] or "-"),
        Row("versions", f"torch {env['torch']}, torchvision {env['torchvision']}, lightning {env['lightning']}, "
                        f"torchmetrics {env['torchmetrics']}, timm {env['timm']}"),  # fmt: skip
        Row("packages", ", ".join(f"{k} {env[k]}" for k in ("jsonargparse", "webdataset", "torchdata", "datasets", "numpy"))),
        Row("vitlab modules import", "all" if not broken else "; ".join(f"{k}: {v}" for k, v in broken.items()),
            not broken, broken=broken),
        Row("peak bf16 matmul", f"{peak:.1f} TFLOP/s (n={ctx.profile.matmul_n}; every MFU below is against it)",
            peak > 0, tflops=peak),
    ]


# ---- speed: bench_model rows on this device -----------------------------------------------------


def flops_per_image(model: torch.nn.Module, img_size: int) -> float:
    """Training FLOPs (forward + backward) of one image: `vitlab.train.flops_per_image`, which counts at the
    model's own input size (`img_size`, checked)."""
    from vitlab.train import flops_per_image as count

    if tuple(model.config["img_size"]) != (img_size, img_size):
        raise ValueError(f"the model takes {model.config['img_size']} images, not {img_size}px")
    return float(count(model)["train"])


def section_speed(ctx: Context) -> list[Row]:
    peak = ctx.results.get("peak_tflops")
    rows: list[Row] = []
    results = []
    for name, compile_ in ctx.profile.bench_rows:
        if ctx.left() < (60 if compile_ else 15) * (1 if ctx.cuda else 0.1):
            rows.append(Row(f"{name}", f"skipped: {ctx.left():.0f} s of the budget left", False))
            continue
        row = bench_model.ROWS[name]
        if ctx.profile.bench_batch:
            row = dataclasses.replace(row, batch=ctx.profile.bench_batch)
        flops = flops_per_image(vitlab.create_model(row.variant, **row.overrides()), row.img_size)
        res = bench_model.run_row(row, ctx.device, ctx.profile.bench, compile_, seed=0,
                                  compile_timm=ctx.profile.compile_timm)  # fmt: skip
        res["train_flops_per_image"] = flops
        results.append(res)
        print("\n".join(bench_model.format_row(res)), flush=True)
        for cand, c in res["candidates"].items():
            ips = c["train_ips"]
            mfu = ips * flops / (peak * 1e12) if ips and peak else None
            c["train_mfu"] = mfu
            ok = c["error"] is None and bool(ips) and bool(c["infer_ips"])
            value = (f"train {bench_model._num(ips)} img/s, infer {bench_model._num(c['infer_ips'])} img/s, "
                     f"MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'}")  # fmt: skip
            if c["error"]:
                value += f"; {c['error']}"
            rows.append(Row(f"{name} {row.dtype} b{row.batch} {cand}", value, ok,
                            train_ips=ips, infer_ips=c["infer_ips"], mfu=mfu))  # fmt: skip
        for comp in res["comparisons"]:
            rows.append(Row(f"{name} {comp['vitlab']} / {comp['reference']}",
                            f"train x{bench_model._num(comp['train_ratio'], '.3f')}, "
                            f"infer x{bench_model._num(comp['infer_ratio'], '.3f')} (target {comp['target']:.2f})"
                            + ("" if comp["valid"] else ", INVALID: graph breaks"),
                            None, train_ratio=comp["train_ratio"], infer_ratio=comp["infer_ratio"]))  # fmt: skip
        # fp32 on both; on a GPU the two may pick different kernels (cuDNN convolutions run in TF32 by default).
        tol = 2e-3 if ctx.cuda else 1e-4
        rows.append(Row(f"{name} parity vitlab/timm", f"max abs logit diff {res['parity_max_abs_logit_diff']:.1e}",
                        res["parity_max_abs_logit_diff"] < tol, max_abs=res["parity_max_abs_logit_diff"]))  # fmt: skip
    ctx.results["speed"] = results
    return rows


# ---- `vitlab fit` runs --------------------------------------------------------------------------


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def max_time(seconds: int) -> str:
    """Lightning's DD:HH:MM:SS."""
    return f"00:{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def recipe_config(ctx: Context, recipe: str, name: str, trainer: dict[str, Any], compile_: bool = True) -> Path:
    """The recipe with this check's budget (and, on CPU, its tiny model and device) written beside the
    run; `compile_=False` turns the recipe's torch.compile off (runs where compile time buys nothing)."""
    cfg = yaml.safe_load((ROOT / recipe).read_text())
    p = ctx.profile
    model: dict[str, Any] = {"compile": compile_ and p.compile_fit and cfg["model"].get("compile", False)}
    if p.model_args:
        model["model_args"] = p.model_args
    over: dict[str, Any] = {"trainer": {"enable_progress_bar": False, **trainer},
                            "model": model}  # fmt: skip
    if not ctx.cuda:
        over["trainer"]["accelerator"] = "cpu"
    if p.log_every and "log_every_n_steps" not in trainer:
        over["trainer"]["log_every_n_steps"] = p.log_every
    if p.limit_batches:
        over["trainer"].setdefault("limit_train_batches", p.limit_batches)
        over["trainer"].setdefault("limit_val_batches", max(1, p.limit_batches // 4))
    cfg = deep_merge(cfg, over)
    path = ctx.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def data_args(ctx: Context, folder: str, **init_args: Any) -> list[str]:
    """`--data_path` (shards: ShardDataModule, in memory as the GPU recipes run) plus data overrides."""
    args = ["--data_path", str(ctx.data / folder), "--data.in_memory=true", "--data.auto_augment=null"]
    if ctx.profile.batch_size:
        args.append(f"--data.batch_size={ctx.profile.batch_size}")
    return args + [f"--data.{k}={v}" for k, v in init_args.items()]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(BENCH), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


@dataclasses.dataclass
class Fit:
    rc: int | None
    seconds: float
    run_dir: Path
    log: Path

    def tail(self, n: int = 1500) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-n:]

    def metrics(self) -> list[dict[str, str]]:
        path = self.run_dir / "csv" / "metrics.csv"
        if not path.exists():
            return []
        with open(path) as f:
            return list(csv.DictReader(f))

    def last(self, key: str) -> float | None:
        values = self.series(key)
        return values[-1] if values else None

    def series(self, key: str) -> list[float]:
        return [float(r[key]) for r in self.metrics() if r.get(key) not in (None, "")]

    def epochs(self) -> int:
        """Training epochs run (the CSV log's last epoch + 1): fewer than asked when max_time stopped it."""
        done = self.series("epoch")
        return int(max(done)) + 1 if done else 0

    def checkpoint(self) -> dict[str, Any] | None:
        path = self.run_dir / "checkpoints" / "last.ckpt"
        return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None

    def error(self) -> str:
        lines = [ln for ln in self.tail(4000).splitlines() if ln.strip()]
        errs = [ln for ln in lines if re.search(r"(Error|Exception|error:)", ln)]
        return (errs[-1] if errs else (lines[-1] if lines else "no output")).strip()[:300]


def vitlab_fit(
    ctx: Context,
    name: str,
    config: Path,
    args: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    torchrun: bool = False,
    kill_when: Callable[[Path], bool] | None = None,
    run_dir: Path | None = None,
) -> Fit:
    """`vitlab fit --config CONFIG ARGS` in its own process session; SIGKILLed when `kill_when(run_dir)`."""
    run_dir = run_dir or ctx.work / name
    log = ctx.work / f"{name}.log"
    launcher = [sys.executable, "-m", "vitlab.cli"]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                    "-m", "vitlab.cli"]  # fmt: skip
    cmd = [*launcher, "fit", "--config", str(config), "--run_dir", str(run_dir), *args, *ctx.fit_args]
    timeout = max(10.0, min(timeout, ctx.left() - 5))
    start = time.monotonic()
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        rc: int | None = None
        try:
            while time.monotonic() - start < timeout:
                rc = proc.poll()
                if rc is not None:
                    break
                if kill_when is not None and kill_when(run_dir):
                    os.killpg(proc.pid, signal.SIGKILL)
                    rc = proc.wait()
                    break
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            else:
                try:  # workers or ranks the run left behind: only this session's
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return Fit(rc, time.monotonic() - start, run_dir, log)


def require(fit: Fit, what: str) -> None:
    if fit.rc != 0:
        why = "timed out" if fit.rc is None else f"exit {fit.rc}"
        raise RuntimeError(f"{what} failed ({why}): {fit.error()} [log {fit.log}]")


def throughput(fit: Fit) -> float | None:
    """Median training images/s per device over the second half of the run (compile and warm-up left
    out), as PerfMonitor logs it; a run shorter than its 20-step window: images seen over the epochs'
    wall time (validation included)."""
    values = fit.series("train/device/samples_per_sec")
    values = values[len(values) // 2 :]
    if values:
        return sorted(values)[len(values) // 2]
    seen, seconds = fit.series("train/samples_seen"), sum(fit.series("perf/epoch_time_s"))
    return seen[-1] / seconds if seen and seconds else None


# ---- recipe -------------------------------------------------------------------------------------


def section_recipe(ctx: Context) -> list[Row]:
    p = ctx.profile
    config = recipe_config(ctx, CIFAR_RECIPE, "cifar10",
                           {"max_epochs": p.recipe_epochs, "max_time": max_time(p.recipe_seconds)})  # fmt: skip
    sync_out = ctx.work / "syncs.json"
    args = data_args(ctx, "cifar10/train", val_fraction=0.1) + [
        "--trainer.callbacks+=sync_count.SyncsPerStep",
        f"--trainer.callbacks.skip_steps={p.sync_steps[0]}", f"--trainer.callbacks.last_step={p.sync_steps[1]}",
    ]  # fmt: skip
    fit = vitlab_fit(ctx, "cifar10", config, args, timeout=p.recipe_seconds + 120, env=child_env(**{SYNC_ENV: str(sync_out)}))
    require(fit, "vitlab fit (CIFAR-10 GPU recipe)")
    acc, ips = fit.last("val/acc1"), throughput(fit)
    flops = fit.series("train/device/flops_per_sec")
    peak = ctx.results.get("peak_tflops")
    mfu = (sorted(flops[len(flops) // 2 :])[len(flops[len(flops) // 2 :]) // 2] / (peak * 1e12)) if flops and peak else None
    ckpt = fit.checkpoint()
    ctx.results["cifar_run"] = fit.run_dir
    rows = [
        Row("CIFAR-10 recipe", f"{fit.epochs()}/{p.recipe_epochs} epochs, {ckpt['global_step'] if ckpt else '?'} "
                               f"steps in {fit.seconds / 60:.2f} min (wall: start, data decode, compile included)", ckpt is not None,
            minutes=fit.seconds / 60, steps=ckpt and ckpt["global_step"]),  # fmt: skip
        Row("CIFAR-10 val top-1", "-" if acc is None else f"{100 * acc:.2f}%", acc is not None, acc1=acc),
        Row("CIFAR-10 train img/s", "-" if ips is None else f"{ips:.0f} img/s"
            + ("" if mfu is None else f", MFU {100 * mfu:.1f}%"), ips is not None, ips=ips, mfu=mfu),  # fmt: skip
    ]
    rows.append(sync_row(ctx, sync_out))
    return rows


def sync_row(ctx: Context, path: Path) -> Row:
    if not ctx.cuda:
        return Row("host syncs / train step", "n/a on cpu (no device to wait for)", True, syncs_per_step=0.0)
    if not path.exists():
        return Row("host syncs / train step", "not measured: the run ended before the counted steps", False)
    data = json.loads(path.read_text())
    counts = data["counts"]
    if not counts:
        return Row("host syncs / train step", "not measured: no step in the counted window", False)
    per_step = sum(counts) / len(counts)
    top = ", ".join(f"{k} x{v}" for k, v in sorted(data["where"].items(), key=lambda kv: -kv[1])[:3])
    return Row("host syncs / train step", f"{per_step:.1f} over {len(counts)} steps" + (f" ({top})" if top else ""),
               True, syncs_per_step=per_step, counts=counts, where=data["where"])  # fmt: skip


# ---- transfer -----------------------------------------------------------------------------------


def section_transfer(ctx: Context) -> list[Row]:
    p = ctx.profile
    every = {"check_val_every_n_epoch": p.transfer_val_every}
    pre_cfg = recipe_config(ctx, PRETRAIN_RECIPE, "pretrain",
                            {"max_epochs": p.pretrain_epochs, "max_time": max_time(p.pretrain_seconds), **every})
    pre = vitlab_fit(ctx, "pretrain", pre_cfg, data_args(ctx, "tinyimagenet"), timeout=p.pretrain_seconds + 120)
    require(pre, "vitlab fit (Tiny-ImageNet pretrain)")
    last = pre.run_dir / "checkpoints" / "last.ckpt"
    fine_cfg = recipe_config(ctx, FINETUNE_RECIPE, "finetune",
                             {"max_epochs": p.finetune_epochs, "max_time": max_time(p.finetune_seconds), **every})
    fine = vitlab_fit(ctx, "finetune", fine_cfg,
                      data_args(ctx, "imagenette/train", val_fraction=0.1) + ["--model.init_from", str(last)],
                      timeout=p.finetune_seconds + 120)  # fmt: skip
    require(fine, "vitlab fit (Imagenette fine-tune)")
    a, b = pre.last("val/acc1"), fine.last("val/acc1")
    pre_res = yaml.safe_load(pre_cfg.read_text())["data"]["init_args"]["img_size"]
    fine_res = yaml.safe_load(fine_cfg.read_text())["data"]["init_args"]["img_size"]
    return [
        Row(f"pretrain Tiny-ImageNet {pre_res}px", f"top-1 {'-' if a is None else f'{100 * a:.2f}%'} in "
            f"{pre.seconds / 60:.2f} min ({pre.epochs()}/{p.pretrain_epochs} epochs, {throughput(pre) or 0:.0f} img/s)",
            a is not None, acc1=a, minutes=pre.seconds / 60, ips=throughput(pre)),  # fmt: skip
        Row(f"fine-tune Imagenette {fine_res}px", f"top-1 {'-' if b is None else f'{100 * b:.2f}%'} in "
            f"{fine.seconds / 60:.2f} min ({fine.epochs()}/{p.finetune_epochs} epochs, {throughput(fine) or 0:.0f} img/s)",
            b is not None, acc1=b, minutes=fine.seconds / 60, ips=throughput(fine)),  # fmt: skip
    ]


# ---- correctness --------------------------------------------------------------------------------


def cifar_images(ctx: Context, n: int, mean: list[float], std: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `n` images of the carried CIFAR-10 subset, normalised, and their labels."""
    from PIL import Image

    images, labels = [], []
    for shard in sorted((ctx.data / "cifar10-small" / "train").glob("*.tar*")):
        with tarfile.open(shard) as tar:
            members = {m.name: m for m in tar if m.isfile()}
            for name in sorted(k for k in members if k.endswith(".jpg")):
                img = Image.open(io.BytesIO(tar.extractfile(members[name]).read())).convert("RGB")  # type: ignore[union-attr]
                images.append(torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(32, 32, 3))
                labels.append(int(tar.extractfile(members[name[:-3] + "cls"]).read()))  # type: ignore[union-attr]
                if len(images) == n:
                    break
        if len(images) == n:
            break
    x = torch.stack(images).permute(0, 3, 1, 2).float() / 255
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    return x, torch.tensor(labels)


def trained_model(ctx: Context) -> tuple[torch.nn.Module, str]:
    """The CIFAR-10 recipe's model (trained in the recipe section), else the recipe's architecture untrained."""
    run = ctx.results.get("cifar_run")
    if run is not None and (run / "checkpoints" / "last.ckpt").exists():
        return vitlab.load_pretrained(run / "checkpoints" / "last.ckpt"), "trained CIFAR-10 recipe model"
    cfg = yaml.safe_load((ROOT / CIFAR_RECIPE).read_text())["model"]
    args = {**cfg["model_args"], **ctx.profile.model_args, "img_size": 32, "num_classes": 10}
    return vitlab.create_model(cfg["arch"], **args).eval(), "untrained (the recipe run left no checkpoint)"


def section_correctness(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    data = yaml.safe_load((ROOT / CIFAR_RECIPE).read_text())["data"]["init_args"]
    x, y = cifar_images(ctx, ctx.profile.check_images, data["mean"], data["std"])
    x, y = x.to(ctx.device), y.to(ctx.device)
    model, source = trained_model(ctx)
    model = model.to(ctx.device).eval()

    # bf16 autocast against fp32: the same images, the same weights.
    with torch.inference_mode():
        ref = model(x).float()
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            low = model(x).float()
    diff = (ref - low).abs().max().item()
    rel = diff / ref.abs().max().clamp_min(1e-12).item()
    agree = (ref.argmax(1) == low.argmax(1)).float().mean().item()
    rows.append(Row("bf16 vs fp32 logits", f"max abs diff {diff:.3g} ({100 * rel:.2f}% of the largest logit), top-1 agreement "
                    f"{100 * agree:.1f}% over {len(x)} images ({source})", rel < 0.05 and agree >= 0.95,
                    max_abs=diff, rel=rel, agreement=agree))  # fmt: skip

    # torch.compile against eager, fp32: forward logits and one backward's gradients.
    # Eval mode (no dropout, no drop-path) so both compute the same function; backward works there too.
    torch._dynamo.reset()
    eager, compiled_model = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    compiled = torch.compile(compiled_model, backend=ctx.profile.compile_backend)
    xb, yb = x[:64], y[:64]
    t0 = time.monotonic()
    loss_c = F.cross_entropy(compiled(xb), yb)
    loss_c.backward()
    sync(ctx.device)
    compile_s = time.monotonic() - t0
    loss_e = F.cross_entropy(eager(xb), yb)
    loss_e.backward()
    # All gradients as one vector: a parameter whose gradient is zero in exact arithmetic (a softmax-invariant
    # bias) carries only rounding noise, which a per-tensor ratio would blow up.
    pairs = [(pc.grad, pe.grad) for pc, pe in zip(compiled_model.parameters(), eager.parameters()) if pe.grad is not None]
    grad_diff = (torch.cat([(gc - ge).flatten() for gc, ge in pairs]).norm()
                 / torch.cat([ge.flatten() for _, ge in pairs]).norm().clamp_min(1e-30)).item()  # fmt: skip
    with torch.inference_mode():
        out_c, out_e = compiled(x).float(), eager(x).float()
    fwd = (out_c - out_e).abs().max().item() / out_e.abs().max().clamp_min(1e-12).item()
    loss_d = abs(loss_c.item() - loss_e.item())
    rows.append(Row("compiled vs eager (fp32)", f"logits {100 * fwd:.3f}% of max, loss diff {loss_d:.2e}, "
                    f"gradients {100 * grad_diff:.3f}% (norm of the difference), backend "
                    f"{ctx.profile.compile_backend}, compile {compile_s:.0f} s",
                    fwd < 1e-3 and grad_diff < 1e-2 and loss_d < 1e-4,
                    logits_rel=fwd, grad_rel=grad_diff, loss_diff=loss_d, compile_s=compile_s))  # fmt: skip
    del eager, compiled_model, compiled, model
    torch._dynamo.reset()
    rows.append(resume_row(ctx))
    return rows


def resume_row(ctx: Context) -> Row:
    """A run SIGKILLed right after its first periodic save and resumed from last.ckpt, against the
    same run uninterrupted: same step count, weights and last loss within tolerance."""
    p = ctx.profile
    # No validation: last.ckpt is then written only every `resume_every` steps, so the kill lands mid-epoch.
    config = recipe_config(ctx, CIFAR_RECIPE, "resume", {"max_steps": p.resume_steps, "max_epochs": 1000,
                                                         "log_every_n_steps": 1, "num_sanity_val_steps": 0,
                                                         "check_val_every_n_epoch": 100000},
                           compile_=False)  # fmt: skip
    args = data_args(ctx, "cifar10-small/train", val_fraction=0.1) + [f"--checkpoint_every_n_steps={p.resume_every}"]
    ref = vitlab_fit(ctx, "resume-ref", config, args, timeout=120)
    require(ref, "uninterrupted run")
    run = ctx.work / "resume-run"
    last = run / "checkpoints" / "last.ckpt"  # written atomically: once it exists, it is whole
    killed = vitlab_fit(ctx, "resume-killed", config, args, timeout=120, kill_when=lambda _: last.exists(), run_dir=run)
    if killed.rc != -signal.SIGKILL:
        raise RuntimeError(f"the run was not killed at its first periodic save (rc {killed.rc}): {killed.error()}")
    step_killed = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    resumed = vitlab_fit(ctx, "resume-resumed", config, args + ["--ckpt_path", "last"], timeout=120, run_dir=run)
    require(resumed, "resumed run")
    a, b = ref.checkpoint(), resumed.checkpoint()
    assert a is not None and b is not None
    num = sum(((a["state_dict"][k].float() - b["state_dict"][k].float()) ** 2).sum() for k in a["state_dict"])
    den = sum((a["state_dict"][k].float() ** 2).sum() for k in a["state_dict"])
    rel = math.sqrt(float(num) / max(float(den), 1e-30))
    max_abs = max((a["state_dict"][k].float() - b["state_dict"][k].float()).abs().max().item() for k in a["state_dict"])
    la, lb = ref.last("train/loss"), resumed.last("train/loss")
    loss_d = abs(la - lb) if la is not None and lb is not None else None
    same_steps = a["global_step"] == b["global_step"] == p.resume_steps
    # A restart from scratch would also end equal: the resumed process must have loaded last.ckpt and
    # logged no step before the kill.
    restored = "Restored all states from the checkpoint" in resumed.log.read_text(errors="replace")
    first_step = min(resumed.series("step"), default=-1)
    continued = restored and first_step >= step_killed
    # Bit-equal on CPU (deterministic kernels); on a GPU atomics in backward leave rounding noise.
    tol = 1e-6 if not ctx.cuda else 5e-3
    ok = continued and same_steps and rel <= tol and loss_d is not None and loss_d <= max(10 * tol, 1e-5)
    return Row("SIGKILL + resume vs uninterrupted",
               f"killed at step {step_killed}/{p.resume_steps}, resumed from it ({'yes' if continued else 'NO'}, "
               f"first logged step {first_step:.0f}); weights rel diff {rel:.2e} (max {max_abs:.2e}), "
               f"last loss diff {'-' if loss_d is None else f'{loss_d:.2e}'}, steps {a['global_step']}/{b['global_step']}",
               ok, killed_at=step_killed, resumed_from_checkpoint=continued, weights_rel=rel, weights_max_abs=max_abs, loss_diff=loss_d)  # fmt: skip


# ---- distributed --------------------------------------------------------------------------------


def section_distributed(ctx: Context) -> list[Row]:
    p = ctx.profile
    config = recipe_config(ctx, CIFAR_RECIPE, "ddp", {"max_steps": p.ddp_steps, "max_epochs": 1000,
                                                      "strategy": "ddp", "devices": 1, "limit_val_batches": 2,
                                                      "num_sanity_val_steps": 0, "log_every_n_steps": 1},
                           compile_=False)  # process-group setup and collectives are the point, not speed  # fmt: skip
    fit = vitlab_fit(ctx, "ddp", config, data_args(ctx, "cifar10-small/train", val_fraction=0.1), timeout=150,
                     torchrun=True)  # fmt: skip
    require(fit, "torchrun vitlab fit (DDP)")
    log = fit.log.read_text(errors="replace")
    backend = re.search(r"distributed_backend=(\w+)", log)
    member = re.search(r"MEMBER: (\d+)/(\d+)", log)
    ckpt = fit.checkpoint()
    want = "nccl" if ctx.cuda else "gloo"
    got = backend.group(1) if backend else None
    ok = got == want and member is not None and ckpt is not None and ckpt["global_step"] == p.ddp_steps
    return [Row("DDP via torchrun, 1 process", f"backend {got}, world {member.group(2) if member else '?'}, "
                f"{ckpt['global_step'] if ckpt else '?'}/{p.ddp_steps} steps, last loss "
                f"{fit.last('train/loss') or float('nan'):.3f} in {fit.seconds:.0f} s", ok,
                backend=got, steps=ckpt and ckpt["global_step"], seconds=fit.seconds)]  # fmt: skip


# ---- report -------------------------------------------------------------------------------------

def section_feed(ctx: Context) -> list[Row]:
    """The 224px data feed (bench/gpu_feed.py, which imports this module's Context and Row)."""
    from gpu_feed import section_feed as feed

    return feed(ctx)


SECTIONS: list[tuple[str, Callable[[Context], list[Row]], float]] = [
    # (name, function, seconds it needs at least on a GPU: skipped, and recorded so, when less is left).
    # Sections never measured on a device go first (feed, transfer), so a short lease measures them;
    # the correctness checks reuse the recipe's model. Two `vitlab fit` runs make the transfer, each with
    # its start, in-memory decode and compile: a 170 s try on an H200 did not finish, so it asks for 240 s
    # (`--sections environment,transfer --budget 300` runs it alone).
    ("environment", section_environment, 5),
    ("feed", section_feed, 90),
    ("transfer", section_transfer, 240),
    ("recipe", section_recipe, 60),
    ("correctness", section_correctness, 45),
    ("distributed", section_distributed, 20),
    ("speed", section_speed, 30),
]


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def markdown(report: dict[str, Any]) -> str:
    env = report["sections"].get("environment", {}).get("rows", [])
    head = env[0]["value"] if env else report["device"]
    lines = [f"# vitlab gpu-check: {head}", "",
             f"{report['passed']}/{report['checks']} checks passed, {report['failed']} failed, "
             f"in {report['minutes']:.2f} min ({report['mode']} mode)", "",
             "| section | check | value | ok |", "| --- | --- | --- | --- |"]  # fmt: skip
    for name, sec in report["sections"].items():
        for row in sec["rows"]:
            mark = {True: "ok", False: "FAIL", None: ""}[row["ok"]]
            lines.append(f"| {name} | {_cell(row['check'])} | {_cell(row['value'])} | {mark} |")
        lines.append(f"| {name} | section | {sec['status']} in {sec['seconds']:.0f} s"
                     + (f": {_cell(sec['error'])}" if sec.get("error") else "") + " | "
                     + ("ok" if sec["status"] == "pass" else "FAIL") + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def run_sections(ctx: Context, only: list[str] | None, write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Each section in turn, its failure recorded; the report is rewritten after each one, so that a
    run stopped from outside still leaves the sections it finished."""
    sections: dict[str, Any] = {}
    scale = 1.0 if ctx.cuda else 0.1
    for name, fn, needs in SECTIONS:
        if only and name not in only:
            continue
        start = time.monotonic()
        print(f"== {name} ({ctx.left():.0f} s of the budget left)", flush=True)
        if ctx.left() < needs * scale:
            sections[name] = {"status": "skip", "seconds": 0.0, "rows": [],
                              "error": f"skipped: {ctx.left():.0f} s of the budget left, the section needs {needs} s"}
            write(sections)
            continue
        try:
            rows = fn(ctx)
            bad = [r["check"] for r in rows if r["ok"] is False]
            sections[name] = {"status": "fail" if bad else "pass", "rows": rows,
                              "error": f"failed: {', '.join(bad)}" if bad else None}  # fmt: skip
        except Exception as e:
            traceback.print_exc()
            sections[name] = {"status": "fail", "rows": [], "error": f"{type(e).__name__}: {e}"[:600]}
        sections[name]["seconds"] = time.monotonic() - start
        if ctx.cuda:
            torch.cuda.empty_cache()
        write(sections)
    return sections


def write_report(ctx: Context, sections: dict[str, Any], out: Path, start: float) -> dict[str, Any]:
    rows = [r for s in sections.values() for r in s["rows"]]
    checks = [r for r in rows if r["ok"] is not None]
    report = {
        "mode": "gpu" if ctx.cuda else "cpu",
        "device": str(ctx.device),
        "profile": dataclasses.asdict(ctx.profile),
        "minutes": (time.monotonic() - start) / 60,
        "checks": len(checks),
        "passed": sum(bool(r["ok"]) for r in checks),
        "failed": sum(r["ok"] is False for r in checks) + sum(s["status"] != "pass" and not s["rows"]
                                                             for s in sections.values()),
        "all_passed": bool(sections) and all(s["status"] == "pass" for s in sections.values()),
        "sections": sections,
        "speed_rows": ctx.results.get("speed"),
        "work": str(ctx.work),
    }  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    # The runs' own logs, for a failure the table's one line does not explain (the device returns a few files).
    with tarfile.open(out / "gpu_check_logs.tar.gz", "w:gz") as tar:
        for log in sorted(ctx.work.glob("*.log")) + sorted(ctx.work.glob("*.yaml")):
            tar.add(log, arcname=log.name)
    return report


def with_overrides(profile: Profile, pairs: list[str]) -> Profile:
    """`--set recipe_epochs=20`: a scalar field of the profile, parsed as its current value's type."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        field, _, value = pair.partition("=")
        current = getattr(profile, field, None)
        if current is None or isinstance(current, (list, dict, tuple, bench_model.Settings)) or not value:
            scalars = [f.name for f in dataclasses.fields(profile) if isinstance(getattr(profile, f.name), (int, str))]
            raise SystemExit(f"--set {pair}: give FIELD=VALUE with FIELD one of {', '.join(scalars)}")
        changes[field] = (value.lower() in ("1", "true", "yes")) if isinstance(current, bool) else type(current)(value)
    return dataclasses.replace(profile, **changes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="cuda: the full-size checks; cpu: the same checks at tiny sizes (auto: cuda when present)")
    p.add_argument("--data", type=Path, default=ROOT / ".gpudata", help="scripts/pack_gpu_data.py's folder")
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="where gpu_check.json and gpu_check.md go (default: $OUT)")  # fmt: skip
    p.add_argument("--work", type=Path, default=None, help="run folders and logs (default: a temporary folder)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check: a section that would not fit is skipped and recorded so "
                        "(default: 450 on a GPU, inside the device's 10-minute command limit; 1800 on the CPU)")
    p.add_argument("--sections", default=None, help=f"comma-separated subset of: {', '.join(n for n, _, _ in SECTIONS)}")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a size or budget of the profile, e.g. --set recipe_epochs=20 (see Profile)")
    p.add_argument("--fit-args", default="", help="extra flags for every `vitlab fit` (one string, split on spaces)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is None:
        raise SystemExit("give --out DIR (or set OUT=DIR): where the report goes")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")  # fmt: skip
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device; use --device cpu for the small run")
    if not (args.data / "cifar10" / "train").is_dir():
        raise SystemExit(f"no data in {args.data}; make it with `make gpu-data` (scripts/pack_gpu_data.py)")
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="vitlab-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    only = [s.strip() for s in args.sections.split(",")] if args.sections else None
    start = time.monotonic()
    ctx = Context(device, with_overrides(GPU if device.type == "cuda" else CPU, args.set), args.data.resolve(), work.resolve(),
                  start + (args.budget or (450.0 if device.type == "cuda" else 1800.0)), args.fit_args.split())  # fmt: skip
    sections = run_sections(ctx, only, lambda secs: write_report(ctx, secs, args.out, start))
    report = write_report(ctx, sections, args.out, start)
    print(markdown(report))
    print(f"wrote gpu_check.json, gpu_check.md and gpu_check_logs.tar.gz under {args.out}")
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
