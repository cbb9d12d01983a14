"""vitlab.train: schedule, parameter groups, the LightningModule, EMA and resume (CPU, tiny models)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from torchvision.transforms import v2

from vitlab.data.batch import denormalize, split_batch
from vitlab.interop import load_pretrained
from vitlab.models import create_model
from vitlab.train import (
    EMA,
    PerfMonitor,
    ViTClassifier,
    build_optimizer,
    build_scheduler,
    param_groups,
    resolve_warmup_steps,
    warmup_schedule,
)  # fmt: skip

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def tiny_module(num_classes: int = 4, model_args: dict | None = None, **kwargs) -> ViTClassifier:
    return ViTClassifier(model_args={**TINY, **(model_args or {})}, num_classes=num_classes, **kwargs)


def image_loader(n: int = 16, num_classes: int = 4, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(num_classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False, num_workers=0)


def make_trainer(root: Path, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=root,
    )  # fmt: skip
    return L.Trainer(**{**defaults, **kwargs})


@pytest.fixture
def deterministic(monkeypatch: pytest.MonkeyPatch):
    """`Trainer(deterministic=True)` and `seed_everything` change process-wide state; put it back."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


# ---- 1. learning-rate schedule ---------------------------------------------------------------------


def test_warmup_cosine_linear_values() -> None:
    kw = dict(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    # warm-up: 0 -> 1 linearly
    assert warmup_schedule(0, schedule="cosine", **kw) == 0.0
    assert warmup_schedule(5, schedule="cosine", **kw) == pytest.approx(0.5)
    assert warmup_schedule(10, schedule="cosine", **kw) == pytest.approx(1.0)
    # cosine: halfway through the 100 decay steps sits halfway between 1 and the floor
    assert warmup_schedule(60, schedule="cosine", **kw) == pytest.approx(0.55)
    assert warmup_schedule(35, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert warmup_schedule(110, schedule="cosine", **kw) == pytest.approx(0.1)
    assert warmup_schedule(500, schedule="cosine", **kw) == pytest.approx(0.1)
    # linear decay: a quarter of the way -> 1 - 0.9 * 0.25
    assert warmup_schedule(35, schedule="linear", **kw) == pytest.approx(0.775)
    assert warmup_schedule(110, schedule="linear", **kw) == pytest.approx(0.1)
    assert warmup_schedule(50, schedule="constant", **kw) == 1.0
    # float warm-up is a fraction of the run
    assert resolve_warmup_steps(0.1, 110) == 11
    assert resolve_warmup_steps(7, 110) == 7
    with pytest.raises(ValueError):
        resolve_warmup_steps(1.5, 110)


def test_scheduler_steps_the_optimizer_lr() -> None:
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = build_scheduler(opt, warmup_steps=4, total_steps=12, schedule="cosine", min_lr_ratio=0.0)
    lrs = []
    for _ in range(13):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1.0) and lrs[4] == pytest.approx(2.0)
    assert lrs[8] == pytest.approx(1.0)  # cosine midpoint
    assert lrs[12] == pytest.approx(0.0)
    # the factor holds no state worth restoring: the horizon always comes from the current run
    assert sched.state_dict()["lr_lambdas"] == [{}]


def test_split_batch_layouts_and_denormalize_undoes_torchvision_normalize() -> None:
    x, y = torch.rand(2, 3, 4, 4), torch.tensor([0, 1])
    for batch in ((x, y), [x, y, "path"], {"image": x, "label": y}):
        images, targets = split_batch(batch)
        assert images is x and targets is y
    images, targets = split_batch(x, targets=False)
    assert images is x and targets is None
    with pytest.raises(TypeError, match="got images only"):
        split_batch(x)
    mean, std = [0.2, 0.4, 0.6], [0.5, 0.25, 0.125]
    torch.testing.assert_close(denormalize(v2.Normalize(mean, std)(x), mean, std), x)
    # No mean/std given: vitlab's default, Inception's 0.5 / 0.5.
    torch.testing.assert_close(denormalize(v2.Normalize([0.5] * 3, [0.5] * 3)(x)), x)


# ---- 2. weight-decay groups and layer decay --------------------------------------------------------


def _group_names(groups: list[dict]) -> tuple[set[str], set[str]]:
    decay = {n for g in groups if g["weight_decay"] > 0 for n, _ in g["params"]}
    no_decay = {n for g in groups if g["weight_decay"] == 0 for n, _ in g["params"]}
    return decay, no_decay


def _is_no_decay_by_name(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    is_norm = any(part.startswith("norm") for part in name.split(".")[:-1])
    return leaf == "bias" or is_norm or name in {"pos_embed", "cls_token"} or leaf == "log_scale"


def test_weight_decay_groups_learned_pos() -> None:
    model = create_model("vit_tiny_patch16", **TINY, num_classes=5)
    decay, no_decay = _group_names(param_groups(model, weight_decay=0.05))
    names = {n for n, _ in model.named_parameters()}
    assert decay | no_decay == names and not decay & no_decay
    assert no_decay == {n for n in names if _is_no_decay_by_name(n)}
    assert {"pos_embed", "cls_token", "norm.weight", "blocks.0.norm1.weight", "head.bias"} <= no_decay
    assert {"patch_embed.proj.weight", "blocks.1.attn.qkv.weight", "head.weight"} <= decay


def test_weight_decay_groups_lsa_sincos() -> None:
    model = create_model("vit_tiny_patch16", **TINY, lsa=True, pos_embed="sincos", stem="spt")
    groups = param_groups(model, weight_decay=0.05)
    decay, no_decay = _group_names(groups)
    names = {n for n, p in model.named_parameters()}
    assert "pos_embed" not in decay | no_decay  # frozen sin-cos: in no group at all
    assert decay | no_decay == names - {"pos_embed"}
    assert no_decay == {n for n in names - {"pos_embed"} if _is_no_decay_by_name(n)}
    assert {"blocks.0.attn.log_scale", "patch_embed.norm.weight"} <= no_decay
    opt = build_optimizer(param_groups(model, 0.05, lr=1e-3), "adamw", lr=1e-3, weight_decay=0.05)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(names) - 1
    assert all(g["betas"] == (0.9, 0.999) for g in opt.param_groups)


def test_layer_decay_multipliers() -> None:
    model = create_model("vit_tiny_patch16", **TINY)  # depth 2: layers 0..3
    groups = param_groups(model, weight_decay=0.1, layer_decay=0.5, lr=1.0)
    lr_of = {n: g["lr"] for g in groups for n, _ in g["params"]}
    expected = {
        "patch_embed.proj.weight": 0.125, "cls_token": 0.125, "pos_embed": 0.125,
        "blocks.0.attn.qkv.weight": 0.25, "blocks.0.norm1.bias": 0.25,
        "blocks.1.mlp.fc2.weight": 0.5,
        "norm.weight": 1.0, "head.weight": 1.0, "head.bias": 1.0,
    }  # fmt: skip
    for name, lr in expected.items():
        assert lr_of[name] == pytest.approx(lr), name
    opt = build_optimizer(param_groups(model, 0.1, layer_decay=0.5, lr=1.0), "sgd", lr=1.0, weight_decay=0.1)
    assert all(g["momentum"] == 0.9 for g in opt.param_groups)
    assert sorted({g["lr"] for g in opt.param_groups}) == [0.125, 0.25, 0.5, 1.0]


# ---- 3. overfit a fixed batch ----------------------------------------------------------------------


def test_overfit_fixed_batch(tmp_path: Path) -> None:
    L.seed_everything(0)
    loader = image_loader(n=16, batch_size=16)
    x, y = next(iter(loader))
    module = tiny_module(lr=3e-3, weight_decay=0.0, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1)
    with torch.no_grad():
        loss0 = F.cross_entropy(module(x), y).item()
    trainer = make_trainer(tmp_path, max_steps=60, log_every_n_steps=1, callbacks=[PerfMonitor(window=5)])
    trainer.fit(module, loader)
    module.eval()
    with torch.no_grad():
        loss1 = F.cross_entropy(module(x), y).item()
    assert loss1 < 0.3 * loss0, (loss0, loss1)
    assert trainer.global_step == 60
    # the schedule ran to its end: 60 steps taken -> floor
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(3e-3 * 0.1)
    m = trainer.callback_metrics
    for key in (
        "train/loss", "train/acc1", "train/loss_epoch", "train/acc1_epoch", "lr", "perf/epoch_time_s",
        "perf/peak_mem_mb",
    ):  # fmt: skip
        assert key in m, key
    assert m["perf/peak_mem_mb"] > 0  # throughput goes to the loggers only: tests/test_tracking.py
    assert m["train/samples_seen"].item() == 16 * 60


# ---- 4. resume at an epoch boundary ----------------------------------------------------------------


class StopAfter(Callback):
    """Ends fit at an epoch boundary, as a pre-empted job would."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


def _fit(root: Path, schedule: str, max_epochs: int, callbacks=(), ckpt_path=None) -> tuple[L.Trainer, ViTClassifier]:
    L.seed_everything(0)
    warmup = 3 if schedule == "constant" else 0.25  # int steps / fraction of the run
    module = tiny_module(lr=2e-3, warmup_steps=warmup, schedule=schedule, min_lr_ratio=0.1)
    trainer = make_trainer(
        root, max_epochs=max_epochs, deterministic=True, callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )  # fmt: skip
    trainer.fit(module, image_loader(n=16, batch_size=4), ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_resume_matches_uninterrupted(tmp_path: Path, deterministic, schedule: str) -> None:
    ckpt_dir = tmp_path / "ckpt"
    # constant: the horizon does not matter, so run 2 of 2 epochs; cosine: stop 2 of 4 (pre-emption).
    first_epochs = 2 if schedule == "constant" else 4
    stop = [StopAfter(2)] if schedule == "cosine" else []
    _fit(tmp_path / "a", schedule, first_epochs, [*stop, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    last = ckpt_dir / "last.ckpt"
    assert last.is_file()

    resumed_trainer, resumed = _fit(tmp_path / "b", schedule, 4, ckpt_path=str(last))
    ref_trainer, ref = _fit(tmp_path / "c", schedule, 4)

    assert resumed_trainer.global_step == ref_trainer.global_step == 16
    lr_resumed = [g["lr"] for g in resumed_trainer.optimizers[0].param_groups]
    lr_ref = [g["lr"] for g in ref_trainer.optimizers[0].param_groups]
    assert lr_resumed == pytest.approx(lr_ref, rel=0, abs=1e-12)
    for (name, a), (_, b) in zip(resumed.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)

    ckpt = torch.load(last, weights_only=True)
    assert ckpt["vitlab"]["model_config"] == ref.model.config
    assert ckpt["vitlab"]["data_config"]["img_size"] == [32, 32]
    assert ckpt["state_dict"] and all(k.startswith("model.") for k in ckpt["state_dict"])
    assert not any("_orig_mod" in k for k in ckpt["state_dict"])
    assert ckpt["hyper_parameters"]["arch"] == "vit_tiny_patch16"


# ---- 5. EMA ----------------------------------------------------------------------------------------


class Recorder(Callback):
    """Raw weights after every step, and the weights validation ran with."""

    def __init__(self) -> None:
        self.raw: list[dict[str, torch.Tensor]] = []
        self.val: dict[str, torch.Tensor] = {}

    @staticmethod
    def _snap(module: L.LightningModule) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.raw.append(self._snap(pl_module))

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.val = self._snap(pl_module)


def test_ema_validates_and_saves_the_average(tmp_path: Path) -> None:
    L.seed_everything(0)
    decay = 0.5
    module = tiny_module(lr=5e-3, schedule="constant")
    recorder = Recorder()  # after EMA in the list: sees the EMA weights swapped in for validation
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = make_trainer(
        tmp_path, max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=True,
        callbacks=[EMA(decay=decay), recorder, ckpt_cb],
    )  # fmt: skip
    val_loader = image_loader(n=8, batch_size=8, seed=1)
    trainer.fit(module, image_loader(n=16, batch_size=8), val_loader)

    expected = {k: v.clone() for k, v in recorder.raw[0].items()}  # first update copies the weights
    for snap in recorder.raw[1:]:
        expected = {k: decay * expected[k] + (1 - decay) * snap[k] for k in expected}
    raw_last = recorder.raw[-1]
    assert any(not torch.allclose(expected[k], raw_last[k]) for k in expected)

    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert set(ckpt["state_dict"]) == set(expected)
    for k in expected:
        torch.testing.assert_close(ckpt["state_dict"][k], expected[k], rtol=0, atol=1e-6, msg=k)
        torch.testing.assert_close(recorder.val[k], expected[k], rtol=0, atol=1e-6, msg=k)
        torch.testing.assert_close(ckpt["current_model_state"][k], raw_last[k], rtol=0, atol=0, msg=k)
    assert "vitlab" in ckpt

    # the logged validation loss is the EMA model's
    x, y = next(iter(val_loader))
    probe = tiny_module()
    probe.load_state_dict(expected)
    with torch.no_grad():
        ema_loss = F.cross_entropy(probe(x), y).item()
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(ema_loss, abs=1e-5)

    exported = load_pretrained(str(tmp_path / "ckpt" / "last.ckpt"))
    for name, p in exported.state_dict().items():
        torch.testing.assert_close(p, expected[f"model.{name}"], rtol=0, atol=1e-6, msg=name)


def test_ema_resume_restores_and_continues_the_average(tmp_path: Path, deterministic) -> None:
    """Stopped after 2 of 4 epochs and resumed: the average continues from the checkpoint's EMA weights
    (d * ema + (1 - d) * raw after each later step, written out here), not from a fresh copy of the raw
    weights, and ends where the uninterrupted run's average ends."""
    decay = 0.5

    def fit(root: Path, callbacks: list, ckpt_path: str | None = None) -> ViTClassifier:
        L.seed_everything(0)
        module = tiny_module(lr=5e-3, schedule="constant")
        trainer = make_trainer(
            root, max_epochs=4, num_sanity_val_steps=0, deterministic=True, callbacks=[EMA(decay=decay), *callbacks],
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        )  # fmt: skip
        trainer.fit(module, image_loader(n=16, batch_size=4), ckpt_path=ckpt_path)
        assert trainer.global_step == (8 if any(isinstance(c, StopAfter) for c in callbacks) else 16)
        return module

    ckpt_dir = tmp_path / "ckpt"
    fit(tmp_path / "a", [StopAfter(2), ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    ckpt = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    recorder = Recorder()
    resumed = fit(tmp_path / "b", [recorder], ckpt_path=str(ckpt_dir / "last.ckpt"))
    reference = fit(tmp_path / "c", [])

    assert len(recorder.raw) == 8  # steps 9..16
    expected = {k: v.clone() for k, v in ckpt["state_dict"].items()}  # the EMA at step 8
    assert any(not torch.allclose(expected[k], ckpt["current_model_state"][k]) for k in expected)
    for snap in recorder.raw:
        expected = {k: decay * expected[k] + (1 - decay) * snap[k] for k in expected}
    final = resumed.state_dict()  # EMA copies the average into the module at the end of fit
    for k in expected:
        torch.testing.assert_close(final[k], expected[k], rtol=0, atol=1e-6, msg=k)
        torch.testing.assert_close(final[k], reference.state_dict()[k], rtol=0, atol=1e-6, msg=k)


# ---- 6. soft targets and label smoothing -----------------------------------------------------------


def test_soft_targets_and_label_smoothing(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g)
    hard = torch.tensor([0, 1, 2, 3, 4, 0])
    onehot = F.one_hot(hard, 5).float()
    soft = 0.7 * onehot + 0.3 * onehot.roll(1, dims=0)  # MixUp of the batch with itself, flipped

    def by_hand(target_probs: torch.Tensor, eps: float) -> torch.Tensor:
        q = target_probs * (1 - eps) + eps / 5
        return -(q * logits.log_softmax(dim=1)).sum(dim=1).mean()

    smoothed = tiny_module(num_classes=5, label_smoothing=0.1)
    plain = tiny_module(num_classes=5)
    torch.testing.assert_close(smoothed.loss(logits, hard), by_hand(onehot, 0.1))
    torch.testing.assert_close(smoothed.loss(logits, soft), by_hand(soft, 0.1))
    torch.testing.assert_close(plain.loss(logits, soft), by_hand(soft, 0.0))
    assert not torch.isclose(smoothed.loss(logits, hard), plain.loss(logits, hard))

    # a training run on [B, C] targets
    x = torch.randn(8, 3, 32, 32, generator=g)
    y = F.one_hot(torch.randint(5, (8,), generator=g), 5).float()
    y = 0.6 * y + 0.4 * y.roll(1, dims=0)
    trainer = make_trainer(tmp_path, max_steps=2, log_every_n_steps=1)
    trainer.fit(smoothed, DataLoader(TensorDataset(x, y), batch_size=4))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert "train/acc1" in trainer.callback_metrics


# ---- 7. micro-averaged accuracy --------------------------------------------------------------------


class LogitsAreInputs(nn.Module):
    """Stands in for the ViT: the 'images' are the logits, so predictions are chosen by hand."""

    num_classes = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_metrics_are_micro_averaged(tmp_path: Path) -> None:
    target = torch.tensor([0, 0, 0, 0, 1, 2])
    preds = torch.tensor([0, 0, 0, 0, 0, 1])  # class 0 all right; classes 1 and 2 all wrong
    logits = F.one_hot(preds, 3).float() * 5 + torch.tensor([0.0, 1.0, 0.5])  # ranks: pred, 1, 2 / pred, 2, 0
    micro, macro = 4 / 6, 1 / 3
    assert MulticlassAccuracy(3, average="macro")(logits, target).item() == pytest.approx(macro)

    module = tiny_module(num_classes=3)
    module.model = LogitsAreInputs()
    trainer = make_trainer(tmp_path)
    # batches of 4 and 2: micro over all samples is not the mean of the two batch accuracies (1.0, 0.0)
    (metrics,) = trainer.validate(module, DataLoader(TensorDataset(logits, target), batch_size=4), verbose=False)
    assert metrics["val/acc1"] == pytest.approx(micro)
    assert "val/acc5" not in metrics  # 3 classes: top-5 would always be 100%
    assert tiny_module(num_classes=10).val_acc5.top_k == 5
    assert tiny_module(num_classes=5).val_acc5 is None


# ---- the rest: compile keys, predict, hyperparameters, init_from ----------------------------------


def test_compiled_model_keeps_plain_keys() -> None:
    module = tiny_module(compile=True)
    module.configure_model()  # in-place compile; tracing is lazy, nothing runs here
    module.configure_model()
    assert all(k.startswith("model.") and "_orig_mod" not in k for k in module.state_dict())

    wrapped = tiny_module()
    wrapped.model = torch.compile(wrapped.model)  # the wrapper form names params `_orig_mod.*`
    ckpt = {"state_dict": wrapped.state_dict()}
    wrapped.on_save_checkpoint(ckpt)
    assert all(k.startswith("model.") and "_orig_mod" not in k for k in ckpt["state_dict"])
    assert ckpt["vitlab"]["model_config"]["embed_dim"] == 32
    wrapped.on_load_checkpoint(ckpt)
    wrapped.load_state_dict(ckpt["state_dict"])


def test_predict_returns_probabilities_and_plain_hparams() -> None:
    module = tiny_module(class_names=["a", "b", "c", "d"], data_config={"mean": [0.5] * 3, "crop_pct": 1.0})
    module.eval()
    probs = module.predict_step((torch.randn(3, 3, 32, 32), torch.zeros(3, dtype=torch.long)), 0)
    assert probs.shape == (3, 4) and torch.allclose(probs.sum(1), torch.ones(3))
    assert module.model.data_config["class_names"] == ["a", "b", "c", "d"]
    assert module.model.data_config["crop_pct"] == 1.0
    plain = (type(None), bool, int, float, str, list, tuple, dict)
    assert all(isinstance(v, plain) for v in module.hparams.values())
    with pytest.raises(ValueError, match="optimizer"):
        tiny_module(optimizer="adam")


def test_init_from_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    L.seed_everything(0)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    source = tiny_module(num_classes=4)
    make_trainer(tmp_path, max_steps=1, enable_checkpointing=True, callbacks=[ckpt_cb]).fit(source, image_loader())
    with caplog.at_level(logging.INFO):
        tuned = tiny_module(num_classes=6, img_size=48, init_from=str(tmp_path / "ckpt" / "last.ckpt"))
    assert "grid [4, 4] -> [6, 6]" in caplog.text and "classes 4 -> 6" in caplog.text
    assert tuned.model.patch_embed.grid_size == (6, 6)
    assert tuned.model.num_classes == 6
    assert torch.count_nonzero(tuned.model.head.weight) == 0
    torch.testing.assert_close(tuned.model.blocks[0].attn.qkv.weight, source.model.blocks[0].attn.qkv.weight)
