"""Exact resume beyond one process without workers: a run killed mid-epoch (SIGKILL, right after a
periodic save) and resumed with `--ckpt_path last` ends with the very weights of an uninterrupted run,

- with 2 DataLoader workers, whose random streams (random crops, flips) must continue mid-epoch;
- with 2 DDP ranks (and a worker each), each rank resuming its own loader position and streams.

Equal means bit-equal: same data order, same augmentation, same arithmetic (deterministic CPU
kernels, gloo sums two ranks in a fixed order). Tiny ViT, 3 generated classes x 12 images, the real CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_probe import kill_session
from helpers import image_tree

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
CLASSES = ["airplane", "cat", "ship"]
STEPS_PER_EPOCH = 5  # 36 images, global batch 8 (the last batch 4; under DDP 18 per rank, 4 per device)
EPOCHS = 2
SAVE_EVERY = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_tree(tmp_path_factory.mktemp("resume") / "data", CLASSES, 12, 4)


def write_config(path: Path, root: Path, num_workers: int) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "max_epochs": EPOCHS, "deterministic": True, "enable_progress_bar": False,
            "enable_model_summary": False, "log_every_n_steps": 1, "num_sanity_val_steps": 0,
            "callbacks": [{"class_path": "vitlab.train.reliability.last_checkpoint.LastCheckpoint",
                           "init_args": {"every_n_train_steps": SAVE_EVERY}}],
        },
        "model": {"arch": "vit_tiny_patch16", "lr": 1e-3, "warmup_steps": 0,
                  "model_args": {"embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8}},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(root), "img_size": 32, "batch_size": 8, "num_workers": num_workers,
                               "train_crop": "pad", "hflip": True, "auto_augment": "trivialaugment"}},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return path


def start(config: Path, run: Path, devices: int, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vitlab.cli", "fit", "--config", str(config), "--run_dir", str(run),
           f"--trainer.devices={devices}", *(["--trainer.strategy=ddp"] if devices > 1 else []), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=run.parent,
                                start_new_session=True)  # fmt: skip


def end(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        kill_session(proc)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("devices", [1, 2], ids=["workers", "ddp"])
def test_mid_epoch_kill_and_resume_equals_an_uninterrupted_run(data: Path, tmp_path: Path, devices: int) -> None:
    num_workers = 2 if devices == 1 else 1
    config = write_config(tmp_path / "config.yaml", data, num_workers)
    log = tmp_path / "log.txt"
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()

    ref_run = tmp_path / "ref" / "run"
    assert end(start(config, ref_run, devices, log), timeout=400) == 0, log.read_text()[-4000:]
    reference = load(ref_run / "checkpoints" / "last.ckpt")
    assert reference["global_step"] == EPOCHS * STEPS_PER_EPOCH

    # Killed (the whole job, SIGKILL) as soon as the first periodic save is on disk: mid-epoch 0.
    run = tmp_path / "run" / "run"
    last = run / "checkpoints" / "last.ckpt"
    proc = start(config, run, devices, log)
    deadline = time.monotonic() + 300
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    kill_session(proc)  # SIGKILL, the whole job
    end(proc, timeout=60)
    assert last.exists(), log.read_text()[-4000:]
    step = load(last)["global_step"]
    assert 0 < step < STEPS_PER_EPOCH, step  # mid-epoch: the loader position and worker streams matter

    assert end(start(config, run, devices, log, "--ckpt_path", "last"), timeout=400) == 0, log.read_text()[-4000:]
    resumed = load(last)
    assert resumed["global_step"] == reference["global_step"]
    for k, v in reference["state_dict"].items():
        assert torch.equal(resumed["state_dict"][k], v), k
