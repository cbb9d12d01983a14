"""Public checkpoints by name: `hf-hub:ORG/NAME[@REVISION]` and `https://...` weight files.

`resolve_source` turns what a user typed wherever vitlab takes a checkpoint (`load_pretrained`,
`model.init_from`, `vitlab predict|explain|inspect|export --ckpt`, the distillation teacher) into a
local file, and says what it resolved to:

- `hf-hub:ORG/NAME[@REVISION]` (timm's spelling): `config.json`, `preprocessor_config.json` and
  `model.safetensors` (else `pytorch_model.bin`) of one commit, through huggingface_hub into its
  standard cache (`HF_HUB_CACHE` / `HF_HOME`), read from there afterwards, offline too
  (`HF_HUB_OFFLINE=1`). Token: huggingface_hub's (`HF_TOKEN`, `hf auth login`).
- `http(s)://.../NAME.{npz,pth,bin,safetensors}`: downloaded once into
  `torch.hub.get_dir()/checkpoints/<hash of the URL>/NAME` (one folder per URL: Google's
  `imagenet21k/ViT-B_16.npz` and `imagenet21k+imagenet2012/ViT-B_16.npz` share a file name).
  A sha256 is checked where the file name carries a prefix (torch hub's `NAME-<hex>.pth`) or the
  URL ends in `#sha256=<hex>`.

`Resolved.pinned` names exactly what was read (`hf-hub:ORG/NAME@<commit>`, `URL#sha256=<hex>`):
the training module records it as `init_from`, so a run repeats on the same weights.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitlab.interop.errors import SourceError

HUB_PREFIX = "hf-hub:"
# Weight files of a hub repo in the order they are tried (timm and transformers write both names).
HUB_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# Read when the repo has them: the architecture and labels, the transformers image processor.
HUB_SIDECARS = ("config.json", "preprocessor_config.json")
URL_SUFFIXES = (".npz", ".pth", ".pt", ".bin", ".safetensors")
_HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.[^.]+$")  # torch hub: resnet18-f37072fd.pth
_STALE_PART_S = 600  # a `.part` file untouched this long belongs to a download that died
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Resolved:
    """A checkpoint source and the local file it resolved to."""

    path: Path  # the weights file (or, for a local source, what the user gave)
    source: str  # as given
    pinned: str  # the source naming exactly these weights: commit for a hub repo, sha256 for a URL
    revision: str | None = None  # hub commit or URL sha256; None for a local path
    label: str | None = None  # how messages name it (the repo or URL, not a cache path)


def is_remote(source: str | os.PathLike[str]) -> bool:
    return str(source).startswith((HUB_PREFIX, "https://", "http://"))


def resolve_source(source: str | os.PathLike[str]) -> Resolved:
    """A local path as it is; a hub repo or a URL fetched (or found in its cache) and pinned."""
    text = str(source)
    if text.startswith(HUB_PREFIX):
        return _resolve_hub(text)
    if text.startswith(("https://", "http://")):
        return _resolve_url(text)
    return Resolved(Path(text).expanduser(), text, text)


# ---- Hugging Face Hub ------------------------------------------------------------------------------


def parse_hub(source: str) -> tuple[str, str | None]:
    """`hf-hub:ORG/NAME[@REVISION]` -> (repo id, revision or None)."""
    repo, _, revision = source[len(HUB_PREFIX) :].partition("@")
    if not repo or repo.count("/") > 1 or any(c.isspace() for c in repo):
        raise SourceError(f"{source!r} is not a hub name; write hf-hub:ORG/NAME or hf-hub:ORG/NAME@REVISION")
    return repo, revision or None


def _resolve_hub(source: str) -> Resolved:
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    repo, revision = parse_hub(source)
    label = f"{HUB_PREFIX}{repo}" + (f"@{revision}" if revision else "")
    found: dict[str, Path] = {}
    not_cached = False
    for name in (*HUB_SIDECARS, *HUB_WEIGHTS):
        if name in HUB_WEIGHTS and any(w in found for w in HUB_WEIGHTS):
            break
        try:
            path = _hub_file(repo, name, revision)
        except LocalEntryNotFoundError:  # not cached, and offline or the Hub is out of reach
            if not found and not _offline():  # unreachable: each further file would wait out its timeout too
                raise _offline_miss(repo, label) from None
            not_cached = True
            continue
        except EntryNotFoundError:  # the repo has no such file
            continue
        except Exception as e:  # noqa: BLE001 - every other failure becomes one line naming the repo
            raise _hub_error(e, repo, label) from None
        if path is None:
            continue
        found[name] = path
        revision = path.parent.name  # snapshots/<commit>/<name>: every later file from the same commit
    weights = next((found[w] for w in HUB_WEIGHTS if w in found), None)
    if weights is None:
        if not_cached:
            raise _offline_miss(repo, label)
        raise SourceError(
            f"{label}: the repository holds no {' or '.join(HUB_WEIGHTS)}: not a ViT checkpoint vitlab reads "
            "(a timm or transformers ViT / DeiT repo has one)"
        )
    commit = weights.parent.name
    return Resolved(weights, source, f"{HUB_PREFIX}{repo}@{commit}", commit, f"{HUB_PREFIX}{repo}@{commit[:12]}")


def _hub_file(repo: str, name: str, revision: str | None) -> Path | None:
    """One file of the repo from the cache, else downloaded; None where the cache records it missing."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    if revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision):  # a commit: read the cache first
        cached = try_to_load_from_cache(repo, name, revision=revision)
        if isinstance(cached, str):
            return Path(cached)
        if cached is not None:  # huggingface_hub's marker: the commit has no such file
            return None
    return Path(hf_hub_download(repo, name, revision=revision))


def peek_hub_config(config_json: Path) -> dict[str, Any] | None:
    """Input size, patch size, class count and distillation of a hub repo's model, from its timm or
    transformers `config.json`, for the init log; None where it does not say."""
    try:
        cfg = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    if "architecture" in cfg:  # timm
        pc = cfg.get("pretrained_cfg") if isinstance(cfg.get("pretrained_cfg"), dict) else cfg
        args = cfg.get("model_args") if isinstance(cfg.get("model_args"), dict) else {}
        match = re.search(r"patch(\d+)", str(cfg["architecture"]))
        patch = args.get("patch_size") or (int(match.group(1)) if match else None)
        size = pc.get("input_size")
        if not patch or not (isinstance(size, list) and len(size) == 3):
            return None
        return {"img_size": size[1:], "patch_size": int(patch), "num_classes": int(cfg.get("num_classes", 0)),
                "distilled": "distilled" in str(cfg["architecture"])}  # fmt: skip
    if cfg.get("model_type") in ("vit", "deit") and "image_size" in cfg and "patch_size" in cfg:  # transformers
        architectures = [str(a) for a in cfg.get("architectures") or []]
        classifies = any(a.endswith(("ForImageClassification", "WithTeacher")) for a in architectures)
        size = cfg["image_size"]
        return {"img_size": [size, size] if isinstance(size, int) else list(size), "patch_size": int(cfg["patch_size"]),
                "num_classes": len(cfg.get("id2label") or {}) if classifies else 0,
                "distilled": any(a.endswith("WithTeacher") for a in architectures)}  # fmt: skip
    return None


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _offline_miss(repo: str, label: str) -> SourceError:
    from huggingface_hub import constants

    why = "downloads are off (HF_HUB_OFFLINE=1)" if _offline() else "the Hub cannot be reached"
    return SourceError(
        f"{label} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: run "
        f"`hf download {repo}` (or `huggingface-cli download`) where the Hub is reachable, or give a local path"
    )


def _hub_error(exc: Exception, repo: str, label: str) -> SourceError:
    from huggingface_hub import errors

    status = getattr(getattr(exc, "response", None), "status_code", None)
    detail = _first_line(exc)
    # The first that matches: the specific Hub errors subclass HfHubHTTPError.
    for kind, why in (
        (errors.GatedRepoError, f" is gated: accept its terms on https://huggingface.co/{repo} and set HF_TOKEN "
                                "(or run `hf auth login`) to a token of that account"),
        (errors.RevisionNotFoundError, ": the repository has no such revision (a branch, tag or commit hash)"),
        (errors.RepositoryNotFoundError, f": no such repository on the Hub ({status or 404}); check ORG/NAME, or "
                                         "set HF_TOKEN if it is private"),
        (errors.DisabledRepoError, ": the repository is disabled on the Hub"),
        (errors.HFValidationError, f": not a valid repository name ({detail})"),
        (errors.HfHubHTTPError if status in (401, 403) else (), f": the Hub refused access ({status}); set HF_TOKEN "
                                                               "to a valid token"),
        (errors.HfHubHTTPError, f": the Hub answered {status or 'an error'} ({detail})"),
        (OSError, f": cannot download ({type(exc).__name__}: {detail})"),
    ):  # fmt: skip
        if isinstance(exc, kind):
            return SourceError(label + why)
    raise exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---- URLs ------------------------------------------------------------------------------------------


def display_url(url: str) -> str:
    """The URL without credentials or query (which may hold a signature) for messages."""
    p = urllib.parse.urlsplit(url)
    host = p.hostname or ""
    port = f":{p.port}" if p.port else ""
    return f"{p.scheme}://{host}{port}{p.path}"


def _resolve_url(source: str) -> Resolved:
    import torch

    url, _, fragment = source.partition("#")
    name = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    label = display_url(url)
    if not name.lower().endswith(URL_SUFFIXES):
        raise SourceError(f"{label}: not a weights file vitlab reads; the URL must end in {', '.join(URL_SUFFIXES)}")
    expected = _expected_hash(fragment, name, label)
    plain, auth = _split_credentials(url)
    folder = Path(torch.hub.get_dir()) / "checkpoints" / hashlib.sha256(plain.encode()).hexdigest()[:16]
    dst = folder / name
    if dst.is_file():
        digest = _digest_of(dst)
        if expected and not digest.startswith(expected):
            raise SourceError(
                f"{label}: the cached file {dst} hashes to sha256 {digest[:16]}..., not {expected[:16]}...; "
                "delete it to download again"
            )
    else:
        if _offline():
            raise SourceError(
                f"{label} is not in the download cache ({folder}) and downloads are off (HF_HUB_OFFLINE=1); "
                "download it where the network is reachable, or give a local path"
            )
        digest = _download(plain, auth, dst, expected, label)
    return Resolved(dst, source, f"{url}#sha256={digest}", digest, label)


def _split_credentials(url: str) -> tuple[str, str | None]:
    """`scheme://user:password@host/...` -> (the URL without them, a Basic Authorization header)."""
    p = urllib.parse.urlsplit(url)
    if p.username is None:
        return url, None
    host = (p.hostname or "") + (f":{p.port}" if p.port else "")
    user = urllib.parse.unquote(p.username) + ":" + urllib.parse.unquote(p.password or "")
    return urllib.parse.urlunsplit(p._replace(netloc=host)), "Basic " + base64.b64encode(user.encode()).decode()


def _expected_hash(fragment: str, name: str, label: str) -> str | None:
    if fragment:
        m = re.fullmatch(r"sha256=([0-9a-fA-F]{8,64})", fragment)
        if not m:
            raise SourceError(f"{label}: the URL fragment #{fragment} is not #sha256=<hex digest or its prefix>")
        return m.group(1).lower()
    m = _HASH_IN_NAME.search(name)
    return m.group(1) if m else None


def _digest_of(path: Path) -> str:
    """The sha256 of a cached file; remembered beside it, since a ViT-L file takes seconds to hash."""
    memo = path.with_name(path.name + ".sha256")
    if memo.is_file() and memo.stat().st_mtime >= path.stat().st_mtime:
        return memo.read_text().strip()
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    _write_atomic(memo, digest)
    return digest


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".part")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _download(url: str, auth: str | None, dst: Path, expected: str | None, label: str) -> str:
    """Stream into a temporary file beside `dst`, check its length and hash, rename into place.

    `torch.hub.download_url_to_file` (torch 2.x) does the same temp-file-and-move, but cannot serve here:
    its request carries a fixed `User-Agent` header only (no Authorization, so a URL's credentials could
    not be sent), it hashes only when given a `hash_prefix` (a pinned source needs the digest of every
    download), and it never compares the body with Content-Length (http.client's `read` returns a cut
    body short, without error: a half file would be cached). What is added to its loop is those three.
    Any failure removes the temporary file, so the cache holds whole files only and the next run starts over.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_parts(dst)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=dst.name + ".", suffix=".part")
    try:
        h, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as f:
            headers = {"User-Agent": "vitlab", **({"Authorization": auth} if auth else {})}
            request = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(request, timeout=60) as response:
                length = response.headers.get("Content-Length")
                while chunk := response.read(_CHUNK):
                    f.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
        if length is not None and size != int(length):
            raise SourceError(f"{label}: the download stopped after {size} of {length} bytes; run again to retry")
        digest = h.hexdigest()
        if expected and not digest.startswith(expected):
            raise SourceError(
                f"{label}: the download hashes to sha256 {digest[:16]}..., not the expected {expected[:16]}... "
                "(cut short or changed on the server); nothing was kept, run again to retry"
            )
        os.replace(tmp, dst)
        _write_atomic(dst.with_name(dst.name + ".sha256"), digest)
        return digest
    except urllib.error.HTTPError as e:
        hint = "; set the URL's credentials or download it yourself" if e.code in (401, 403) else ""
        raise SourceError(f"{label}: the server answered {e.code} {e.reason}{hint}") from None
    except (OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or _first_line(e)
        raise SourceError(f"{label}: cannot download ({reason}); check the network, or give a local path") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _remove_stale_parts(dst: Path) -> None:
    """Temporary files a killed download left (a live download writes to its own every few ms)."""
    for part in dst.parent.glob(f"{dst.name}.*.part"):
        with contextlib.suppress(OSError):  # another process removed or renamed it meanwhile
            if time.time() - part.stat().st_mtime > _STALE_PART_S:
                part.unlink()
