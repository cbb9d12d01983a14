"""No host-device synchronisation per training step in a default `vitlab fit` run on the CPU (default
callbacks: non-finite guard, last/best checkpoints, throughput, exact resume, figures), counted with
`vitlab.train.sync_count`, and the counter itself on a hand-made case."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from helpers import subset_tree
from vitlab.cli import main
from vitlab.train.sync_count import SyncsPerStep, count_syncs

TINY = {"patch_size": 8, "depth": 1, "embed_dim": 16, "num_heads": 2}
# The only per-step reads left: Lightning turns each progress-bar value (the running train/loss) into a
# Python number twice a step (`on_batch_end` and the step's logging), whether or not the step is logged.
BAR_READS_PER_STEP = 2


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
def test_default_fit_makes_no_host_sync_per_step(cifar_subset: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    data = subset_tree(cifar_subset, tmp_path / "data", ["airplane", "frog", "truck"], 16, 4)
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
    counter = '{"class_path": "vitlab.train.sync_count.SyncsPerStep", "init_args": {"skip_steps": 2}}'
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
