"""User errors through the real command line (`python -m vitlab.cli` in a subprocess): each prints one
short message that names the problem and the fix, exits non-zero and shows no traceback;
`VITLAB_DEBUG=1` brings the traceback back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import image_tree

pytestmark = pytest.mark.slow

TINY = {"patch_size": 4, "depth": 1, "embed_dim": 32, "num_heads": 2}


def _recipe(path: Path, data: dict) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_steps": 1, "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"arch": "vit_tiny_patch16", "model_args": TINY},
        "data": data,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _folder(root: Path, img_size: int = 32) -> dict:
    return {"class_path": "vitlab.data.ImageFolderDataModule",
            "init_args": {"root": str(root), "img_size": img_size, "batch_size": 4, "num_workers": 0}}  # fmt: skip


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[str], str]]:
    """name -> (vitlab arguments, a regex the one-line message must match)."""
    tmp = tmp_path_factory.mktemp("errors")
    data = image_tree(tmp / "data", ["cat", "dog"], 4, 2)
    ok = _recipe(tmp / "ok.yaml", _folder(data))
    junk = tmp / "junk.pth"
    junk.write_bytes(b"not a checkpoint at all")
    (tmp / "a_file").write_text("a file, not a folder")
    bad_key = tmp / "bad_key.yaml"
    bad_key.write_text(yaml.safe_dump({"model": {"arch": "vit_tiny_patch16", "archh": "vit_tiny_patch16"}}))
    cifar = {"class_path": "vitlab.data.CIFARDataModule",
             "init_args": {"root": str(tmp / "no_cifar"), "download": False, "batch_size": 4}}  # fmt: skip
    broken = tmp / "broken.yaml"
    broken.write_text("model:\n  arch: vit_tiny_patch16\n  model_args: {depth: 1\n")  # an unclosed flow mapping
    run = ["--run_dir", str(tmp / "run")]
    return {
        "missing data path": (["fit", "--config", str(ok), *run, "--data_path", str(tmp / "nowhere")],
                              rf"DATA path '{tmp}/nowhere' does not exist; .*image folder"),
        "missing image folder": (["fit", "--config", str(_recipe(tmp / "gone.yaml", _folder(tmp / "gone"))), *run],
                                 rf"{tmp}/gone .*train/<class>/\*\.jpg"),
        "offline dataset": (["fit", "--config", str(_recipe(tmp / "cifar.yaml", cifar)), *run],
                            r"cifar10 is not available.*DATA=<ImageFolder path>"),
        "bad recipe key": (["fit", "--config", str(bad_key), *run], r"unknown key .*model\.archh; did you mean 'arch'"),
        "mistyped model key": (["fit", "--config", str(ok), *run, "--model.lrr=0.1"],
                               r"unknown key --model\.lrr; did you mean --model\.lr\? valid keys: arch, "),
        "bad checkpoint to predict": (["predict", "--ckpt", str(junk), str(junk)],
                                      rf"checkpoint \({junk}\): not a readable torch file"),
        "bad checkpoint to fine-tune": (["fit", "--config", str(ok), *run, "--model.init_from", str(junk)],
                                        rf"checkpoint \({junk}\): not a readable torch file"),
        "wrong image size": (["fit", "--config", str(ok), *run, "--data.init_args.img_size", "30"],
                             r"img_size 30x30 is not a multiple of patch_size 4; use e\.g\. 28x28 or 32x32"),
        "unwritable run folder": (["fit", "--config", str(ok), "--run_dir", str(tmp / "a_file" / "run")],
                                  rf"run folder {tmp}/a_file/run is not writable"),
        "optimizer not among the choices": (["fit", "--config", str(ok), *run, "--model.optimizer=adam"],
                                            r"--model\.optimizer=adam: not a valid choice; did you mean adamw\? "
                                            r"choose one of adamw, sgd"),
        "negative learning rate": (["fit", "--config", str(ok), *run, "--model.lr=-1"],
                                   r"--model\.lr=-1\.0: the learning rate must be a positive number, "
                                   r"e\.g\. --model\.lr=1e-3"),
        # `_start` sets CUDA_VISIBLE_DEVICES="": no GPU is visible, as on a machine without one.
        "GPU accelerator without a GPU": (["fit", "--config", str(ok), *run, "--trainer.accelerator=gpu"],
                                          r"--trainer\.accelerator=gpu: this machine has no CUDA GPU .*"
                                          r"accelerator auto"),
        "trainer setting Lightning rejects": (["fit", "--config", str(ok), *run, "--trainer.devices=0"],
                                              r"trainer settings do not work here: `Trainer\(devices='0'\)` .*Fix the "
                                              r"recipe's trainer: section or the --trainer\.\* options"),
        "missing recipe": (["fit", "--config", str(tmp / "recipes" / "oks.yaml"), *run],
                           rf"--config {tmp}/recipes/oks\.yaml: no such file; give the path of a YAML recipe"),
        "misspelt recipe": (["fit", "--config", str(tmp / "okk.yaml"), *run],
                            rf"--config {tmp}/okk\.yaml: no such file; did you mean {tmp}/ok\.yaml\?"),
        "recipe with a YAML syntax error": (["fit", "--config", str(broken), *run],
                                            rf"--config {broken}: not valid YAML \(line 4, column 1: .*\); "
                                            r"fix the recipe"),
        "resume without last.ckpt": (["fit", "--config", str(ok), *run, "--ckpt_path=last"],
                                     rf"--ckpt_path last: there is no last\.ckpt in {tmp}/run/checkpoints to resume "
                                     r"from; check --run_dir, or use --ckpt_path last-if-present"),
    }


def _start(args: list[str], log: Path, debug: bool = False) -> subprocess.Popen:
    """`python -m vitlab.cli ARGS`, stdout and stderr into `log` (a file: a full pipe would block it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # as on a machine without a GPU
    env.pop("VITLAB_DEBUG", None)
    if debug:
        env["VITLAB_DEBUG"] = "1"
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "vitlab.cli", *args], env=env, text=True, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def test_user_errors_print_the_fix_without_a_traceback(cases, tmp_path):
    # All at once: each process pays the import time, which dominates.
    procs = {name: _start(args, tmp_path / f"{i}.log") for i, (name, (args, _)) in enumerate(cases.items())}
    deadline = time.monotonic() + 900
    failures = []
    for i, (name, proc) in enumerate(procs.items()):
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        output = (tmp_path / f"{i}.log").read_text()
        pattern = cases[name][1]
        if rc == 0 or "Traceback" in output or not any(re.search(pattern, ln) for ln in output.splitlines()):
            failures.append(f"{name}: exit {rc}, expected /{pattern}/ on one line; output:\n{output[-1500:]}")
    assert not failures, "\n\n".join(failures)


def test_vitlab_debug_shows_the_traceback(cases, tmp_path):
    args, _ = cases["bad checkpoint to predict"]
    proc = _start(args, tmp_path / "debug.log", debug=True)
    assert proc.wait(timeout=600) != 0
    output = (tmp_path / "debug.log").read_text()
    assert "Traceback (most recent call last)" in output and "CheckpointError" in output
    assert "not a readable torch file" in output
