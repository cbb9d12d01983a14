"""No host-device synchronisation per training step in a default `vitlab fit` run on the CPU (default
callbacks: non-finite guard, last/best checkpoints, throughput, exact resume, figures), counted with
bench/sync_count.py; the counter itself on a hand-made case; and the non-finite guard when it
reads its device-side check only every N steps."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from helpers import image_tree
from vitlab.cli import main
from vitlab.train import ViTClassifier
from vitlab.train.reliability.guards import NonFiniteGuard, NonFiniteLossError
from vitlab.train.objectives.classifier import FiniteMean

TINY = {"patch_size": 8, "depth": 1, "embed_dim": 16, "num_heads": 2}
# The only per-step reads left: Lightning turns each progress-bar value (the running train/loss) into a
# Python number twice a step (`on_batch_end` and the step's logging), whether or not the step is logged.
BAR_READS_PER_STEP = 2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the counter serves tests and gpu_check
from sync_count import SyncsPerStep, count_syncs  # noqa: E402


def test_counter_counts_value_reads_on_the_cpu() -> None:
    x = torch.ones(3)
    with count_syncs("cpu") as syncs:
        x.sum().item()
        bool(x.sum() > 0)
        float(x[0])
        x.tolist()
        y = x * 2  # no read
    assert syncs.total == 4 and y.sum().item() == 6.0  # the read after the block is not counted
    assert all(site.startswith(__file__) for site in syncs.sites), syncs.sites


@pytest.mark.slow
def test_default_fit_makes_no_host_sync_per_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    data = image_tree(tmp_path / "data", ["airplane", "frog", "truck"], 16, 4)
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 10, "log_every_n_steps": 1000},
        "model": {"arch": "vit_tiny_patch16", "model_args": TINY},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(data), "img_size": 32, "batch_size": 4, "num_workers": 0}},
    }  # fmt: skip
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(cfg))
    seen: list[SyncsPerStep] = []
    monkeypatch.setattr(SyncsPerStep, "on_fit_end", lambda self, *_: seen.append(self), raising=False)
    counter = '{"class_path": "sync_count.SyncsPerStep", "init_args": {"skip_steps": 2}}'
    args = ["fit", "--config", str(tmp_path / "fit.yaml"), "--run_dir", str(tmp_path / "run"), "--loggers=[csv]",
            f"--trainer.callbacks+={counter}"]  # fmt: skip
    assert main(args) == 0
    (probe,) = seen
    assert probe.steps == 8  # steps 2..9 (12 batches an epoch: no epoch end inside the window)
    bar = {site: n for site, n in probe.count.sites.items() if site.endswith("apply_func.py:134 to_item")}
    others = {site: n for site, n in probe.count.sites.items() if site not in bar}
    assert not others, others  # the guard, the checkpoints, the metrics and the throughput read nothing
    assert probe.per_step <= BAR_READS_PER_STEP, probe.count.sites

    # and without a progress bar (batch jobs), nothing at all
    seen.clear()
    assert main([*args[:4], str(tmp_path / "run2"), *args[5:], "--trainer.enable_progress_bar=false"]) == 0
    assert seen[0].steps == 8 and seen[0].count.total == 0, seen[0].count.sites


# ---- the non-finite guard, checked on the device and read every N steps -------------------------------


class Poison(Callback):
    """A NaN loss (or, with `grads`, one infinite gradient and a finite loss) at the given global steps;
    records the model's weights before each bad step and before the step after it."""

    def __init__(self, steps: set[int], grads: bool = False) -> None:
        self.steps, self.grads = steps, grads
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        if trainer.global_step in self.steps:
            self.before[trainer.global_step] = weights
        if trainer.global_step - 1 in self.steps:
            self.after[trainer.global_step - 1] = weights

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step in self.steps and not self.grads:
            loss.data.fill_(float("nan"))

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step in self.steps and self.grads:
            next(pl_module.parameters()).grad.view(-1)[0] = float("inf")


def _setup(
    tmp_path: Path, optimizer: str, callbacks: list[Callback], max_steps: int
) -> tuple[L.Trainer, ViTClassifier, DataLoader]:
    """A CPU trainer, a tiny classifier and 6 batches of random images."""
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(48, 3, 32, 32, generator=g), torch.randint(4, (48,), generator=g)),
                      batch_size=8)  # fmt: skip
    module = ViTClassifier(model_args={**TINY, "img_size": 32}, num_classes=4, optimizer=optimizer, lr=1e-2)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=max_steps, log_every_n_steps=1000, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks,
    )  # fmt: skip
    return trainer, module, data


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_deferred_stop_names_the_first_bad_step_and_no_later_step_is_applied(tmp_path: Path, optimizer: str) -> None:
    poison = Poison({2})
    probe = SyncsPerStep(skip_steps=0)
    guard = NonFiniteGuard(action="stop", check_every_n_steps=5)  # looks before steps 4 and 9
    trainer, module, data = _setup(tmp_path, optimizer, [poison, guard, probe], 20)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at global step 2 \(epoch 0, batch 2\)"):
        trainer.fit(module, data)
    assert trainer.global_step == 4  # raised at the look before step 4: steps 2 and 3 were skipped on the device
    now = module.model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in poison.before[2].items())
    assert trainer.optimizers[0].state_dict()["state"][0].get("step", torch.tensor(2.0)).item() == 2.0
    # one read at the first step of fused SGD (its momentum buffers), then the looks only
    assert probe.count.total == (2 if optimizer == "sgd" else 1), probe.count.sites


def test_deferred_skip_leaves_the_bad_steps_out_and_counts_them(tmp_path: Path) -> None:
    poison = Poison({1, 3}, grads=True)
    guard = NonFiniteGuard(action="skip", max_skips=2, check_every_n_steps=3)
    trainer, module, data = _setup(tmp_path, "adamw", [poison, guard], 6)
    trainer.fit(module, data)
    for step in (1, 3):  # the weights after each bad step are the weights before it
        assert all(torch.equal(poison.after[step][k], v) for k, v in poison.before[step].items()), step
    assert guard.skipped == 2 and trainer.global_step == 6
    assert trainer.optimizers[0].state_dict()["state"][0]["step"].item() == 4.0  # AdamW took 4 of the 6 steps


def test_finite_mean_weights_finite_values_and_reads_nothing() -> None:
    mean = FiniteMean()
    with count_syncs("cpu") as syncs:
        for value, weight in ((1.0, 2), (float("nan"), 5), (3.0, 1), (float("inf"), 4)):
            mean.update(torch.tensor(value), weight)
    assert syncs.total == 0
    assert mean.compute().item() == pytest.approx((1.0 * 2 + 3.0 * 1) / 3)  # NaN and Inf left out
