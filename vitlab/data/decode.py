"""Image decoding that fails early and names the file: corrupt, truncated or empty images raise
`BadImageError` here, not a PIL traceback from deep inside a DataLoader worker."""

from __future__ import annotations

import io
import os

from PIL import Image

from vitlab.data.transforms import pil_to_rgb


class BadImageError(RuntimeError):
    """An image file that cannot be decoded; the message names the file (or shard and key)."""


def load_rgb(src: str | os.PathLike | bytes, name: str | None = None) -> Image.Image:
    """Decode an image file (path or bytes) to RGB now; BadImageError names `name` (else the path)."""
    name = name or str(src)
    try:
        with Image.open(io.BytesIO(src) if isinstance(src, bytes) else src) as img:
            img.load()  # lazy PIL would otherwise defer truncation errors to the first transform
            rgb = pil_to_rgb(img)
            return rgb.copy() if rgb is img else rgb  # detached from the file, which closes here
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, zlib.error... per format
        raise BadImageError(f"cannot decode image {name}: {type(exc).__name__}: {exc}") from exc
