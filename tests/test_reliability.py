"""Reliability: runs survive kills and signals, bad steps never reach the weights, a bad run folder fails
early, checkpoints load safely, and no credential lands in a run's files.

Training runs go through the real CLI: as a subprocess wherever a signal or a kill is involved, in-process
(`vitlab.cli.main`) elsewhere. Tiny ViT, 3 generated classes x 20 images, CPU, num_workers=0.

The subprocesses import this module (PYTHONPATH=tests/) for a checkpoint writer that pauses halfway through
each write, so a kill lands mid-write.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from vitlab.data import ImageFolderDataModule
from vitlab.train.reliability.checkpoint_io import AtomicCheckpointIO, CheckpointLoadError, is_temp_checkpoint
from vitlab.train.reliability.guards import NonFiniteLossError
from vitlab.train.reliability.lightning_internals import TESTED_LIGHTNING, check_lightning_version
from vitlab.train.reliability.redaction import REDACTED, redact, secret_values
from vitlab.train.reliability.run_dir import RunDirError

TESTS = Path(__file__).resolve().parent
MODEL = {
    "arch": "vit_tiny_patch16",
    "model_args": {"embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8},
    "lr": 1e-3,
}
EPOCHS = 3
STEPS_PER_EPOCH = 8  # 60 train images, batch 8 (last batch 4)
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH
SAVE_EVERY = 2
SLOW_SAVE_ENV = "VITLAB_TEST_SLOW_SAVE"
SECRET = "secret123-wandb-Zq8v7TmLk2"


# ---- helpers the CLI subprocesses import -------------------------------------------------------------


class SlowAtomicIO(AtomicCheckpointIO):
    """Writes half of each checkpoint, pauses `$VITLAB_TEST_SLOW_SAVE` seconds, writes the rest."""

    def _write(self, checkpoint: dict[str, Any], f: Any) -> None:
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        time.sleep(float(os.environ.get(SLOW_SAVE_ENV, "0")))
        f.write(data[len(data) // 2 :])


# ---- fixtures and plumbing ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes: 20 train and 6 val generated 32x32 images each (what is tested holds for any pixels)."""
    from helpers import image_tree

    return image_tree(tmp_path_factory.mktemp("tiny_data"), ["airplane", "automobile", "bird"], 20, 6)


def write_config(
    path: Path, data_root: Path, *, epochs: int = EPOCHS, callbacks: list | None = None,
    plugins: str | None = None, deterministic: bool = True,
) -> Path:
    trainer: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "max_epochs": epochs, "deterministic": deterministic,
        "enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 1,
        "callbacks": callbacks if callbacks is not None else [
            {"class_path": "vitlab.train.reliability.last_checkpoint.LastCheckpoint",
             "init_args": {"every_n_train_steps": SAVE_EVERY}}
        ],
    }  # fmt: skip
    if plugins:
        trainer["plugins"] = plugins
    data_class = "vitlab.data.ImageFolderDataModule"
    config = {
        "seed_everything": 0,
        "trainer": trainer,
        "model": MODEL,
        "data": {
            "class_path": data_class,
            "init_args": {"root": str(data_root), "img_size": 32, "batch_size": 8, "num_workers": 0},
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "HF_TOKEN")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")])))
    env.update(extra)
    return env


def fit_cmd(config: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vitlab.cli", "fit", "--config", str(config), "--run_dir", str(run_dir), *extra]


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


Reference = namedtuple("Reference", "config ckpt")


@pytest.fixture(scope="module")
def reference(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """One uninterrupted run: the final last.ckpt every interrupted-and-resumed run must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    config = write_config(tmp / "config.yaml", tiny_data, plugins="test_reliability.SlowAtomicIO")
    run = tmp / "run"
    proc = subprocess.run(fit_cmd(config, run), env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = load(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == TOTAL_STEPS
    return Reference(config, ckpt)


# ---- 1. SIGKILL at random points, resume ---------------------------------------------------------------


def _kill_on_temp_file(proc: subprocess.Popen, ckpt_dir: Path, nth: int) -> Path | None:
    """SIGKILL as soon as the `nth` temporary checkpoint file of this process appears (mid-write)."""
    seen: set[str] = set(os.listdir(ckpt_dir)) if ckpt_dir.is_dir() else set()
    new = 0
    while proc.poll() is None:
        if ckpt_dir.is_dir():
            for name in os.listdir(ckpt_dir):
                if is_temp_checkpoint(name) and name not in seen:
                    seen.add(name)
                    new += 1
                    if new >= nth:
                        kill(proc)
                        return ckpt_dir / name
        time.sleep(0.002)
    return None


def _kill_after_a_save(proc: subprocess.Popen, last: Path, delay: float) -> None:
    """SIGKILL `delay` seconds after last.ckpt next changes: anywhere inside the following steps."""
    before = last.stat().st_mtime_ns if last.exists() else None
    while proc.poll() is None:
        if last.exists() and last.stat().st_mtime_ns != before:
            time.sleep(delay)
            break
        time.sleep(0.002)
    kill(proc)


def _assert_last_loadable(last: Path) -> int:
    """last.ckpt, when there is one, is a complete checkpoint; returns its global step (-1 when absent)."""
    if not last.exists():
        return -1
    ckpt = load(last)
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    return ckpt["global_step"]


def test_sigkill_never_tears_last_ckpt_and_resume_is_exact(reference: Reference, tmp_path: Path) -> None:
    rng = random.Random(20240611)
    run, log = tmp_path / "run", tmp_path / "log.txt"
    ckpt_dir, last = run / "checkpoints", run / "checkpoints" / "last.ckpt"
    env = cli_env(**{SLOW_SAVE_ENV: "0.15"})
    steps = []

    # (a) mid-write: the moment the n-th temporary checkpoint file appears.
    proc = start(fit_cmd(reference.config, run), env, log)
    torn = _kill_on_temp_file(proc, ckpt_dir, nth=rng.randint(2, 4))
    assert torn is not None, "the run finished before the kill; " + log.read_text()[-2000:]
    if torn.exists():  # the half-written file must never be what a resume picks up
        with pytest.raises(Exception):
            load(torn)
    steps.append(_assert_last_loadable(last))

    # (b) at a random moment inside the steps after a save (mid-step, or mid-write again).
    proc = start(fit_cmd(reference.config, run, "--ckpt_path", "last"), env, log)
    _kill_after_a_save(proc, last, delay=rng.uniform(0.0, 0.4))
    steps.append(_assert_last_loadable(last))

    # (c) early: during start-up or the first resumed steps.
    proc = start(fit_cmd(reference.config, run, "--ckpt_path", "last"), env, log)
    time.sleep(rng.uniform(0.5, 3.0))
    kill(proc)
    steps.append(_assert_last_loadable(last))

    assert steps[0] >= SAVE_EVERY and steps[-1] < TOTAL_STEPS, (steps, log.read_text()[-3000:])
    assert steps == sorted(steps), steps  # a resume never goes backwards

    # Run to the end from whatever last.ckpt holds now.
    proc = subprocess.run(
        fit_cmd(reference.config, run, "--ckpt_path", "last"), env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_same_weights(load(last), reference.ckpt)
    # the next start cleared the partial files the kills left behind
    assert not [p for p in os.listdir(ckpt_dir) if is_temp_checkpoint(p)]


def test_atomic_io_keeps_the_old_file_when_a_write_fails(tmp_path: Path) -> None:
    class FailingIO(AtomicCheckpointIO):
        def _write(self, checkpoint: dict[str, Any], f: Any) -> None:
            f.write(b"partial")
            raise OSError(28, "No space left on device")

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    with pytest.raises(OSError, match="No space"):
        FailingIO().save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, path)
    assert load(path)["global_step"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no stray temporary file
    io_ = AtomicCheckpointIO()
    assert io_.load_checkpoint(path)["global_step"] == 1
    with pytest.raises(ValueError, match="weights_only=True"):
        io_.load_checkpoint(path, weights_only=False)
    (tmp_path / "torn.ckpt").write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointLoadError, match="torn.ckpt"):
        io_.load_checkpoint(tmp_path / "torn.ckpt")


def test_datamodule_train_loader_is_stateful(tiny_data: Path) -> None:
    """Exact mid-epoch resume needs a train loader with state_dict/load_state_dict."""
    dm = ImageFolderDataModule(root=str(tiny_data), img_size=32, batch_size=8, num_workers=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"), "train loader must be stateful"
    batches = [y.tolist() for _, y in loader]
    loader2 = dm.train_dataloader()
    it = iter(loader2)
    next(it), next(it)
    state = loader2.state_dict()
    loader3 = dm.train_dataloader()
    loader3.load_state_dict(state)
    assert [y.tolist() for _, y in loader3] == batches[2:]


# ---- 2. SIGTERM / SIGUSR1 ------------------------------------------------------------------------------


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_signal_saves_last_ckpt_and_exits_cleanly(reference: Reference, tmp_path: Path, signame: str) -> None:
    run, log = tmp_path / "run", tmp_path / "log.txt"
    last = run / "checkpoints" / "last.ckpt"
    env = cli_env(**{SLOW_SAVE_ENV: "0.05"})
    proc = start(fit_cmd(reference.config, run), env, log)
    deadline = time.monotonic() + 120
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the signal; " + log.read_text()[-2000:]
    first = load(last)["global_step"]
    proc.send_signal(getattr(signal, signame))
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]  # Lightning exits through SystemExit()
    saved = load(last)["global_step"]
    assert first <= saved < TOTAL_STEPS
    assert "resume with --ckpt_path last" in log.read_text()
    # and the saved state continues exactly
    done = subprocess.run(
        fit_cmd(reference.config, run, "--ckpt_path", "last"), env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_same_weights(load(last), reference.ckpt)


# ---- 3. non-finite loss --------------------------------------------------------------------------------


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch):
    """Process-wide state an in-process CLI run changes (seed env var, deterministic algorithms)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def _poison(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> dict[str, Any]:
    """Make the loss NaN at the given global steps; record the weights around each bad step."""
    from vitlab.train import ViTClassifier

    record: dict[str, Any] = {"before": {}, "after": {}, "module": None}
    original = getattr(ViTClassifier.training_step, "unpoisoned", ViTClassifier.training_step)

    def training_step(self: ViTClassifier, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        record["module"] = self
        if step - 1 in steps:
            record["after"][step - 1] = weights
        loss = original(self, batch, batch_idx)
        if step in steps:
            record["before"][step] = weights
            loss = loss * float("nan")
        return loss

    training_step.unpoisoned = original  # type: ignore[attr-defined]
    monkeypatch.setattr(ViTClassifier, "training_step", training_step)
    return record


def _nan_config(tmp_path: Path, data: Path, guard: dict | None) -> Path:
    last = {"class_path": "vitlab.train.reliability.last_checkpoint.LastCheckpoint", "init_args": {"every_n_train_steps": 2}}
    callbacks: list = [last]
    if guard is not None:
        callbacks.append({"class_path": "vitlab.train.reliability.guards.NonFiniteGuard", "init_args": guard})
    return write_config(tmp_path / "config.yaml", data, epochs=1, callbacks=callbacks,
                        deterministic=False)  # fmt: skip


def test_nan_loss_stops_with_step_lr_and_checkpoint(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_process: None
) -> None:
    from vitlab.cli import main

    record = _poison(monkeypatch, {5})
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    with pytest.raises(NonFiniteLossError) as err:
        main(["fit", "--config", str(_nan_config(tmp_path, tiny_data, None)), "--run_dir", str(run)])
    msg = str(err.value)
    lr = max(g["lr"] for g in record["module"].trainer.optimizers[0].param_groups)
    assert "loss is nan at global step 5" in msg and f"learning rate {lr:.6g}" in msg
    assert str(last) in msg
    # the bad step was not applied...
    now = record["module"].model.state_dict()
    for k, v in record["before"][5].items():
        assert torch.equal(now[k], v), k
    # ...and last.ckpt still holds the last good state
    ckpt = load(last)
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())


def test_nan_loss_skip_mode(tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_process: None) -> None:
    from vitlab.cli import main

    guard = {"action": "skip", "max_skips": 2}
    record = _poison(monkeypatch, {2, 5})
    run = tmp_path / "run"
    main(["fit", "--config", str(_nan_config(tmp_path, tiny_data, guard)), "--run_dir", str(run)])
    for step in (2, 5):  # the weights after each bad step are the weights before it
        for k, v in record["before"][step].items():
            assert torch.equal(record["after"][step][k], v), (step, k)
    ckpt = load(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == STEPS_PER_EPOCH
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert ckpt["callbacks"]["NonFiniteGuard"]["skipped"] == 2

    # one bad step more than allowed stops the run
    _poison(monkeypatch, {1, 3, 6})
    with pytest.raises(NonFiniteLossError, match=r"global step 6 .*after skipping 2 step\(s\) \(max_skips=2\)"):
        main(["fit", "--config", str(_nan_config(tmp_path, tiny_data, guard)), "--run_dir", str(tmp_path / "run2")])


# ---- 4. run folder and disk space ----------------------------------------------------------------------


def test_unwritable_run_dir_fails_early(tiny_data: Path, tmp_path: Path, in_process: None) -> None:
    from vitlab.cli import main

    config = _nan_config(tmp_path, tiny_data, None)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(RunDirError, match=re.escape(f"run folder {blocker / 'run'} is not writable")):
        main(["fit", "--config", str(config), "--run_dir", str(blocker / "run")])
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(RunDirError, match=re.escape(f"run folder {locked / 'run'} is not writable")):
            main(["fit", "--config", str(config), "--run_dir", str(locked / "run")])


def test_full_disk_fails_early(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_process: None
) -> None:
    from vitlab.cli import main

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    run = tmp_path / "run"
    with pytest.raises(RunDirError) as err:
        main(["fit", "--config", str(_nan_config(tmp_path, tiny_data, None)), "--run_dir", str(run)])
    msg = str(err.value)
    assert f"not enough free disk space for run folder {run}" in msg
    assert "MiB needed" in msg and "1.0 MiB available" in msg and "3 checkpoints" in msg
    assert not list(run.rglob("*.ckpt"))  # failed before training


# ---- 5. secrets ----------------------------------------------------------------------------------------


# Realistic credentials, by variable name (the first four) and by a provider's token prefix alone (the last).
CREDENTIALS = {
    "DB_PASS": "Tr0ub4dor-horse-staple",
    "HF_TOKEN": "hf_xQ4rTz9LmP2vKc7NwB3yHd8FsJ6gA1eUo",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "MY_SERVICE_KEY": "svc.4f1e-prod-71c2",
    "DEPLOY_SETTING": "ghp_9a8B7c6D5e4F3g2H1i0JkLmNoPqRsTuV",
}
NOT_CREDENTIALS = {
    "TOKENIZERS_PARALLELISM": "false_but_long", "SHORT_TOKEN": "1", "PWD": "/work/some/where/long",
    "LANG": "en_US.UTF-8", "EXPERIMENT": "ImageNet21kTrainSplit2024", "ARCH": "vit_base_patch16_224_in21k",
    "LD_LIBRARY_PATH": "/usr/lib/x86_64-linux-gnu:/opt/lib",
    # Random-looking values that are not credentials: a run id and a commit (GITHUB_SHA).
    "UPSTREAM": "kP9xQ2mZ7vR4tL8wN3yB6cJ1", "GITHUB_SHA": "3f9c2a7e81d04b6c95fe1a2b3c4d5e6f708192a3",
}


def test_secret_values_by_name_and_provider_prefix() -> None:
    found = secret_values({**CREDENTIALS, **NOT_CREDENTIALS})
    assert sorted(found) == sorted(CREDENTIALS.values())
    assert [len(v) for v in found] == sorted((len(v) for v in found), reverse=True)  # longest first


def test_redact() -> None:
    secrets = secret_values({"WANDB_API_KEY": SECRET, "TOKENIZERS_PARALLELISM": "false_but_long", "SHORT_TOKEN": "1"})
    assert secrets == [SECRET]
    cfg = {
        "logger": {"api_key": "anything", "token": None, "project": f"p-{SECRET}"},
        "urls": ["https://user:hunter22@example.com/x", "plain"],
        "tokenizer": "bert",
    }
    out = redact(cfg, secrets)
    assert out == {
        "logger": {"api_key": REDACTED, "token": None, "project": f"p-{REDACTED}"},
        "urls": [f"https://user:{REDACTED}@example.com/x", "plain"],
        "tokenizer": "bert",
    }
    assert cfg["logger"]["api_key"] == "anything"  # a copy


def test_secrets_never_land_in_run_files(tiny_data: Path, tmp_path: Path) -> None:
    # The secrets are in the environment, and also part of a config value (the data path) on the command line.
    secrets = [SECRET, *CREDENTIALS.values()]
    data = tmp_path / ("data-" + "-".join(secrets))  # the AWS secret's slashes make it a nested path
    data.parent.mkdir(parents=True, exist_ok=True)
    data.symlink_to(tiny_data)
    config = write_config(tmp_path / "config.yaml", tiny_data, epochs=1, deterministic=False)
    run = tmp_path / "run"
    env = cli_env(WANDB_API_KEY=SECRET, WANDB_MODE="offline", WANDB_SILENT="true", **CREDENTIALS)
    cmd = fit_cmd(config, run, f"--data.init_args.root={data}", "--loggers=[tensorboard, csv, wandb]")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = [p for p in run.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix == ".wandb" for p in files) and (run / "checkpoints" / "last.ckpt").is_file()
    for secret in secrets:
        leaks = [str(p.relative_to(run)) for p in files if secret.encode() in p.read_bytes()]
        assert not leaks, f"{secret!r} written to {leaks}"
        assert secret not in proc.stdout + proc.stderr, f"{secret!r} in the run's log output"
    assert REDACTED in (run / "config.yaml").read_text()


def test_untested_lightning_version_fails_with_a_clear_message() -> None:
    check_lightning_version(TESTED_LIGHTNING + ".3")
    with pytest.raises(RuntimeError, match=r"tested on Lightning 2\.6\.x, but Lightning 2\.7\.0 is installed"):
        check_lightning_version("2.7.0")


class TermAt(Callback):
    """Sends this process SIGTERM (a preemption): after the first optimizer step, or during the first batch
    of the first validation (`in_validation`)."""

    def __init__(self, in_validation: bool = False) -> None:
        self.in_validation = in_validation

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.in_validation and trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *args: Any) -> None:
        if self.in_validation and not trainer.sanity_checking and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("in_validation", [False, True], ids=["training", "validation"])
def test_a_terminated_fit_saves_and_stands_its_signal_watchdog_down(
    image_folder: Path, tmp_path: Path, in_validation: bool
) -> None:
    """SIGTERM stops a fit where it lands: after that training batch, or inside the validation (6 steps in)
    before any later step; last.ckpt holds that step. Inside a process that lives on (a notebook, a test
    runner) the fit leaves no signal watchdog behind: Lightning skips the callbacks' teardown after an
    exception, and a watchdog left running would end the process `signal_timeout_s` after the signal."""
    import threading

    from vitlab.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 10, "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"arch": "vit_tiny_patch16",
                  "model_args": {"patch_size": 8, "depth": 1, "embed_dim": 16, "num_heads": 2, "mlp_ratio": 2}},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(image_folder), "img_size": 32, "batch_size": 4, "num_workers": 0}},
    }))  # fmt: skip
    term = json.dumps({"class_path": "test_reliability.TermAt", "init_args": {"in_validation": in_validation}})
    args = ["fit", "--config", str(recipe), "--run_dir", str(tmp_path / "run"), "--loggers=[csv]",
            f"--trainer.callbacks+={term}"]  # fmt: skip
    with pytest.raises(BaseException):  # Lightning's SIGTERMException, or the exit it leads to
        main(args)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == (6 if in_validation else 1)  # 24 images, batch 4: 6 steps an epoch
    assert signal.set_wakeup_fd(-1) == -1, "a signal watchdog's wake-up fd is still installed"
    time.sleep(0.5)  # the watchdog thread ends at once when stood down
    assert not [t for t in threading.enumerate() if t.name == "vitlab-signal-watchdog" and t.is_alive()]
