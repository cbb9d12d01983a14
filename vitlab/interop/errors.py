"""Errors raised while reading or converting a checkpoint."""

from __future__ import annotations

from vitlab.errors import UserError


class CheckpointError(UserError, ValueError):
    """A file that is not a ViT checkpoint vitlab can load, or one that does not fit together.

    `format` names the layout that was detected (None when none was recognised), so a message can
    say what the file was taken for.
    """

    def __init__(self, message: str, *, format: str | None = None, path: str | None = None) -> None:
        self.format = format
        self.path = path
        where = f" ({path})" if path else ""
        head = f"{format} checkpoint{where}: " if format else (f"checkpoint{where}: " if path else "")
        super().__init__(head + message)


class UnsafeCheckpointError(CheckpointError):
    """A pickle that needs arbitrary Python objects; vitlab never unpickles those."""


class ExportError(UserError, ValueError):
    """The model uses an option the target format cannot express, or the export needs a missing package."""


class SourceError(UserError, OSError):
    """A checkpoint named by a hub repo or a URL that cannot be fetched: offline and not cached, a missing
    or gated repo, a failed or cut-short download. The message names the source, never a token."""
