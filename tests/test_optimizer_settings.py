"""The optimizer settings, declared once (`ViTOptimization`): every objective takes the same flat keys (in
Python, in recipes and on the command line, through jsonargparse's `**kwargs` resolution), a checkpoint
written while each objective declared them itself still loads, and a bad value gets one line naming the key."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import image_tree
from jsonargparse import ArgumentParser
from torch.utils.data import DataLoader, TensorDataset

from vitlab.cli import VitlabCLI, main, user_error
from vitlab.recipe import check_config_args
from vitlab.train import DistillClassifier, MaskedPatchPretraining, ViTClassifier

REPO = Path(__file__).resolve().parents[1]
TINY = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}
SETTINGS = ["optimizer", "lr", "weight_decay", "betas", "momentum", "warmup_steps", "schedule", "min_lr_ratio",
            "layer_decay"]  # fmt: skip
DATA_CONFIG = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "interpolation": "bicubic", "crop_pct": 1.0}

# The hyperparameters of checkpoints written while ViTClassifier and MaskedPatchPretraining declared the
# settings in their own signatures (those signatures' keys, unchanged through the project's history; `vitlab fit`
# adds `_class_path` and `_instantiator`, a plain `Trainer.fit` neither), with the settings off their defaults.
OLD_CLASSIFIER = {
    "arch": "vit_tiny_patch16", "model_args": TINY, "num_classes": 4, "img_size": 32, "init_from": None,
    "optimizer": "sgd", "lr": 0.02, "weight_decay": 0.01, "betas": [0.8, 0.9], "momentum": 0.7, "warmup_steps": 0.25,
    "schedule": "linear", "min_lr_ratio": 0.1, "layer_decay": 0.5, "label_smoothing": 0.1,
    "grad_checkpointing": False, "compile": False, "class_names": ["a", "b", "c", "d"], "data_config": DATA_CONFIG,
}  # fmt: skip
OLD_MPP = {
    "arch": "vit_tiny_patch16", "model_args": TINY, "img_size": 32, "target": "color", "pixel_loss": "l1",
    "corrupt_ratio": 0.5, "mask_ratio": 0.8, "random_ratio": 0.1, "color_bits": 3, "lr": 0.004,
    "weight_decay": 0.02, "betas": [0.9, 0.95], "warmup_steps": 3, "schedule": "constant", "min_lr_ratio": 0.0,
    "grad_checkpointing": False, "compile": False, "data_config": DATA_CONFIG,
}  # fmt: skip
BY_CLI = {"_class_path": None, "_instantiator": "lightning.pytorch.cli.instantiate_module"}


def _old_checkpoint(path: Path, cls: type[L.LightningModule], hparams: dict, by_cli: bool) -> Path:
    """A checkpoint as Lightning writes it (state dict, flat `hyper_parameters`), holding `hparams`."""
    module = cls(**hparams)
    if by_cli:
        hparams = {**hparams, **BY_CLI, "_class_path": f"vitlab.train.{cls.__name__}"}
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": hparams, "hparams_name": "kwargs",
                  "pytorch-lightning_version": L.__version__, "epoch": 0, "global_step": 0}  # fmt: skip
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path


def _loaded_as_saved(module: L.LightningModule, hparams: dict, path: Path) -> None:
    for key, value in hparams.items():
        got = module.hparams[key]
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    saved = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    assert saved.keys() == module.state_dict().keys()
    assert all(torch.equal(module.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("by_cli", [False, True], ids=["trainer", "vitlab-fit"])
def test_a_classifier_checkpoint_with_the_old_flat_hparams_loads_and_trains_with_them(
    tmp_path: Path, by_cli: bool
) -> None:
    path = _old_checkpoint(tmp_path / "old.ckpt", ViTClassifier, OLD_CLASSIFIER, by_cli)
    module = ViTClassifier.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    _loaded_as_saved(module, OLD_CLASSIFIER, path)

    # The settings reach the optimizer and the schedule: 4 steps, a warm-up of one, linear to 0.1 of the lr.
    data = TensorDataset(torch.randn(8, 3, 32, 32), torch.arange(8) % 4)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=2))
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.7
    by_name = {name: g for g in optimizer.param_groups for name in g["param_names"]}
    # lr * 0.5 ** (depth + 1 - layer), depth 2: the tokenizer is layer 0, block i layer i + 1, the head layer 3.
    assert by_name["patch_embed.proj.weight"]["initial_lr"] == pytest.approx(0.02 * 0.5**3)
    assert by_name["blocks.1.mlp.fc1.weight"]["initial_lr"] == pytest.approx(0.02 * 0.5)
    assert by_name["head.weight"]["initial_lr"] == pytest.approx(0.02)
    assert by_name["head.weight"]["weight_decay"] == 0.01 and by_name["head.bias"]["weight_decay"] == 0
    assert by_name["head.weight"]["lr"] == pytest.approx(0.02 * 0.1)  # the end of the linear decay


def _param_names(groups: list[dict]) -> list[str]:
    return [name for g in groups for name, _ in g["params"]]


@pytest.mark.parametrize("by_cli", [False, True], ids=["trainer", "vitlab-fit"])
def test_an_mpp_checkpoint_with_the_old_flat_hparams_loads_with_the_new_settings_at_their_defaults(
    tmp_path: Path, by_cli: bool
) -> None:
    path = _old_checkpoint(tmp_path / "old.ckpt", MaskedPatchPretraining, OLD_MPP, by_cli)
    module = MaskedPatchPretraining.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    _loaded_as_saved(module, OLD_MPP, path)
    assert (module.hparams.optimizer, module.hparams.momentum, module.hparams.layer_decay) == ("adamw", 0.9, None)
    groups = module.optimizer_groups()
    assert all(g["lr"] == 0.004 for g in groups)  # as before: one rate for the encoder, head and mask token
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert sorted(_param_names(groups)) == sorted(n.removeprefix("model.") for n in trainable)


def test_mpp_layer_decay_puts_the_mask_token_at_the_tokenizer_rate_and_the_head_at_the_top() -> None:
    module = MaskedPatchPretraining(model_args=TINY, lr=1.0, layer_decay=0.5)
    rate = {name: g["lr"] for g in module.optimizer_groups() for name, _ in g["params"]}
    assert rate["patch_embed.proj.weight"] == rate["mask_token"] == 0.5**3
    assert rate["blocks.0.attn.qkv.weight"] == 0.5**2 and rate["blocks.1.attn.qkv.weight"] == 0.5
    assert rate["mpp_head.weight"] == rate["mpp_head.bias"] == rate["norm.weight"] == 1.0


STUDENT = {"arch": "deit_tiny_distilled_patch16", "model_args": TINY, "num_classes": 4, "teacher": "teacher.pth"}
OBJECTIVES = {
    "classifier": (ViTClassifier, {"model_args": TINY, "num_classes": 4}),
    "mpp": (MaskedPatchPretraining, {"model_args": TINY}),
    "distill": (DistillClassifier, STUDENT),  # the teacher is read when fitting starts, never here
}


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_jsonargparse_gives_every_objective_the_flat_settings_with_their_defaults(objective: str) -> None:
    cls, required = OBJECTIVES[objective]
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "model")
    defaults = parser.get_defaults().model
    expected = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.05, "betas": (0.9, 0.999), "momentum": 0.9,
                "warmup_steps": 0, "schedule": "cosine", "min_lr_ratio": 0.0, "layer_decay": None}  # fmt: skip
    assert {k: defaults[k] for k in SETTINGS} == expected
    given = {"optimizer": "sgd", "lr": 0.25, "momentum": 0.5, "layer_decay": 0.75, "warmup_steps": 0.1}
    cfg = parser.parse_object({"model": {**required, **given}})
    module = parser.instantiate_classes(cfg).model
    assert type(module) is cls and {k: module.hparams[k] for k in given} == given


def test_print_config_lists_the_recipe_keys_it_listed_before() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        VitlabCLI(args=["fit", "--config", str(REPO / "recipes/finetune/imagenette_72px_cpu.yaml"), "--print_config"])
    assert exit_.value.code in (0, None)
    init_args = yaml.safe_load(out.getvalue())["model"]["init_args"]
    # The keys `--print_config` listed while ViTClassifier declared the settings itself.
    assert set(init_args) == {"arch", "model_args", "init_from", *SETTINGS, "label_smoothing", "grad_checkpointing",
                              "compile"}  # fmt: skip
    recipe = yaml.safe_load((REPO / "recipes/finetune/imagenette_72px_cpu.yaml").read_text())["model"]
    assert {k: init_args[k] for k in SETTINGS if k in recipe} == {k: recipe[k] for k in SETTINGS if k in recipe}


@pytest.mark.parametrize(
    ("model", "key", "close"),
    [("vitlab.train.ViTClassifier", "lrr", "lr"), ("vitlab.train.MaskedPatchPretraining", "layer_decy", "layer_decay"),
     ("vitlab.train.DistillClassifier", "momentun", "momentum")],
)  # fmt: skip
def test_a_mistyped_setting_gets_the_closest_key(model: str, key: str, close: str) -> None:
    with pytest.raises(SystemExit, match=rf"unknown key --model\.{key}; did you mean --model\.{close}\? valid keys: "):
        check_config_args(["fit", f"--model={model}", f"--model.{key}=0.5"])


@pytest.mark.parametrize(
    ("model", "key", "value", "close", "choices"),
    [("vitlab.train.ViTClassifier", "optimizer", "adam", "adamw", "adamw, sgd"),
     ("vitlab.train.MaskedPatchPretraining", "schedule", "cosin", "cosine", "cosine, linear, constant"),
     ("vitlab.train.MaskedPatchPretraining", "target", "colour", "color", "color, pixels")],
)  # fmt: skip
def test_a_value_outside_the_choices_gets_one_line(model: str, key: str, value: str, close: str, choices: str,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """On the command line and in a recipe: the key, the closest choice and all of them, not jsonargparse's
    multi-line union error."""
    line = rf"--model\.{key}={value}: not a valid choice; did you mean {close}\? choose one of {choices}$"
    with pytest.raises(SystemExit, match=line):
        check_config_args(["fit", f"--model={model}", f"--model.{key}={value}"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"class_path": model, "init_args": {key: value}}}))
    with pytest.raises(SystemExit, match=rf"model\.init_args\.{key}={value}: not a valid choice; did you mean {close}\?"):
        check_config_args(["fit", "--config", str(recipe)])
    check_config_args(["fit", f"--model={model}", f"--model.{key}={close}"])  # a valid choice passes


BAD = [
    ("lr", -1.0, r"--model\.lr=-1\.0: the learning rate must be a positive number, e\.g\. --model\.lr=1e-3"),
    ("lr", 0.0, r"--model\.lr=0\.0: the learning rate must be a positive number"),
    ("lr", "fast", r"--model\.lr=fast: the learning rate must be a positive number"),
    ("weight_decay", -0.1, r"--model\.weight_decay=-0\.1: weight_decay must be 0 or more"),
    ("betas", (0.9, 1.0), r"--model\.betas=\[0\.9, 1\.0\]: each beta must be in \[0, 1\)"),
    ("betas", (0.9,), r"--model\.betas=\[0\.9\]: each beta"),
    ("momentum", -0.5, r"--model\.momentum=-0\.5: momentum must be 0 or more"),
    ("warmup_steps", -3, r"--model\.warmup_steps=-3: warmup_steps is a step count"),
    ("warmup_steps", 1.5, r"--model\.warmup_steps=1\.5: .*a fraction of the run \(a float in \[0, 1\]\)"),
    ("warmup_steps", True, r"--model\.warmup_steps=True: warmup_steps is a step count"),
    ("optimizer", "adam", r"--model\.optimizer=adam: choose adamw or sgd"),
    ("schedule", "cos", r"--model\.schedule=cos: choose cosine, linear or constant"),
    ("min_lr_ratio", 1.5, r"--model\.min_lr_ratio=1\.5: .*must lie in \[0, 1\]"),
    ("layer_decay", 0.0, r"--model\.layer_decay=0\.0: layer_decay must lie in \(0, 1\]"),
    ("layer_decay", 2.0, r"--model\.layer_decay=2\.0: layer_decay must lie in \(0, 1\] \(null: off\), e\.g\. "),
]


@pytest.mark.parametrize("objective", list(OBJECTIVES))
@pytest.mark.parametrize(("key", "value", "message"), BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_every_objective_rejects_a_bad_setting_in_one_line(objective: str, key: str, value, message: str) -> None:
    cls, required = OBJECTIVES[objective]
    with pytest.raises(ValueError, match=f"^{message}") as error:
        cls(**required, **{key: value})
    assert "\n" not in str(error.value)


def test_the_edges_of_each_range_are_accepted() -> None:
    edges = {"lr": 1e-9, "weight_decay": 0.0, "betas": (0.0, 0.999), "momentum": 0.0, "warmup_steps": 1.0,
             "min_lr_ratio": 1.0, "layer_decay": 1.0, "schedule": "constant", "optimizer": "sgd"}  # fmt: skip
    module = ViTClassifier(model_args=TINY, num_classes=4, **edges)
    assert {k: module.hparams[k] for k in edges} == edges
    assert ViTClassifier(model_args=TINY, num_classes=4, warmup_steps=0).hparams.warmup_steps == 0


@pytest.mark.parametrize(
    ("model", "arg", "reported"),
    [({"arch": "vit_tiny_patch16", "model_args": TINY}, "--model.layer_decay=2", "--model.layer_decay=2.0: "),
     ({"class_path": "vitlab.train.MaskedPatchPretraining", "init_args": {"model_args": TINY}},
      "--model.init_args.warmup_steps=-3", "--model.warmup_steps=-3: ")],
    ids=["classifier", "mpp"],
)  # fmt: skip
def test_the_cli_reports_a_bad_setting_in_one_line_before_fitting(
    tmp_path: Path, model: dict, arg: str, reported: str
) -> None:
    data = image_tree(tmp_path / "data", ["cat", "dog"], 2, 1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 1, "enable_progress_bar": False, "enable_model_summary": False}, "model": model,
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(data), "img_size": 32, "batch_size": 2, "num_workers": 0}},
    }))  # fmt: skip
    with pytest.raises(Exception) as error:
        main(["fit", "--config", str(recipe), "--run_dir", str(tmp_path / "run"), arg])
    message = user_error(error.value)  # what `vitlab` prints, on one line, without a traceback
    assert message is not None, f"not reported as a user error: {error.value!r}"
    assert str(message).startswith(reported) and "\n" not in str(message)
    assert not (tmp_path / "run" / "config.yaml").exists()  # written when fitting starts
