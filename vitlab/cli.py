"""`vitlab` command line.

Training runs through LightningCLI (`vitlab fit|validate|test --config recipes/...yaml`); the tools
that work on a finished checkpoint are plain subcommands: `predict`, `explain`, `inspect`, `export`,
`resolution` (top-1 against test size); `index-shards` writes a shard folder's index ahead of training;
`pack-shards` writes webdataset shards.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from vitlab.data import ImageDataModule
from vitlab.data.unlabelled import NO_LABELS_FIX
from vitlab.errors import UserError
from vitlab.interop.export import FORMATS
from vitlab.recipe import DEFAULT_MODEL, check_config_args, expand_data_path, import_class
from vitlab.train.run.defaults import add_run_defaults, checkpoint_dir, cpu_precision
from vitlab.train.run.quiet import silence_known_warnings

LoggerName = Literal["tensorboard", "csv", "wandb"]
TOOLS = ("predict", "explain", "inspect", "export")
CKPT_HELP = "a path (any format load_pretrained reads), hf-hub:ORG/NAME[@REVISION] or an https:// URL"
# `--ckpt_path last` resumes from <run_dir>/checkpoints/last.ckpt and fails when there is none;
# `--ckpt_path last-if-present` resumes when it is there and starts fresh when not (Lightning's own "last"
# only warns and starts fresh, which hides a mistyped run_dir behind a run that starts over).
LAST, LAST_IF_PRESENT = "last", "last-if-present"


class SaveRunConfig(SaveConfigCallback):
    """Write the resolved config, every callback and plugin the run adds included (`add_run_defaults`), to
    `<run_dir>/config.yaml` (rank 0); Lightning's own writes it to the first logger's folder."""

    def save_config(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        path = Path(trainer.default_root_dir) / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, str(path), skip_unset=False, overwrite=True)
        rank_zero_info(f"callbacks: {', '.join(type(cb).__name__ for cb in trainer.callbacks)}")


class VitlabCLI(LightningCLI):
    """`model:` may name any LightningModule by `class_path` (e.g. `vitlab.train.MaskedPatchPretraining`);
    a plain section, as every classifier recipe has (`model: {arch: ..., ...}`), configures `ViTClassifier`."""

    resume_from: str | None = None  # the checkpoint the run starts from (`--ckpt_path` resolved)
    _args: list[str] = []  # the command line as parsed

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LightningModule,
            ImageDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=SaveRunConfig,
            save_config_kwargs={"overwrite": True, "save_to_log_dir": False},  # SaveRunConfig writes to run_dir
            seed_everything_default=0,
            parser_kwargs={"default_env": False},
            args=args,
            run=run,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # LightningCLI's own `predict` is left out: `vitlab predict` is the friendly checkpoint tool.
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
        }

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_dir", type=str, default="runs/default", help="Everything the run writes goes here.")
        parser.add_argument(
            "--loggers", type=list[LoggerName], default=["tensorboard", "csv"], help="Experiment trackers to use."
        )
        parser.add_argument(
            "--checkpoint_every_n_steps", type=int | None, default=None,
            help="Also save <run_dir>/checkpoints/last.ckpt every N optimizer steps (a kill loses at most N).",
        )  # fmt: skip
        parser.add_argument(
            "--use_test_size", type=bool, default=True,
            help="validate/test: score at the test size `vitlab resolution` recorded in the checkpoint (false: the "
                 "recipe's size); an explicit --data.init_args.img_size wins.",
        )  # fmt: skip
        parser.link_arguments("run_dir", "trainer.default_root_dir")
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}})  # init_args without a class_path go here
        # The data decides what the model predicts and how its inputs look. A model without one of
        # these arguments is not passed it (MaskedPatchPretraining takes no class count or names).
        parser.link_arguments("data.init_args.img_size", "model.init_args.img_size")
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        parser.link_arguments("data.class_names", "model.init_args.class_names", apply_on="instantiate")
        parser.link_arguments("data.data_config", "model.init_args.data_config", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        model_cls = import_class(cfg.model.class_path, "model.class_path")
        if cfg.get("data.init_args.labels", True) is False and getattr(model_cls, "uses_labels", True):
            raise SystemExit(
                f"error: the data is configured without labels (labels: false) but {model_cls.__name__} "
                f"trains on labels; {NO_LABELS_FIX}"
            )
        add_run_defaults(cfg.trainer, model_cls, cfg.get("checkpoint_every_n_steps"))
        self.resume_from = resolve_ckpt_path(cfg.get("ckpt_path"), cfg.get("run_dir"))
        if cfg.get("ckpt_path") == LAST:  # the record must rerun in a fresh folder too
            cfg["ckpt_path"] = LAST_IF_PRESENT
        if self.subcommand in ("validate", "test") and cfg.get("use_test_size"):
            self._score_at_test_size(cfg)

    def _score_at_test_size(self, cfg: Any) -> None:
        """`vitlab validate|test` of a checkpoint that records a test size score at it, as every other consumer
        of the checkpoint does (the model is built at that size; loading resamples its position embeddings)."""
        from vitlab.interop import recorded_test_size

        ckpt = checkpoint_dir(cfg.get("run_dir") or ".") / "last.ckpt" if self.resume_from == LAST else self.resume_from
        size = recorded_test_size(ckpt) if ckpt else None
        given = {a.split("=")[0] for a in self._args} & {"--data.init_args.img_size", "--data.img_size"}
        if size is None or given or size.img_size[0] != size.img_size[1]:  # the data modules take square sizes
            return
        trained = cfg.get("data.init_args.img_size")
        cfg["data.init_args.img_size"], cfg["data.init_args.crop_pct"] = size.img_size[0], size.crop_pct
        if "img_size" in (cfg.get("model.init_args") or {}):
            cfg["model.init_args.img_size"] = size.img_size[0]
        rank_zero_info(f"{self.subcommand}: at the checkpoint's recorded test size {size} (the recipe's {trained}; "
                       "--use_test_size=false scores at that)")  # fmt: skip

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        cfg = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if "ckpt_path" in cfg:
            cfg["ckpt_path"] = self.resume_from  # what Trainer.fit/validate/test receives

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        args = expand_data_path(list(sys.argv[1:] if args is None else args))
        sub = getattr(self, "_subcommand_parsers", {}).get(args[0]) if args else None
        top_keys = None
        if sub is not None:  # the keys this subcommand's config takes, checkpoint_every_n_steps included
            top_keys = sorted({a.dest.split(".")[0] for a in sub._actions} - {"help", "config", "print_config"})
        check_config_args(args, top_keys)
        self._args = args
        self.config = parser.parse_args(args)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        from vitlab.train.reliability.run_dir import check_run_dir
        from vitlab.train.reliability.redaction import keep_argv_out_of_trackers
        from vitlab.train.run.loggers import run_loggers

        run_dir = Path(self._get(self.config, "run_dir"))
        check_run_dir(run_dir)  # before any logger or callback writes into it
        keep_argv_out_of_trackers()  # before wandb starts and records the command line
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        _check_accelerator(trainer_cfg.get("accelerator"))
        if trainer_cfg.get("logger") in (None, True):
            kwargs["logger"] = run_loggers(run_dir, self._get(self.config, "loggers"), self.resume_from)
        # A bf16 recipe on a CPU without native bf16 trains in 32-true (one log line); config.yaml keeps the recipe's.
        precision = cpu_precision(trainer_cfg.get("precision"), trainer_cfg.get("accelerator"))
        if precision != trainer_cfg.get("precision"):
            kwargs["precision"] = precision
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ImportError) as exc:  # Lightning's own checks of the trainer settings
            raise UserError(f"the trainer settings do not work here: {exc} Fix the recipe's trainer: section "
                            "or the --trainer.* options") from exc  # fmt: skip


def resolve_ckpt_path(ckpt_path: str | None, run_dir: str | None) -> str | None:
    """What Trainer.fit gets for `--ckpt_path`: `last` must find <run_dir>/checkpoints/last.ckpt (a user
    who asked to resume must not silently start over); `last-if-present` resumes from it when it is there."""
    if ckpt_path not in (LAST, LAST_IF_PRESENT):
        return ckpt_path
    last = checkpoint_dir(run_dir or ".") / "last.ckpt"
    if last.is_file():
        return LAST
    if ckpt_path == LAST_IF_PRESENT:
        return None
    raise UserError(
        f"--ckpt_path last: there is no last.ckpt in {last.parent} to resume from; check --run_dir, "
        f"or use --ckpt_path {LAST_IF_PRESENT} to start fresh when there is none"
    )


def _check_accelerator(accelerator: Any) -> None:
    """`--trainer.accelerator=gpu` (what `make ... GPUS=N` passes) needs a GPU torch can use."""
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(
            f"--trainer.accelerator={accelerator}: this machine has no CUDA GPU that torch can use "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); run on a GPU machine, or drop "
            "GPUS=/--trainer.accelerator to train on the CPU (accelerator auto)"
        )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _tool_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitlab", description="vitlab checkpoint tools")
    sub = parser.add_subparsers(dest="tool", required=True)
    p = sub.add_parser("predict", help="print the top-k classes for images")
    p.add_argument("--ckpt", required=True, help=CKPT_HELP)
    p.add_argument("--topk", type=_positive_int, default=5)
    p.add_argument("images", nargs="+")
    p = sub.add_parser("explain", help="attention rollout heat-map and top-5 predictions for one image")
    p.add_argument("--ckpt", required=True, help=CKPT_HELP)
    p.add_argument("--image", required=True)
    p.add_argument("--out", default=None, help="output PNG (default: <image>_explain.png)")
    p = sub.add_parser("inspect", help="attention distance, position-embedding similarity and filter figures")
    p.add_argument("--ckpt", required=True, help=CKPT_HELP)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--images", nargs="*", default=None, help="images for the attention-distance figure")
    p = sub.add_parser("export", help="write a checkpoint for vitlab, HF transformers, timm or ONNX Runtime")
    p.add_argument("--ckpt", required=True, help=CKPT_HELP)
    p.add_argument("--format", choices=FORMATS, default="vitlab",
                   help="vitlab: model.safetensors + config.json; hf: a ViTForImageClassification folder; "
                        "timm: a timm hub folder; onnx: model.onnx (needs pip install 'vitlab[onnx]')")  # fmt: skip
    p.add_argument("--out", required=True, help="output folder")
    return parser


def run_tool(argv: list[str]) -> int:
    args = _tool_parser().parse_args(argv)
    if args.tool == "export":
        from vitlab.interop import export

        print(export(args.ckpt, args.format, args.out))
        return 0
    from vitlab.analysis import commands

    if args.tool == "predict":
        commands.print_predictions(commands.predict(args.ckpt, args.images, topk=args.topk), args.images)
    elif args.tool == "explain":
        print(commands.explain(args.ckpt, args.image, args.out))
    elif args.tool == "inspect":
        print(*commands.inspect(args.ckpt, args.out, images=args.images), sep="\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `vitlab` command. From the command line (`argv` None) a user error (`is_user_error`) prints
    one line with its fix and returns 1, with the traceback only under `VITLAB_DEBUG=1`; called with
    `argv` (scripts, tests) every exception propagates."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        return _run(argv)
    except Exception as exc:
        reported = user_error(exc)
        if not from_command_line or os.environ.get("VITLAB_DEBUG") == "1" or reported is None:
            raise
        print(f"vitlab: error: {reported}\n(VITLAB_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


def _run(argv: list[str]) -> int:
    silence_known_warnings()  # every subcommand: `vitlab resolution` runs Lightning and loaders too
    if argv and argv[0] == "resolution":
        from vitlab.analysis.resolution import main as resolution_main

        return resolution_main(argv[1:])
    if argv and argv[0] == "index-shards":
        from vitlab.data.shards import index_shards_main

        return index_shards_main(argv[1:])
    if argv and argv[0] == "pack-shards":
        from vitlab.data.pack import main as pack_main

        return pack_main(argv[1:])
    if argv and argv[0] in TOOLS:
        return run_tool(argv)
    try:
        VitlabCLI(args=argv)
    except BaseException:
        _finish_wandb(failed=True)
        raise
    # Lightning destroys NCCL process groups at exit, not gloo ones, and a gloo group left to the interpreter's
    # shutdown can abort a run that ended well (SIGABRT); a failed run keeps its group, so other ranks see it fail.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _finish_wandb(failed=False)
    return 0


_SOURCE = Path(__file__).resolve().parent
# The built-in types vitlab's modules raise for bad input (a bad value, a missing folder, an
# unwritable run folder, data that is not there); each carries a message written for the user.
_REPORTED_BUILTINS = (ValueError, OSError, RuntimeError)


def user_error(exc: BaseException) -> BaseException | None:
    """The user error behind `exc`: itself or the first exception it was raised from (the CLI's
    argument parser re-raises a failed constructor's error as its own) that `is_user_error`."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if is_user_error(current):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def is_user_error(exc: BaseException) -> bool:
    """A `UserError`, or one of `_REPORTED_BUILTINS` raised by vitlab's own code; the same type raised
    inside a library (torch, Lightning) is unexpected and keeps its traceback."""
    if isinstance(exc, UserError):
        return True
    if not isinstance(exc, _REPORTED_BUILTINS) or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:  # the frame that raised it
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_SOURCE)


def _finish_wandb(failed: bool) -> None:
    """Close the wandb run: Lightning's WandbLogger would reuse an open one in the next `main()` call."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
