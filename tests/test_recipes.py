"""Every recipe runs as written: `vitlab fit` on the CPU for 2 training steps and 1 validation step,
changing only what a CPU cannot have. `OVERRIDES` lists, per recipe, every command-line override and
`WHY` says why each is there; everything else (precision, clipping, compile, optimizer, schedule,
label smoothing, MixUp/CutMix, the in-memory path, the data module and its options) stays as the
recipe says, and each test checks that the run used it.

Single-process runs go through `vitlab.cli.main` in this process; DDP recipes run as 2 CPU ranks over
gloo in a subprocess (`cli_probe.run_cli`, as a user's `vitlab fit` would). FSDP cannot run on a CPU:
its recipe is run up to Lightning's refusal. A fine-tune recipe starts from the last.ckpt of its
pretraining recipe's run (`--model.init_from`, what `make finetune` passes), so the pair is checked
end to end: position embeddings resampled, head replaced. `torch.compile` recipes compile with
inductor on the CPU; one inductor cache folder serves the whole session (ranks, repeated graphs)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_probe import run_cli
from recipe_runs import HUB_COMMIT, fake_cifar, finite, hub_cache, image_tree, read_records, resnet18_teacher, small_shards

from vitlab.cli import VitlabCLI, main

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*/*.yaml"))
CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto",
       "--trainer.precision=32-true", "--trainer.num_nodes=1", "--model.compile=false"]  # fmt: skip


def recipe_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


# ---- what each run overrides, and why ------------------------------------------------------------

WHY = {
    "trainer.max_steps": "2 optimizer steps",
    "trainer.limit_train_batches": "the epoch ends after those 2 batches, so the epoch's validation runs",
    "trainer.limit_val_batches": "1 validation batch",
    "trainer.val_check_interval": "validate after step 2 (the recipe validates every 200 to 2000 steps)",
    "trainer.callbacks+": "recipe_runs.RecordRun writes down what ran; it changes nothing",
    "run_dir": "a temporary folder",
    "trainer.accelerator": "no GPU here",
    "trainer.devices": "the recipe's GPUs become 1 CPU process, or 2 CPU ranks (gloo) for a DDP recipe",
    "trainer.num_nodes": "one machine",
    "model.model_args.embed_dim": "a small model for the CPU: width 32 ...",
    "model.model_args.depth": "... 2 blocks (so stochastic depth still has a non-zero rate) ...",
    "model.model_args.num_heads": "... 2 heads; the tokenizer, pooling, tokens and options stay",
    "model.model_args.stem_channels": "the conv tokenizer's width, small like the model",
    "model.model_args.representation_size": "the pre-logits layer kept, at the small model's width",
    "model.init_args.model_args.embed_dim": "as model.model_args.embed_dim",
    "model.init_args.model_args.depth": "as model.model_args.depth",
    "model.init_args.model_args.num_heads": "as model.model_args.num_heads",
    "model.init_args.model_args.stem_channels": "as model.model_args.stem_channels",
    "data.batch_size": "4 images a step (2 per DDP rank): CPU time and memory",
    "data.root": "a small folder of the recipe's kind and image size, built in a temporary folder",
    "data.train_shards": "small shards (the real ones' first samples, format and classes.txt) in a temporary folder",
    "data.val_shards": "as data.train_shards",
    "model.init_args.teacher": "a torchvision ResNet-18 state dict written here (bench_distill.py trains the real one)",
    "model.init_from": "the last.ckpt of the pretraining recipe's run here, as `make finetune` passes it",
}

STEPS = ["--trainer.max_steps=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
         "--trainer.callbacks+=recipe_runs.RecordRun"]  # fmt: skip
GPU1 = ["--trainer.accelerator=cpu", "--trainer.devices=1"]
DDP2 = ["--trainer.accelerator=cpu", "--trainer.devices=2"]  # the recipe's strategy (ddp) stays
SMALL = ["--model.model_args.embed_dim=32", "--model.model_args.depth=2", "--model.model_args.num_heads=2"]
SMALL_CONV = [*SMALL, "--model.model_args.stem_channels=8"]
SMALL_INIT = [a.replace("--model.", "--model.init_args.") for a in SMALL_CONV]
BATCH = ["--data.batch_size=4"]

# {name} is filled in at run time: a data folder built below, or the pretraining run's checkpoint.
CIFAR10, CIFAR100 = ["--data.root={cifar10}"], ["--data.root={cifar100}"]
TIN = ["--data.train_shards={tin}/train", "--data.val_shards={tin}/val"]
IMAGENETTE = ["--data.train_shards={imagenette}"]
FROM_PRETRAINED = ["--model.init_from={pretrained}"]
OVERRIDES: dict[str, list[str]] = {
    "pretrain/cifar10_anchor_cpu": [*SMALL, *CIFAR10, *BATCH],
    "pretrain/cifar10_vit_tiny_cpu": [*SMALL_CONV, *CIFAR10, *BATCH],
    "pretrain/cifar10_vit_gpu": [*GPU1, *SMALL_CONV, *CIFAR10, *BATCH],
    "pretrain/cifar100_vit_gpu": [*GPU1, *SMALL_CONV, *CIFAR100, *BATCH],
    "pretrain/tinyimagenet_vit_cpu": [*SMALL_CONV, *TIN, *BATCH],
    "pretrain/tinyimagenet_mpp_cpu": [*SMALL_INIT, *TIN, *BATCH],
    "pretrain/tinyimagenet_vit_gpu": [*GPU1, *SMALL, *TIN, *BATCH],
    "pretrain/imagenette_scratch_cpu": [*SMALL_CONV, *IMAGENETTE, *BATCH],
    "pretrain/imagenet21k_vit_base16": [*DDP2, *SMALL, "--model.model_args.representation_size=32",
                                        "--data.root={imagenet224}", *BATCH],  # fmt: skip
    "pretrain/imagenet21k_vit_large_fsdp": [*DDP2, "--trainer.num_nodes=1", *SMALL,
                                            "--model.model_args.representation_size=32", "--data.root={imagenet224}",
                                            *BATCH],  # fmt: skip
    "finetune/cifar10_vit_tiny_64px_cpu": [*SMALL_CONV, *CIFAR10, *BATCH, *FROM_PRETRAINED],
    "finetune/cifar100_to_cifar10_64px_gpu": [*GPU1, *SMALL_CONV, *CIFAR10, *BATCH, *FROM_PRETRAINED],
    "finetune/imagenette_72px_cpu": [*SMALL_CONV, *IMAGENETTE, *BATCH, *FROM_PRETRAINED],
    "finetune/imagenette_128px_gpu": [*GPU1, *SMALL, *IMAGENETTE, *BATCH, *FROM_PRETRAINED],
    "finetune/imagenette_deit_distill_cpu": [*SMALL_INIT, "--model.init_args.teacher={teacher}", *IMAGENETTE, *BATCH],
    "finetune/imagenet1k_vit_base16_384": [*DDP2, *SMALL, "--trainer.val_check_interval=2",
                                           "--data.root={imagenet384}", *BATCH, *FROM_PRETRAINED],  # fmt: skip
    # The recipe's own init_from (a hub name) stays: the test's HF cache holds a small model under it.
    "finetune/hub_vit_small_cpu": [*SMALL, "--trainer.val_check_interval=2", "--data.root={imagenet256}", *BATCH],
    "finetune/hub_vit_base16_384": [*GPU1, *SMALL, "--trainer.val_check_interval=2", "--data.root={imagenet384}",
                                    *BATCH],  # fmt: skip
}
# The pretraining recipe whose checkpoint each fine-tune recipe starts from (its header's `make finetune CKPT=`).
PRETRAINED_BY = {
    "finetune/cifar10_vit_tiny_64px_cpu": "pretrain/cifar10_vit_tiny_cpu",
    "finetune/cifar100_to_cifar10_64px_gpu": "pretrain/cifar100_vit_gpu",
    "finetune/imagenette_72px_cpu": "pretrain/tinyimagenet_vit_cpu",
    "finetune/imagenette_128px_gpu": "pretrain/tinyimagenet_vit_gpu",
    "finetune/imagenet1k_vit_base16_384": "pretrain/imagenet21k_vit_base16",
}
FSDP = "pretrain/imagenet21k_vit_large_fsdp"


def _key(arg: str) -> str:
    return arg.removeprefix("--").split("=", 1)[0]


def test_every_recipe_has_its_overrides_listed_and_explained() -> None:
    assert set(OVERRIDES) == {recipe_id(p) for p in RECIPES}
    for name, args in OVERRIDES.items():
        unexplained = [a for a in args if _key(a) not in WHY]
        assert not unexplained, f"{name}: overrides without a reason in WHY: {unexplained}"
    assert {_key(a) for a in STEPS} <= set(WHY)


# ---- running a recipe, on data built once per module ---------------------------------------------


@dataclass
class Run:
    """A finished (or failed) `vitlab fit`: its folder, and the error or log when it failed."""

    run_dir: Path
    world_size: int
    error: str | None

    def records(self) -> list[dict[str, Any]]:
        assert self.error is None, f"vitlab fit failed:\n{self.error[-6000:]}"
        return read_records(self.run_dir, self.world_size)


class RecipeRunner:
    """Runs each recipe once per session (a fine-tune reuses its pretraining run's checkpoint)."""

    def __init__(self, root: Path, data: dict[str, Path]) -> None:
        self.root, self.data = root, data
        self.runs: dict[str, Run] = {}

    def args(self, name: str) -> list[str]:
        values = {k: str(v) for k, v in self.data.items()}
        if name in PRETRAINED_BY:
            pre = self.run(PRETRAINED_BY[name])
            assert pre.error is None, f"the pretraining run {PRETRAINED_BY[name]} failed:\n{pre.error[-6000:]}"
            values["pretrained"] = str(pre.run_dir / "checkpoints" / "last.ckpt")
        return [a.format(**values) for a in OVERRIDES[name]]

    def run(self, name: str) -> Run:
        if name in self.runs:
            return self.runs[name]
        run_dir = self.root / name.replace("/", "-")
        recipe = REPO / "recipes" / f"{name}.yaml"
        args = ["fit", "--config", str(recipe), *STEPS, *self.args(name), "--run_dir", str(run_dir)]
        world_size = 2 if DDP2[1] in args else 1
        if world_size == 1:
            error = None
            try:
                main(args)
            except (Exception, SystemExit):  # reported by the test that asks for this run
                error = traceback.format_exc()
        else:  # Lightning's DDP launcher starts rank 1 by re-running the command: a real `vitlab` process
            work = self.root / f"{run_dir.name}-cwd"
            work.mkdir(parents=True)
            rc, log, _, stragglers = run_cli(args, cwd=work, timeout=600)
            error = None if rc == 0 and not stragglers else f"exit code {rc}, stragglers {stragglers}:\n{log}"
        self.runs[name] = Run(run_dir, world_size, error)
        return self.runs[name]


@pytest.fixture(scope="module")
def runner(
    cifar_subset: Path, tinyimagenet_shards: Path, imagenette_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RecipeRunner]:
    """Small data of each recipe's kind and size: CIFAR archives in torchvision's layout (from the shared
    subset), small Tiny-ImageNet and Imagenette shards, ImageNet-style folders, a distillation teacher."""
    root = tmp_path_factory.mktemp("recipes")
    data = {
        "cifar10": fake_cifar(cifar_subset, root / "cifar10", "cifar10", per_class=3),
        "cifar100": fake_cifar(cifar_subset, root / "cifar100", "cifar100", per_class=3),
        "tin": root / "tin",
        "imagenette": small_shards(imagenette_shards / "train", root / "imagenette", 60),
        # ImageNet-style folders at a little over the recipe's size (224 and 384): 2 classes, 4 + 2 photos each
        "imagenet224": image_tree(imagenette_shards / "train", root / "imagenet224", 256, 2, n_train=4, n_val=2),
        "imagenet384": image_tree(imagenette_shards / "train", root / "imagenet384", 416, 2, n_train=4, n_val=2),
        "imagenet256": image_tree(imagenette_shards / "train", root / "imagenet256", 288, 2, n_train=4, n_val=2),
        "teacher": resnet18_teacher(root / "teacher.pth", num_classes=10),
    }
    small_shards(tinyimagenet_shards / "train", root / "tin" / "train", 16)
    small_shards(tinyimagenet_shards / "val", root / "tin" / "val", 8)
    with pytest.MonkeyPatch.context() as mp:
        import torchvision.datasets.cifar
        from huggingface_hub import constants

        # The hub recipes read their sources from this cache, offline (here and in subprocesses).
        cache = hub_cache(root / "hf" / "hub")
        for key, value in {"HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}.items():
            mp.setenv(key, value)
        mp.setattr(constants, "HF_HUB_CACHE", str(cache))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)

        # The CIFAR archives are ours, not the release: torchvision's md5 checks would refuse them.
        mp.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
        # One inductor cache for every compile of the session, in this process and in the DDP ranks.
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor-cache"))
        mp.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
        yield RecipeRunner(root / "runs", data)


# ---- the runs -------------------------------------------------------------------------------------


def _overridden(name: str) -> set[str]:
    return {_key(a) for a in OVERRIDES[name]}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


@pytest.mark.parametrize("recipe", [p for p in RECIPES if recipe_id(p) != FSDP], ids=recipe_id)
def test_recipe_runs_two_steps_on_cpu(recipe: Path, runner: RecipeRunner) -> None:
    name = recipe_id(recipe)
    cfg = yaml.safe_load(recipe.read_text())
    trainer_cfg, model_cfg, data_cfg = cfg.get("trainer", {}), cfg["model"], cfg["data"]
    model_args = model_cfg.get("init_args", model_cfg)
    run = runner.run(name)
    records = run.records()
    overridden = _overridden(name)
    ddp = trainer_cfg.get("strategy") == "ddp"
    for rec in records:
        # What the trainer ran with: the recipe's precision, clipping and strategy, on the CPU.
        assert rec["accelerator"] == "CPUAccelerator"
        assert rec["precision"] == trainer_cfg.get("precision", "32-true")
        assert rec["gradient_clip_val"] == trainer_cfg.get("gradient_clip_val")
        if ddp:
            assert (rec["strategy"], rec["world_size"], rec["backend"]) == ("DDPStrategy", 2, "gloo")
        else:
            assert (rec["strategy"], rec["world_size"]) == ("SingleDeviceStrategy", 1)
        # The recipe's module, optimizer and schedule.
        module_cls = model_cfg.get("class_path", "vitlab.train.ViTClassifier").rsplit(".", 1)[1]
        assert rec["module"] == module_cls
        assert rec["optimizer"] == {"adamw": "AdamW", "sgd": "SGD"}[model_args.get("optimizer", "adamw")]
        assert rec["lr"] == model_args["lr"] and rec["weight_decay"] == model_args["weight_decay"]
        if "betas" in model_args:
            assert rec["betas"] == model_args["betas"]
        if model_args.get("optimizer") == "sgd":
            assert rec["momentum"] == model_args["momentum"]
        assert rec["schedulers"] == ["LambdaLR"]
        compiled = rec["blocks_compiled"] if module_cls == "MaskedPatchPretraining" else rec["model_compiled"]
        assert compiled == model_args.get("compile", False)
        # Every model and data option of the recipe that is not overridden is what the run used.
        for key, value in model_args.items():
            if key == "model_args":
                for k, v in value.items():
                    if not {f"model.model_args.{k}", f"model.init_args.model_args.{k}"} & overridden:
                        assert _same(rec["model_config"][k], v), (k, rec["model_config"][k], v)
            elif key == "init_from" and str(value).startswith("hf-hub:"):  # kept, pinned to the commit read
                assert rec["hparams"][key] == f"{value}@{HUB_COMMIT}", rec["hparams"][key]
            elif not {f"model.{key}", f"model.init_args.{key}"} & overridden:
                assert _same(rec["hparams"][key], value), (key, rec["hparams"][key], value)
        assert rec["model_config"]["img_size"] == [data_cfg["init_args"]["img_size"]] * 2
        assert rec["datamodule"] == data_cfg["class_path"].rsplit(".", 1)[1]
        for key, value in data_cfg["init_args"].items():
            if f"data.{key}" not in overridden:
                assert _same(rec["data_hparams"][key], value), (key, rec["data_hparams"][key], value)
        mixing = data_cfg["init_args"].get("mixup_alpha", 0) > 0 or data_cfg["init_args"].get("cutmix_alpha", 0) > 0
        assert all(len(t) == (2 if mixing else 1) for t in rec["targets"]), rec["targets"]
        # Two steps with finite losses, one validation batch.
        assert rec["global_step"] == 2 and len(rec["losses"]) == 2 and finite(rec["losses"]), rec["losses"]
        assert rec["val_batches"] == 1
    if "teacher" in model_args:
        assert records[0]["teacher"] == "ResNet"
    if name in PRETRAINED_BY:  # started from the pretraining run's weights, resampled to this recipe's grid
        pre_name = PRETRAINED_BY[name]
        pre_cfg = yaml.safe_load((REPO / "recipes" / f"{pre_name}.yaml").read_text())
        pre = runner.run(pre_name).records()[0]
        grids = [c["data"]["init_args"]["img_size"] // records[0]["model_config"]["patch_size"] for c in (pre_cfg, cfg)]
        assert records[0]["init_summary"] == {
            **records[0]["init_summary"],
            "init_from": str(runner.run(pre_name).run_dir / "checkpoints" / "last.ckpt"),
            "pos_embed_grid": f"{grids[0]}x{grids[0]} -> {grids[1]}x{grids[1]}",
            "num_classes": f"{pre['hparams']['num_classes']} -> {records[0]['hparams']['num_classes']}",
        }
        for k in ("patch_size", "embed_dim", "depth", "stem", "class_token", "pool"):
            assert records[0]["model_config"][k] == pre["model_config"][k], k
    ckpt = torch.load(run.run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2


def test_fsdp_recipe_runs_until_lightning_refuses_fsdp_on_cpu(runner: RecipeRunner) -> None:
    """Lightning builds FSDPStrategy only on CUDA; everything before that (the recipe parses, the
    strategy with its wrap and checkpointing policies, the model and data) is built and checked."""
    from lightning.pytorch.strategies import FSDPStrategy

    from vitlab.models.vit import Block

    seen: dict[str, Any] = {}

    class UpToTrainer(VitlabCLI):
        def instantiate_trainer(self, **kwargs: Any) -> Any:
            seen.update(model=self.model, datamodule=self.datamodule, trainer=self.config_init["trainer"])
            return super().instantiate_trainer(**kwargs)

    run_dir = runner.root / "fsdp"
    args = ["--config", str(REPO / "recipes" / f"{FSDP}.yaml"), *STEPS, *runner.args(FSDP), "--run_dir", str(run_dir)]
    refusal = (
        "The strategy `fsdp` requires a GPU accelerator, but received `accelerator='cpu'`. Please set "
        "`accelerator='cuda'`, `accelerator='gpu'`, or pass a `CUDAAccelerator()` instance to use FSDP."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(refusal)}$"):
        UpToTrainer(args=args, run=False)
    strategy = seen["trainer"]["strategy"]
    assert isinstance(strategy, FSDPStrategy)
    # Lightning keeps the recipe's policies as torch's ModuleWrapPolicy over the given classes.
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}  # one FSDP unit per block
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {Block}  # recomputed
    assert strategy.sharding_strategy.name == "FULL_SHARD" and strategy._state_dict_type == "full"
    assert (str(seen["trainer"]["devices"]), seen["trainer"]["num_nodes"]) == ("2", 1)
    assert seen["trainer"]["precision"] == "bf16-mixed" and seen["trainer"]["gradient_clip_val"] == 1.0
    model = seen["model"]
    assert type(model).__name__ == "ViTClassifier" and model.hparams.compile is False
    assert model.model.config["representation_size"] == 32 and model.model.config["drop_rate"] == 0.1
    assert model.model.config["patch_size"] == 16 and model.model.config["img_size"] == [224, 224]


# ---- parsing --------------------------------------------------------------------------------------


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
    assert {"pretrain/tinyimagenet_vit_cpu.yaml", "finetune/imagenette_72px_cpu.yaml", "pretrain/imagenette_scratch_cpu.yaml",
            "pretrain/cifar10_vit_tiny_cpu.yaml", "finetune/cifar10_vit_tiny_64px_cpu.yaml"} <= names


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
    lines = [shlex.split(line) for line in out.stdout.replace("\\\n", " ").splitlines()]
    words = next(w for w in lines if len(w) > 1 and w[0].endswith("vitlab") and w[1] == "fit")
    return words[2:]


@pytest.mark.parametrize(
    "variables, loggers",
    [
        ((), ["HeadlineTensorBoardLogger", "CSVLogger"]),
        (("LOGGER=wandb", "GPUS=2", "NODES=2", "ARGS=--trainer.max_epochs=3"),
         ["HeadlineTensorBoardLogger", "CSVLogger", "WandbLogger"]),
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
            assert cli.model.model.patch_embed.img_size == (72, 72)
