"""Every recipe parses through the real CLI, builds its model and runs a forward pass at its size.

GPU recipes are checked on the CPU with the device settings overridden; the data is pointed at a
small real image folder, which the CLI's `--data_path` switches to without losing the recipe's
data options."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from vitlab.cli import VitlabCLI
from vitlab.train import MaskedPatchPretraining

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*/*.yaml"))
CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto",
       "--trainer.precision=32-true", "--trainer.num_nodes=1", "--model.compile=false"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_tree(cifar_subset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for f in sorted((cifar_subset / split / c).iterdir())[:2]:
                (root / split / c / f.name).symlink_to(f)
    return root


def test_recipes_exist() -> None:
    names = {f"{p.parent.name}/{p.name}" for p in RECIPES}
    assert {"pretrain/tinyimagenet_vit_cpu.yaml", "finetune/imagenette_64px_cpu.yaml", "pretrain/imagenette_scratch_cpu.yaml",
            "pretrain/cifar10_vit_tiny_cpu.yaml", "finetune/cifar10_vit_tiny_64px_cpu.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_builds_and_runs(recipe: Path, tiny_tree: Path, tmp_path: Path) -> None:
    text = yaml.safe_load(recipe.read_text())
    assert text["model"] and text["data"], "a recipe names its model and its data"
    args = ["--config", str(recipe), *CPU, "--data_path", str(tiny_tree), "--run_dir", str(tmp_path)]
    cli = VitlabCLI(args=args, run=False)
    model = cli.model.model.eval()
    size = text["data"]["init_args"]["img_size"]
    assert model.patch_embed.img_size == (size, size)
    with torch.no_grad():
        if isinstance(cli.model, MaskedPatchPretraining):  # self-supervised: an output per patch, no classes
            cells = model.patch_embed.grid_size[0] * model.patch_embed.grid_size[1]
            assert cli.model.eval()(torch.zeros(1, 3, size, size))[0].shape == (1, cells, 512)  # 3-bit colours
        else:
            assert model(torch.zeros(1, 3, size, size)).shape == (1, 2)


def test_unknown_recipe_key_is_rejected_with_choices(tmp_path: Path, tiny_tree: Path) -> None:
    bad = tmp_path / "bad.yaml"
    for section, typo, suggestion in [("model", "weight_decy", "weight_decay"), ("trainer", "max_epoch", "max_epochs")]:
        bad.write_text(f"{section}:\n  {typo}: 1\n")
        with pytest.raises(SystemExit) as excinfo:
            VitlabCLI(args=["--config", str(bad), "--data_path", str(tiny_tree), "--run_dir", str(tmp_path)], run=False)
        message = str(excinfo.value.code)
        assert f"unknown key {bad}: {section}.{typo}" in message and f"did you mean {suggestion!r}" in message
    bad.write_text("model:\n  model_args:\n    patchsize: 4\n")
    with pytest.raises(SystemExit, match="did you mean 'patch_size'.*valid keys: img_size, patch_size"):
        VitlabCLI(args=["--config", str(bad), "--data_path", str(tiny_tree), "--run_dir", str(tmp_path)], run=False)


REPO = Path(__file__).resolve().parents[1]


def make_fit_args(target: str, *variables: str) -> list[str]:
    """The `vitlab fit` arguments `make TARGET VARIABLES` would run (from `make -n`)."""
    if not shutil.which("make"):
        pytest.fail("make is not installed: the Makefile targets are vitlab's documented commands (install make)")
    # As a fresh shell would: `make test` passes its own flags and level down to every child make.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", target, *variables],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    words = shlex.split(out.stdout.replace("\\\n", " "))
    start = next(i for i, w in enumerate(words) if w.endswith("vitlab") and words[i + 1 : i + 2] == ["fit"])
    return words[start + 2 :]


@pytest.mark.parametrize(
    "variables, loggers",
    [
        ((), ["TensorBoardLogger", "CSVLogger"]),
        (("LOGGER=wandb", "GPUS=2", "NODES=2", "ARGS=--trainer.max_epochs=3"),
         ["TensorBoardLogger", "CSVLogger", "WandbLogger"]),
    ],
)  # fmt: skip
def test_make_targets_pass_a_command_line_the_cli_accepts(
    variables: tuple[str, ...], loggers: list[str], tiny_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make pretrain` / `make finetune` with every variable: the printed command parses and builds."""
    from vitlab import create_model, save_pretrained

    monkeypatch.setenv("WANDB_MODE", "offline")
    recipe = yaml.safe_load((REPO / "recipes/finetune/cifar10_vit_tiny_64px_cpu.yaml").read_text())
    source = tmp_path / "pretrained"
    save_pretrained(create_model("vit_tiny_patch16", img_size=32, num_classes=2, **recipe["model"]["model_args"]), source)
    common = (f"DATA={tiny_tree}", *variables)
    for target, extra in [("pretrain", ()), ("finetune", (f"CKPT={source}",))]:
        args = make_fit_args(target, f"RUN={tmp_path / target}", *common, *extra)
        assert args[args.index("--run_dir") + 1] == str(tmp_path / target)
        assert args[args.index("--data_path") + 1] == str(tiny_tree)
        if "GPUS=2" in variables:
            assert {"--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.num_nodes=2"} <= set(args)
        cli = VitlabCLI(args=[*args, *CPU], run=False)  # the device flags are overridden to run here
        assert [type(lg).__name__ for lg in cli.trainer.loggers] == loggers
        if "ARGS=--trainer.max_epochs=3" in variables:
            assert cli.trainer.max_epochs == 3
        if target == "finetune":
            assert cli.model.model.patch_embed.img_size == (64, 64)
