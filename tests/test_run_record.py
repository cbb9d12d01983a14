"""A run's record (config.yaml, csv/hparams.yaml, the checkpoints' hyperparameters) holds what was given,
reruns as a recipe, and rebuilds its module with `load_from_checkpoint`; credentials (by their variable's
or key's name, or a provider's token prefix) are the only values kept out of it.

Each run goes through the real command line (a subprocess) on generated images: tiny ViT, CPU, 2 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from cli_probe import run_cli
from vitlab.train import MaskedPatchPretraining, ViTClassifier
from vitlab.train.objectives.distill import DistillClassifier
from vitlab.train.reliability.redaction import REDACTED, redact, secret_values

pytestmark = pytest.mark.slow

SHA = "3f9c2a7e81d04b6c95fe1a2b3c4d5e6f708192a3"  # a GITHUB_SHA: 40 hex characters, not a credential
# class_token is a model option (and false): never a credential, whatever its name ends with.
MODEL_ARGS = {"patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2, "class_token": False, "pool": "avg"}
CREDENTIALS = {
    "WANDB_API_KEY": "wandb-9f8e7d6c5b4a39281706",
    "HF_TOKEN": "hf_xQ4rTzLmPvKcNwByHdFsJgAeUoIiRrTtYy",
    "DB_PASSWORD": "Tr0ub4dor-horse-staple",
    "MY_SERVICE_SECRET": "svc.4f1e-prod-71c2",
}
CONFIG_KEY = "literal-api-key-given-in-the-recipe"  # a recipe's own credential, under an `api_key` key


def write_recipe(path: Path, root: Path, model: dict[str, Any], callbacks: list[Any] | None = None) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_steps": 2, "limit_val_batches": 1, "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False, "callbacks": callbacks},
        "model": model,
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(root), "img_size": 32, "batch_size": 4, "num_workers": 0}},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


def fit(tmp: Path, name: str, args: list[str], env: dict[str, str] | None = None) -> str:
    cwd = tmp / f"cwd-{name}"
    cwd.mkdir()
    rc, out, _, _ = run_cli(["fit", *args], cwd, timeout=300, env=env)
    assert rc == 0, out[-4000:]
    return out


def files_holding(run: Path, needle: str) -> list[str]:
    return [str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def ckpt(run: Path) -> dict[str, Any]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def runs(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A classifier run named after the commit, on data whose folder is named after it too, with the
    commit in the environment as CI sets it; then the same run repeated from its own config.yaml."""
    tmp = tmp_path_factory.mktemp("record")
    data = tmp / f"data-{SHA}"  # e.g. a dataset revision equal to the commit
    data.symlink_to(image_folder)
    model = {"arch": "vit_tiny_patch16", "model_args": MODEL_ARGS, "lr": 1e-3, "warmup_steps": 0}
    recipe = write_recipe(tmp / "recipe.yaml", data, model)
    run = tmp / "runs" / SHA
    env = {"GITHUB_SHA": SHA}
    fit(tmp, "first", ["--config", str(recipe), "--run_dir", str(run)], env)
    again = tmp / "runs" / "again"
    fit(tmp, "again", ["--config", str(run / "config.yaml"), "--run_dir", str(again)], env)
    return {"tmp": tmp, "data": data, "run": run, "again": again}


def test_record_holds_what_was_given(runs: dict[str, Any]) -> None:
    run, data = runs["run"], runs["data"]
    assert not files_holding(run, REDACTED), files_holding(run, REDACTED)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["run_dir"] == str(run)
    assert config["data"]["init_args"]["root"] == str(data)
    assert config["model"]["init_args"]["model_args"] == MODEL_ARGS
    hparams = yaml.safe_load((run / "csv" / "hparams.yaml").read_text())
    assert hparams["model_args"] == MODEL_ARGS and hparams["root"] == str(data)
    saved = ckpt(run)
    assert saved["hyper_parameters"]["model_args"] == MODEL_ARGS
    assert saved["datamodule_hyper_parameters"]["root"] == str(data)
    assert SHA.encode() in (run / "config.yaml").read_bytes()


def test_config_yaml_reruns_as_a_recipe(runs: dict[str, Any]) -> None:
    """The repeated run reads the same settings and, seeded the same, ends with the same weights."""
    first = yaml.safe_load((runs["run"] / "config.yaml").read_text())
    second = yaml.safe_load((runs["again"] / "config.yaml").read_text())
    assert second.pop("run_dir") == str(runs["again"])
    first.pop("run_dir")
    assert second == first
    a, b = ckpt(runs["run"]), ckpt(runs["again"])
    assert a["global_step"] == b["global_step"] == 2
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][key], value, rtol=0, atol=0, msg=key)


def test_last_if_present_starts_fresh_then_resume_continues(image_folder: Path, tmp_path: Path) -> None:
    """`--ckpt_path last-if-present` in an empty run folder starts fresh; `--ckpt_path last` then resumes
    from its last.ckpt. The record says last-if-present both times, so it reruns in a fresh folder too."""
    model = {"arch": "vit_tiny_patch16", "model_args": MODEL_ARGS}
    recipe = write_recipe(tmp_path / "recipe.yaml", image_folder, model)
    run = tmp_path / "run"
    args = ["--config", str(recipe), "--run_dir", str(run)]
    out = fit(tmp_path, "fresh", [*args, "--ckpt_path", "last-if-present"])
    assert ckpt(run)["global_step"] == 2 and "Restored all states" not in out
    assert yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"] == "last-if-present"
    out = fit(tmp_path, "resume", [*args, "--ckpt_path", "last", "--trainer.max_steps", "4"])
    assert f"Restored all states from the checkpoint at {run}/checkpoints/last.ckpt" in out
    assert ckpt(run)["global_step"] == 4
    assert yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"] == "last-if-present"


def _assert_loads(cls: type, run: Path) -> Any:
    """`cls.load_from_checkpoint(last.ckpt)` rebuilds the module with the saved weights."""
    saved = ckpt(run)
    module = cls.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu")
    assert type(module) is cls
    state = module.state_dict()
    assert state.keys() == saved["state_dict"].keys()
    for key, value in saved["state_dict"].items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    return module


def test_classifier_loads_from_its_last_checkpoint(runs: dict[str, Any]) -> None:
    module = _assert_loads(ViTClassifier, runs["run"])
    assert module.hparams.model_args == MODEL_ARGS and module.model.cls_token is None
    assert module.model.num_classes == 3 and module.hparams.class_names == ["blue", "green", "red"]


def test_mpp_loads_from_its_last_checkpoint(image_folder: Path, tmp_path: Path) -> None:
    model = {"class_path": "vitlab.train.MaskedPatchPretraining",
             "init_args": {"arch": "vit_tiny_patch16", "model_args": MODEL_ARGS}}  # fmt: skip
    recipe = write_recipe(tmp_path / "mpp.yaml", image_folder, model)
    fit(tmp_path, "mpp", ["--config", str(recipe), "--run_dir", str(tmp_path / "run")])
    module = _assert_loads(MaskedPatchPretraining, tmp_path / "run")
    assert module.hparams.model_args == MODEL_ARGS


def test_distilled_student_loads_from_its_last_checkpoint(runs: dict[str, Any], tmp_path: Path) -> None:
    teacher = runs["run"] / "checkpoints" / "last.ckpt"  # the classifier run above, same classes
    student = {k: v for k, v in MODEL_ARGS.items() if k not in ("class_token", "pool")}
    model = {"class_path": "vitlab.train.objectives.distill.DistillClassifier",
             "init_args": {"arch": "deit_tiny_distilled_patch16", "model_args": student, "teacher": str(teacher),
                           "distillation": "soft", "distill_tau": 2.0}}  # fmt: skip
    recipe = write_recipe(tmp_path / "distill.yaml", runs["data"], model)
    fit(tmp_path, "distill", ["--config", str(recipe), "--run_dir", str(tmp_path / "run")])
    module = _assert_loads(DistillClassifier, tmp_path / "run")
    assert module.hparams.teacher == str(teacher) and module.model.distilled


def test_credentials_stay_out_of_the_record(image_folder: Path, tmp_path: Path) -> None:
    """Credentials in the environment (by name, and inside a config value: the data folder's name) and
    under a recipe's `api_key`: none reaches a file of the run or its output; the rest is as given."""
    data = tmp_path / ("data-" + "-".join(CREDENTIALS.values()))
    data.symlink_to(image_folder)
    callback = {"class_path": "cli_probe.HoldsCredential", "init_args": {"api_key": CONFIG_KEY, "class_token": False}}
    model = {"arch": "vit_tiny_patch16", "model_args": MODEL_ARGS}
    recipe = write_recipe(tmp_path / "recipe.yaml", data, model, callbacks=[callback])
    run = tmp_path / "run"
    out = fit(tmp_path, "secrets", ["--config", str(recipe), "--run_dir", str(run)], {**CREDENTIALS, "GITHUB_SHA": SHA})
    for secret in [*CREDENTIALS.values(), CONFIG_KEY]:
        assert not files_holding(run, secret), (secret, files_holding(run, secret))
        assert secret not in out, secret
    config = yaml.safe_load((run / "config.yaml").read_text())
    # the recipe's callback, then those every run adds (vitlab.train.run.defaults), none of them the recipe's
    saved_callback, *added = config["trainer"]["callbacks"]
    assert saved_callback["class_path"] == "cli_probe.HoldsCredential"
    assert all(cb["class_path"].startswith("vitlab.train.") for cb in added), added
    assert saved_callback["init_args"] == {"api_key": REDACTED, "class_token": False}
    assert config["model"]["init_args"]["model_args"] == MODEL_ARGS
    root = str(data)
    for secret in CREDENTIALS.values():
        root = root.replace(secret, REDACTED)
    assert config["data"]["init_args"]["root"] == root
    assert ckpt(run)["datamodule_hyper_parameters"]["root"] == root
    _assert_loads(ViTClassifier, run)  # the module's own hyperparameters held no credential


def test_secret_values_by_name_and_provider_prefix_only() -> None:
    env = {
        **CREDENTIALS,
        "DEPLOY": "ghp_9a8B7c6D5e4F3g2H1i0JkLmNoPqRsTuVwX",  # a GitHub token under any name
        "GITHUB_SHA": SHA, "HUB_REVISION": "0" * 40, "RUN_ID": "kP9xQ2mZ7vR4tL8wN3yB6cJ1",
        "TOKENIZERS_PARALLELISM": "false_but_long", "CACHE": "hf_cache_dir_for_the_datasets_2024",
    }  # fmt: skip
    assert sorted(secret_values(env)) == sorted([*CREDENTIALS.values(), env["DEPLOY"]])


def test_only_strings_under_credential_keys_are_credentials() -> None:
    cfg = {
        "model_args": {"class_token": False, "dist_token": True, "mask_token": "zeros", "reg_tokens": 4},
        "tokenizer": {"pad_token": "[PAD]"},
        "logger": {"api_key": "abc", "token": None, "hf_token": "xyz", "db_password": "pw", "secret": 123},
    }
    out = redact(cfg, [])
    assert out["model_args"] == cfg["model_args"] and out["tokenizer"] == cfg["tokenizer"]
    assert out["logger"] == {"api_key": REDACTED, "token": None, "hf_token": REDACTED, "db_password": REDACTED,
                             "secret": 123}  # fmt: skip
