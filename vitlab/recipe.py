"""Recipes and data paths, read before LightningCLI parses them: `--data_path DATA` expanded into the data
module that reads DATA, and a recipe checked for typos and unreadable YAML with one-line errors."""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from lightning.pytorch import Trainer

from vitlab.data.shards import SHARD_SUFFIXES, read_classes_txt
from vitlab.errors import UserError
from vitlab.models import VisionTransformer

DEFAULT_MODEL = "vitlab.train.ViTClassifier"  # the LightningModule of a `model:` section without a class_path
# The top-level keys of a `fit` config (the subcommand parser's own list is used where it is at hand).
TOP_KEYS = ["seed_everything", "trainer", "model", "data", "run_dir", "loggers", "checkpoint_every_n_steps",
            "optimizer", "lr_scheduler", "ckpt_path", "weights_only"]  # fmt: skip


def data_args(path: str) -> list[str]:
    """`--data_path P` as the flags LightningCLI takes: `--data=CLASS --data.ARG=VALUE...`."""
    class_path, args = data_module(path)
    return [f"--data={class_path}", *(f"--data.{k}={'null' if v is None else v}" for k, v in args.items())]


def data_module(path: str) -> tuple[str, dict[str, str | None]]:
    """The DataModule reading `path` (shards, an image folder, a CIFAR name): its class path and location."""
    if path in ("cifar10", "cifar100"):
        return "vitlab.data.CIFARDataModule", {"variant": path}
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"DATA path {path!r} does not exist; {DATA_LAYOUTS}")
    if p.is_file() and not p.name.endswith(SHARD_SUFFIXES):
        raise SystemExit(f"DATA path {path!r} is a file that is not a shard; {DATA_LAYOUTS}")
    train, val = path, None
    if p.is_dir() and not _has_shards(p):
        if not _has_shards(p / "train"):
            return "vitlab.data.ImageFolderDataModule", {"root": path}
        train, val = p / "train", next((p / d for d in ("val", "validation") if (p / d).is_dir()), None)
        if val is not None:
            if not _has_shards(val):
                raise SystemExit(
                    f"{train} holds shards but {val} does not; put the validation shards there, or remove {val}"
                )
            _check_same_classes(train, val)
    # Shards without a val/ folder beside them: a held-out split (--data.val_fraction), whatever the recipe named.
    return "vitlab.data.ShardDataModule", {"train_shards": str(train), "val_shards": str(val) if val else None}


DATA_LAYOUTS = (
    "give an image folder (train/<class>/*.jpg with val/<class>/*.jpg, and test/<class>/*.jpg for `vitlab test`; "
    "or <class>/*.jpg), "
    "a folder of webdataset shards (*.tar / *.tar.gz holding KEY.jpg + KEY.cls, with classes.txt), "
    "a folder with train/ and val/ folders of such shards, or 'cifar10' / 'cifar100'"
)


def _has_shards(folder: Path) -> bool:
    return folder.is_dir() and any(f.name.endswith(SHARD_SUFFIXES) for f in folder.iterdir())


def _check_same_classes(train: Path, val: Path) -> None:
    """train/classes.txt and val/classes.txt, where both exist, must list the same classes in the same order."""
    names = [read_classes_txt(d / "classes.txt") for d in (train, val)]
    if None not in names and names[0] != names[1]:
        diff = next(i for i, (a, b) in enumerate(zip(*names, strict=False)) if a != b) if len(names[0]) == len(names[1]) else None
        where = f"line {diff + 1}: {names[0][diff]!r} vs {names[1][diff]!r}" if diff is not None else (
            f"{len(names[0])} vs {len(names[1])} classes")
        raise SystemExit(
            f"{train}/classes.txt and {val}/classes.txt differ ({where}); the labels in both splits must index "
            "one class list: copy train/classes.txt to val/ if the labels agree, or rebuild the validation shards"
        )


def expand_data_path(argv: list[str]) -> list[str]:
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--data_path":
            out += data_args(next(it))
        elif arg.startswith("--data_path="):
            out += data_args(arg.split("=", 1)[1])
        else:
            out.append(arg)
    return out


def _inits(cls: type) -> list[Any]:
    """The constructors of `cls` and of the bases it passes `**kwargs` on to, nearest first."""
    inits = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        inits.append(init)
        if not any(p.kind == p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
            break
    return inits


def init_params(cls: type) -> list[str]:
    """Constructor argument names of a class and, through `**kwargs`, of its bases."""
    names = [p.name for init in _inits(cls) for p in inspect.signature(init).parameters.values()
             if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]  # fmt: skip
    return list(dict.fromkeys(names))


def literal_choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The constructor arguments of `cls` (and, through `**kwargs`, of its bases) typed as a `Literal`,
    with their choices."""
    choices: dict[str, tuple[Any, ...]] = {}
    for init in _inits(cls):
        try:
            hints = typing.get_type_hints(init)
        except (NameError, TypeError):  # an annotation only a type checker resolves: no choices read
            hints = {}
        for name, hint in hints.items():
            if typing.get_origin(hint) is Literal:
                choices.setdefault(name, typing.get_args(hint))
    return choices


def _reject_choice(where: str, key: str, value: Any, choices: tuple[Any, ...]) -> None:
    """jsonargparse rejects a value outside a `Literal` too, but for `model:` (a class_path union) in ten lines."""
    if value not in choices and str(value) not in map(str, choices):
        names = [str(c) for c in choices]
        close = difflib.get_close_matches(str(value), names, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise SystemExit(f"error: {where}.{key}={value}: not a valid choice; {hint}choose one of {', '.join(names)}")


def _reject_unknown(where: str, keys: Any, valid: list[str], flag: str | None = None) -> None:
    """jsonargparse rejects unknown keys too, but names no close match, and for `model:` (a class_path
    union) prints ten lines of "Does not validate against any of the Union subtypes"; hence this check.
    `flag`: the command-line prefix (`--model.`) the suggestion is written with."""
    for key in keys or {}:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = (f"did you mean {flag or ''}{close[0]}? " if flag else f"did you mean {close[0]!r}? ") if close else ""
            raise SystemExit(f"error: unknown key {where}.{key}; {hint}valid keys: {', '.join(valid)}")


def import_class(class_path: str, where: str) -> type:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SystemExit(
            f"error: {where} {class_path!r} cannot be imported ({exc}); give the full dotted path, "
            f"e.g. {DEFAULT_MODEL} or vitlab.train.MaskedPatchPretraining"
        ) from None


def check_recipe(path: str, top_keys: list[str] | None = None) -> None:
    """Reject a recipe that cannot be read, and recipe typos early, naming the key and listing the valid ones
    (`top_keys`: the parser's top-level keys; default `TOP_KEYS`)."""
    cfg = read_recipe(path)
    _reject_unknown(path, cfg, top_keys or TOP_KEYS)
    _reject_unknown(f"{path}: trainer", cfg.get("trainer"), init_params(Trainer))
    model = cfg.get("model") or {}
    if isinstance(model, dict) and "class_path" in model:  # a named LightningModule: check its own arguments
        _reject_unknown(f"{path}: model", model, ["class_path", "init_args"])
        model_cls = import_class(model["class_path"], f"{path}: model.class_path")
        where, model = f"{path}: model.init_args", model.get("init_args") or {}
    else:
        model_cls, where = import_class(DEFAULT_MODEL, "model"), f"{path}: model"
    params = init_params(model_cls)
    _reject_unknown(where, model, params)
    for key, choices in literal_choices(model_cls).items():
        if key in model:
            _reject_choice(where, key, model[key], choices)
    if "model_args" in params:  # the encoder's constructor arguments, as ViTClassifier takes them
        _reject_unknown(f"{where}.model_args", model.get("model_args"), init_params(VisionTransformer))
    data = cfg.get("data") or {}
    if isinstance(data, dict) and isinstance(data.get("class_path"), str):
        data_cls = import_class(data["class_path"], f"{path}: data.class_path")
        _reject_unknown(f"{path}: data.init_args", data.get("init_args"), init_params(data_cls))


def read_recipe(path: str) -> dict[str, Any]:
    """The recipe at `path` as a mapping, or a one-line error saying why it cannot be one."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        folder = Path(path).parent
        near = {p.stem: p for p in folder.rglob("*.yaml")} if folder.is_dir() else {}
        close = difflib.get_close_matches(Path(path).stem, list(near), n=1, cutoff=0.6)
        hint = f"did you mean {near[close[0]]}? " if close else ""
        raise UserError(f"--config {path}: no such file; {hint}give the path of a YAML recipe, "
                        "e.g. recipes/pretrain/*.yaml") from None  # fmt: skip
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as exc:
        raise UserError(f"--config {path}: cannot be read as a YAML recipe ({exc}); give a recipe file") from None
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"--config {path}: not valid YAML ({where}{problem}); fix the recipe there") from None
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise UserError(f"--config {path}: a recipe is a YAML mapping (trainer:, model:, data:, ...), "
                        f"not a {type(cfg).__name__}")  # fmt: skip
    return cfg


def check_config_args(argv: list[str], top_keys: list[str] | None = None) -> None:
    """The recipes (`--config`) and the `--model.KEY` options of a command line, checked for unknown keys."""
    model_class = DEFAULT_MODEL
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg in ("-c", "--config") and i + 1 < len(argv) else None
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else path
        if path is not None:
            check_recipe(path, top_keys)
            model = read_recipe(path).get("model")
            if isinstance(model, dict) and isinstance(model.get("class_path"), str):
                model_class = model["class_path"]
        elif arg.startswith(("--model=", "--model.class_path=")):
            model_class = arg.split("=", 1)[1]
    # `--model.KEY=VALUE` as (KEY, "=" or "", VALUE)
    model_args = [arg.removeprefix("--model.").removeprefix("init_args.").partition("=")
                  for arg in argv if arg.startswith("--model.")]  # fmt: skip
    model_keys = [key.split(".") for key, _, _ in model_args]
    if not model_keys or model_class.lstrip().startswith(("{", "[")):  # an inline YAML model: jsonargparse checks it
        return
    model_cls = import_class(model_class, "--model")
    params, choices = init_params(model_cls), literal_choices(model_cls)
    for key, eq, value in model_args:
        if eq and key in choices:
            _reject_choice("--model", key, value, choices[key])
    for key in model_keys:
        if key[0] in ("class_path", "init_args", "help"):
            continue
        _reject_unknown("--model", [key[0]], params, flag="--model.")
        if key[0] == "model_args" and len(key) > 1 and "model_args" in params:
            _reject_unknown("--model.model_args", [key[1]], init_params(VisionTransformer), flag="--model.model_args.")
