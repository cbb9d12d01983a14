"""Mixed and half precision on the CPU with gradient clipping: every objective through the real command
line under bf16-mixed and bf16-true (pretrain, fine-tune from it at a new resolution with a new head,
masked patch prediction, distillation), and a check, independent of Lightning, that clipping bounds the
gradient norm the optimizer applies under bf16-mixed, bf16-true, 32-true and fp16 with a GradScaler."""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torchvision
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from cli_probe import csv_rows
from helpers import image_tree
from vitlab.cli import main
from vitlab.train import ViTClassifier
from vitlab.train.run import defaults as run_defaults

pytestmark = pytest.mark.slow

TINY = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}
CPU = ["--trainer.accelerator=cpu", "--loggers=[csv]", "--trainer.gradient_clip_val=1.0"]
MOVED: dict[str, dict[str, bool]] = {}  # run folder -> {trainable tensor name: changed during fit}


class RecordMoved(Callback):
    """Which trainable tensors a fit changed (compared in float32: bf16-true weights are bf16)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = {n: p.detach().float().clone() for n, p in pl_module.named_parameters() if p.requires_grad}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = dict(pl_module.named_parameters())
        MOVED[self.key] = {n: not torch.equal(now[n].detach().float(), v) for n, v in self.start.items()}


def _recipe(path: Path, root: Path, img_size: int, model: dict[str, Any]) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_steps": 3, "log_every_n_steps": 1, "limit_val_batches": 2, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "model": model,
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(root), "img_size": img_size, "batch_size": 4, "num_workers": 0,
                               "train_crop": "pad", "auto_augment": None}},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(tmp_path: Path, name: str, data: Path, img_size: int, model: dict[str, Any], precision: str,
         *extra: str) -> Path:  # fmt: skip
    run = tmp_path / name
    config = _recipe(tmp_path / f"{name}.yaml", data, img_size, model)
    moved = f'{{"class_path": "test_precision.RecordMoved", "init_args": {{"key": "{run}"}}}}'
    args = ["fit", "--config", str(config), "--run_dir", str(run), f"--trainer.precision={precision}", *CPU,
            f"--trainer.callbacks+={moved}", *extra]  # fmt: skip
    assert main(args) == 0
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["precision"] == precision
    losses = _losses(run)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), (name, losses)
    moved_names = {n for n, m in MOVED[str(run)].items() if m}
    # The weight matrices move in both modes (in bf16-true an update below a weight's bf16 spacing is lost,
    # e.g. a norm weight of 1.0 under lr 1e-3, so not every tensor need move there).
    for n in ("model.blocks.0.attn.qkv.weight", "model.blocks.1.mlp.fc1.weight"):
        assert n in moved_names, (name, n, sorted(moved_names))
    return run


def _losses(run: Path) -> list[float]:
    return [float(r["train/loss"]) for r in csv_rows(run) if r.get("train/loss")]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_pretrain_finetune_mpp_and_distill_with_clipping(
    tmp_path: Path, precision: str
) -> None:
    """Each objective through the real CLI with gradient clipping: supervised pretraining, fine-tuning from
    it with a new head at a new resolution, masked patch prediction, and DeiT distillation."""
    pre_data = image_tree(tmp_path / "pre_data", ["airplane", "frog", "truck"], 8, 4)
    ft_data = image_tree(tmp_path / "ft_data", ["cat", "dog"], 8, 4)
    vit = {"arch": "vit_tiny_patch16", "model_args": TINY, "lr": 1e-3}

    pre = _fit(tmp_path, "pre", pre_data, 32, vit, precision)
    ft = _fit(tmp_path, "ft", ft_data, 48, vit, precision, "--model.init_from", str(pre / "checkpoints" / "last.ckpt"))
    tuned = torch.load(ft / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert tuned["model.head.weight"].shape == (2, 32)  # the new head...
    assert "model.head.weight" in {n for n, m in MOVED[str(ft)].items() if m}  # ...trained from its zero init
    assert tuned["model.pos_embed"].shape == (1, 1 + 6 * 6, 32)  # 4x4 grid at 32 px -> 6x6 at 48 px
    # mixed precision keeps float32 weights; bf16-true trains (and saves) bf16 ones
    assert tuned["model.head.weight"].dtype == (torch.float32 if precision == "bf16-mixed" else torch.bfloat16)

    mpp = {"class_path": "vitlab.train.MaskedPatchPretraining",
           "init_args": {"arch": "vit_tiny_patch16", "model_args": TINY, "lr": 1e-3}}  # fmt: skip
    _fit(tmp_path, "mpp", pre_data, 32, mpp, precision)

    teacher = tmp_path / "teacher.pth"
    torch.save(torchvision.models.get_model("resnet18", weights=None, num_classes=2).state_dict(), teacher)
    distill = {"class_path": "vitlab.train.objectives.distill.DistillClassifier",
               "init_args": {"arch": "vit_tiny_patch16", "model_args": {**TINY, "distilled": True}, "lr": 1e-3,
                             "teacher": str(teacher), "teacher_arch": "resnet18"}}  # fmt: skip
    run = _fit(tmp_path, "distill", ft_data, 32, distill, precision)
    assert all(math.isfinite(float(r["train/loss_distill"])) for r in csv_rows(run) if r.get("train/loss_distill"))


# ---- gradient clipping under mixed precision -----------------------------------------------------------


class NormAtStep(Callback):
    """Records, for every optimizer step, the total 2-norm of the gradients the optimizer reads when its
    update starts (after Lightning's closure: backward, hooks, unscaling, clipping), computed here in
    float64 from `p.grad`, independently of Lightning and vitlab; and the norm before clipping."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.before_clip: list[float] = []

    @staticmethod
    def _norm(optimizer: torch.optim.Optimizer) -> float:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        scale = getattr(optimizer, "grad_scale", None)  # a GradScaler hands a fused optimizer scaled grads
        return norm / float(scale) if scale is not None else norm

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        step = optimizer.step

        @functools.wraps(step)  # keeps the LR scheduler's mark on the wrapped step
        def recording_step(closure: Any = None, **kwargs: Any) -> Any:
            if closure is None:  # a GradScaler ran the closure and unscaled already
                self.seen.append(self._norm(optimizer))
                return step(**kwargs)

            def closure_then_record() -> Any:
                out = closure()
                self.seen.append(self._norm(optimizer))
                return out

            return step(closure=closure_then_record, **kwargs)

        optimizer.step = recording_step

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.before_clip.append(self._norm(optimizer))


CLIP = 0.05  # well below a fresh tiny ViT's gradient norm (~1), so every step clips


def _fp16_gradscaler_on_cpu() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu")  # the flag alone: Lightning maps 16-mixed on the CPU to bf16-mixed


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize(
    "precision", ["bf16-mixed", "bf16-true", "32-true", "16-mixed-gradscaler-plugin-on-cpu"]
)  # fmt: skip
def test_clipping_bounds_the_norm_the_optimizer_sees(tmp_path: Path, precision: str, optimizer: str) -> None:
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(24, 3, 32, 32, generator=g), torch.randint(4, (24,), generator=g)),
                      batch_size=8)  # fmt: skip
    module = ViTClassifier(model_args={**TINY, "img_size": 32}, num_classes=4, optimizer=optimizer, lr=1e-2)
    before = {k: v.detach().clone().float() for k, v in module.state_dict().items()}
    probe = NormAtStep()
    scaler = precision.startswith("16-mixed")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=[probe],
        **({"plugins": [_fp16_gradscaler_on_cpu()]} if scaler else {"precision": precision}),
    )  # fmt: skip
    trainer.fit(module, data)

    opt = trainer.optimizers[0]
    # fused kernels wherever the gradients are the true ones; foreach where a GradScaler must unscale first
    assert bool(opt.defaults.get("fused")) is not scaler and bool(opt.defaults.get("foreach")) is scaler
    # a GradScaler skips a step whose fp16 gradients overflow (its initial scale is 2**16)
    assert trainer.global_step == 3 and (len(probe.seen) == 3 or scaler and len(probe.seen) == 2), probe.seen
    assert all(n > 2 * CLIP for n in probe.before_clip), probe.before_clip  # clipping had work to do
    tol = 1e-2 if precision == "bf16-true" else 1e-4  # bf16 gradients: 8-bit mantissa
    for n in probe.seen:
        assert CLIP * (1 - tol) < n <= CLIP * (1 + tol), probe.seen  # clipped to the bound, not below
    after = module.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not torch.equal(after["model.blocks.0.attn.qkv.weight"].float(), before["model.blocks.0.attn.qkv.weight"])


# ---- CPUs without native bf16 --------------------------------------------------------------------------


def test_bf16_capability_follows_the_cpu_flags() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from (not Linux)")
    flags = set(cpuinfo.read_text().split())
    assert run_defaults.cpu_has_fast_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)


def test_bf16_falls_back_to_32_true_on_a_cpu_without_it(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(run_defaults, "cpu_has_fast_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        assert run_defaults.cpu_precision("bf16-mixed") == "32-true"
        assert run_defaults.cpu_precision("32-true") == "32-true" and run_defaults.cpu_precision(None) is None
    assert len(caplog.records) == 1 and "no avx512_bf16 or AMX" in caplog.records[0].getMessage()
    assert run_defaults.cpu_precision("bf16-mixed", accelerator="cuda") == "bf16-mixed"  # not a CPU run
    monkeypatch.setattr(run_defaults, "cpu_has_fast_bf16", lambda: True)
    assert run_defaults.cpu_precision("bf16-true") == "bf16-true"


# ---- CPU bf16 attention -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [17, 65, 197])  # below and above vit.CPU_BF16_MATH_MAX_TOKENS
@pytest.mark.parametrize("lsa", [False, True])
def test_cpu_bf16_attention_matches_the_formula(tokens: int, lsa: bool) -> None:
    """Under bf16 autocast (short sequences take torch's math kernel on the CPU, long ones the fused one) the
    attention output and its input gradient match softmax(q k^T / sqrt(d)) v written out in float64."""
    from vitlab.models.vit import Attention

    torch.manual_seed(0)
    attn = Attention(dim=64, num_heads=4, lsa=lsa).eval()
    x = torch.randn(3, tokens, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attn(x)
    (grad,) = torch.autograd.grad(out.float().pow(2).sum(), x)

    x64 = x.detach().double().requires_grad_(True)
    q, k, v = attn.qkv.double()(x64).reshape(3, tokens, 3, 4, 16).permute(2, 0, 3, 1, 4)
    scale = attn.log_scale.double().exp() if lsa else 16**-0.5
    logits = (q * scale) @ k.transpose(-2, -1)
    if lsa:  # locality self-attention: a token does not attend to itself
        logits = logits.masked_fill(torch.eye(tokens, dtype=torch.bool), float("-inf"))
    ref = attn.proj.double()((logits.softmax(-1) @ v).transpose(1, 2).reshape(3, tokens, 64))
    (ref_grad,) = torch.autograd.grad(ref.pow(2).sum(), x64)
    attn.float()
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= 0.02 * ref.abs().max()  # bf16: an 8-bit mantissa
    assert (grad.double() - ref_grad).norm() <= 0.03 * ref_grad.norm()
