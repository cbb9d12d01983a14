"""Credentials from the environment (and string values under credential keys) never reach config.yaml,
saved hyperparameters, checkpoints or log records. Nothing else is rewritten: the record must rerun as given."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import SaveConfigCallback

log = logging.getLogger("vitlab")

REDACTED = "<redacted>"


# Environment variable names that hold credentials (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, DB_PASS,
# MY_SERVICE_KEY, ...). Whole-word matches only: TOKENIZERS_PARALLELISM and PWD are not secrets.
_SECRET_ENV = re.compile(
    r"(?:^|_)(?:API_?KEY|KEY|KEY_?ID|TOKEN|SECRET|PASS|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|ACCESS_?KEY"
    r"|PRIVATE_?KEY|AUTH)(?:_|$)",
    re.IGNORECASE,
)
# Values that are credentials by a provider's documented prefix, whatever the variable is called (Hugging
# Face, GitHub, GitLab, Slack, AWS key ids, JWTs); nothing else by its shape: a commit hash is no secret.
_SECRET_SHAPES = re.compile(
    r"(?:hf|gh[pousr])_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{50,}"
    r"|glpat-[A-Za-z0-9_-]{20,}"
    r"|xox[abposr]-[A-Za-z0-9-]{20,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"
)
# Config keys whose (string) value is a credential ("api_key", "db_password", "hf_token"); class_token,
# mask_token or a tokenizer's pad_token are not.
_SECRET_KEY = re.compile(
    r"(?:^|.*[-_])(?:api[-_]?key|apikey|secret|secret[-_]key|password|passwd|passphrase|credentials?"
    r"|access[-_]?key|private[-_]?key)"
    r"|(?:(?:hf|hub|api|auth|access|bearer|refresh|oauth|github|gh|gitlab|wandb|slack|use[-_]auth)[-_])?token",
    re.IGNORECASE,
)
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^/\s:@]+:)[^@\s/]+@")  # user:password@ inside a URL
# Short values ("1", "true") would redact half of every file; real credentials are longer.
_MIN_SECRET_LEN = 8


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values in `environ` (default: os.environ) that are credentials by their variable's name or by
    their provider's token prefix, longest first."""
    env = os.environ if environ is None else environ
    found = {
        v for k, v in env.items()
        if len(v) >= _MIN_SECRET_LEN and (_SECRET_ENV.search(k) or _SECRET_SHAPES.fullmatch(v.strip()))
    }  # fmt: skip
    return sorted(found, key=len, reverse=True)


def _is_secret_item(key: Any, value: Any) -> bool:
    # Only a string can be a credential: `class_token: false` or `token: null` stay as they are.
    return isinstance(value, str) and bool(value) and isinstance(key, str) and bool(
        _SECRET_KEY.fullmatch(key.rsplit(".", 1)[-1])
    )


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every known secret value and URL password replaced by `<redacted>`."""
    for value in secret_values() if secrets is None else secrets:
        if value and value in text:
            text = text.replace(value, REDACTED)
    return _URL_PASSWORD.sub(rf"\1{REDACTED}@", text)


def redact(obj: Any, secrets: Iterable[str] | None = None) -> Any:
    """A copy of `obj` (dicts, lists, tuples, jsonargparse Namespaces, strings; anything else as is)
    with secret values and the values of secret-looking keys replaced by `<redacted>`."""
    secrets = secret_values() if secrets is None else list(secrets)
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    if isinstance(obj, Mapping):
        out = {k: REDACTED if _is_secret_item(k, v) else redact(v, secrets) for k, v in obj.items()}
        try:
            return type(obj)(out)  # AttributeDict, OrderedDict...
        except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
            return out
    if hasattr(obj, "clone") and hasattr(obj, "items") and callable(getattr(obj, "items")):  # jsonargparse Namespace
        ns = obj.clone()
        for key, value in obj.items():
            ns[key] = REDACTED if _is_secret_item(key, value) else redact(value, secrets)
        return ns
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(redact(v, secrets) for v in obj)
    if isinstance(obj, list):
        return [redact(v, secrets) for v in obj]
    return obj


def keep_argv_out_of_trackers() -> bool:
    """When the command line carries a secret, turn off wandb's metadata (which records `sys.argv`) for this
    process (`WANDB__DISABLE_META`, read when wandb starts) and say so. Returns True when it did."""
    joined = "\n".join(sys.argv[1:])
    if redact_text(joined) == joined:
        return False
    os.environ["WANDB__DISABLE_META"] = "true"
    log.warning(
        "a credential appears on the command line: wandb's system metadata (which records the command line) "
        "is off for this run; pass credentials through the environment instead"
    )
    return True


class SecretLogFilter(logging.Filter):
    """Rewrites log records that contain a secret before any handler writes them."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = list(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is the handler's problem, not ours
            return True
        clean = redact_text(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_LOGGERS = ("", "lightning", "lightning.pytorch", "lightning.fabric", "vitlab")


class RedactSecrets(Callback):
    """Keeps credentials out of everything a run writes: at setup, before config.yaml and the loggers'
    hyperparameters are written, it redacts the save-config callback's config (a copy) and the module's and
    data module's hparams (the objects keep their values), and filters the log handlers.
    `AtomicCheckpointIO` redacts each checkpoint's hyperparameters once more."""

    def __init__(self) -> None:
        self._filter = SecretLogFilter([])
        self._handlers: list[logging.Handler] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        secrets = secret_values()
        for cb in trainer.callbacks:
            if isinstance(cb, SaveConfigCallback):
                cb.config = redact(cb.config, secrets)
        for holder in (pl_module, trainer.datamodule):
            if holder is None:
                continue
            for attr in ("_hparams", "_hparams_initial"):  # hparams_initial is what the loggers record
                hp = getattr(holder, attr, None)
                if isinstance(hp, dict):
                    hp.update(redact(dict(hp), secrets))
        self._remove_filter()
        self._filter = SecretLogFilter(secrets)
        self._handlers = [handler for name in _LOGGERS for handler in logging.getLogger(name).handlers]
        for handler in self._handlers:
            handler.addFilter(self._filter)

    def _remove_filter(self, *args: Any, **kwargs: Any) -> None:  # also the teardown and on_exception hooks
        for handler in self._handlers:
            handler.removeFilter(self._filter)
        self._handlers = []

    on_exception = teardown = _remove_filter
