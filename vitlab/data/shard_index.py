"""Indexes written once so that a start does not read every shard, or walk every folder, again.

Shard index: `shardindex.json` in webdataset's wids format (`__kind__: wids-shard-index-v1`, a
`shardlist` of `{url, nsamples, filesize}`, urls relative to the index's folder), each entry with
vitlab's extras: `mtime_ns`, `max_label` (null when counted without labels) and `val`, the held-out
count per val_fraction (`{"0.02": 103}`). File index: `fileindex.json`, the image files of each
class folder with the folder's mtime.

Each is written beside the data when that folder is writable, else into the user's cache folder
($XDG_CACHE_HOME/vitlab or ~/.cache/vitlab) under a name hashed from the data folder's path. An entry
is used only while its file's size and mtime (a class folder's mtime) are unchanged; a changed or new
shard is counted again and the index updated. Under DDP the DataModule's `prepare_data` (Lightning
runs it on local rank 0 while the other ranks wait at a barrier) writes the index that every rank's
`setup` then reads. `vitlab index-shards DIR` (vitlab.data.shard_counts) writes it ahead, e.g. before a
bucket goes read-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("vitlab.data")

SHARD_INDEX = "shardindex.json"  # wids' default name for a shard index
FILE_INDEX = "fileindex.json"
WIDS_KIND = "wids-shard-index-v1"
FILES_KIND = "vitlab-file-index-v1"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vitlab"


def index_locations(folder: Path, name: str) -> list[Path]:
    """Where `folder`'s index may be: beside the data first, then the cache folder."""
    folder = folder.resolve()
    digest = hashlib.blake2b(str(folder).encode(), digest_size=10).hexdigest()
    return [folder / name, cache_root() / Path(name).stem / f"{folder.name}-{digest}.json"]


def load_index(folder: Path, name: str, kind: str) -> list[dict[str, Any]]:
    """The documents of `folder`'s index found (beside, then cache); unreadable ones are ignored."""
    docs = []
    for path in index_locations(folder, name):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("__kind__") == kind:
            docs.append(doc)
    return docs


def save_index(folder: Path, name: str, doc: dict[str, Any]) -> Path | None:
    """Write `doc` atomically beside the data, else into the cache folder; None when neither is writable."""
    beside, cached = index_locations(folder, name)
    # beside only where writable by us and not marked read-only (no write bit), which root would ignore
    writable = os.access(folder, os.W_OK) and folder.stat().st_mode & 0o222
    for path in ([beside] if writable else []) + [cached]:
        try:
            _write_json(path, doc)
        except OSError:
            continue
        log.info("wrote index %s", path)
        return path
    log.warning("could not write an index for %s (the folder and %s are not writable)", folder, cache_root())
    return None


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.chmod(tmp, 0o644)  # readable by whoever reads the data, not only its writer
        os.replace(tmp, path)  # readers see the old index or the new one, never half of one
    except BaseException:
        os.unlink(tmp)
        raise


# ---- shards ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardCounts:
    total: int
    train: int  # samples whose key hashes outside the held-out fraction
    val: int
    max_label: int


SETTLE_NS = 2_000_000_000  # an mtime this close to now may yet change within the same clock tick


def _settled_mtime(st: os.stat_result) -> int | None:
    """The mtime to record, or None (so the entry is redone next start) when the file or folder changed
    so recently that a further change could keep the same mtime (coarse file-system timestamps)."""
    return st.st_mtime_ns if st.st_mtime_ns < time.time_ns() - SETTLE_NS else None


def _fraction_key(val_fraction: float) -> str:
    return repr(float(val_fraction))


def _from_entry(entry: dict[str, Any], st: os.stat_result, val_fraction: float, labels: bool) -> ShardCounts | None:
    """The entry's counts when it describes this very file and holds what is asked, else None."""
    if entry.get("filesize") != st.st_size or entry.get("mtime_ns") != st.st_mtime_ns:
        return None
    max_label = entry.get("max_label")
    if labels and max_label is None:  # counted without labels: nothing says every sample has one
        return None
    total = entry["nsamples"]
    val = entry.get("val", {}).get(_fraction_key(val_fraction)) if val_fraction > 0 else 0
    if val is None:
        return None
    return ShardCounts(total, total - val, val, max_label if labels else -1)


def _to_entry(
    name: str, st: os.stat_result, counts: ShardCounts, val_fraction: float, labels: bool, old: dict[str, Any] | None
) -> dict[str, Any]:
    same_file = old is not None and old.get("filesize") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns
    val = dict(old.get("val", {})) if same_file else {}  # keep other fractions' counts of the same file
    if val_fraction > 0:
        val[_fraction_key(val_fraction)] = counts.val
    max_label = counts.max_label if labels else (old.get("max_label") if same_file else None)
    return {"url": name, "nsamples": counts.total, "filesize": st.st_size, "mtime_ns": _settled_mtime(st),
            "max_label": max_label, "val": val}  # fmt: skip


def indexed_counts(
    paths: list[str],
    count: Callable[[list[str]], list[ShardCounts]],
    val_fraction: float = 0.0,
    labels: bool = True,
) -> list[ShardCounts]:
    """Counts of local shard files: from the index where it is current, else `count(missing)`, which are
    then written to the index of each folder involved."""
    stats = [os.stat(p) for p in paths]
    names = [Path(p).name for p in paths]
    folders = [Path(os.path.abspath(p)).parent for p in paths]  # a symlinked shard: the link's folder
    docs = {f: [_by_url(doc) for doc in load_index(f, SHARD_INDEX, WIDS_KIND)] for f in set(folders)}
    out: list[ShardCounts | None] = []
    for name, st, folder in zip(names, stats, folders):
        found = (_from_entry(d[name], st, val_fraction, labels) for d in docs[folder] if name in d)
        out.append(next((c for c in found if c is not None), None))
    missing = [i for i, c in enumerate(out) if c is None]
    if missing:
        log.info("counting the samples of %d of %d shards (then indexed for later starts)", len(missing), len(paths))
        for i, counts in zip(missing, count([paths[i] for i in missing])):
            out[i] = counts
    for folder in {folders[i] for i in missing}:
        merged = {k: v for d in reversed(docs[folder]) for k, v in d.items()}  # beside the data wins
        for i in [i for i in missing if folders[i] == folder]:
            n = names[i]
            merged[n] = _to_entry(n, stats[i], out[i], val_fraction, labels, merged.get(n))  # type: ignore[arg-type]
        present = [e for n, e in sorted(merged.items()) if (folder / n).exists()]
        doc = {"__kind__": WIDS_KIND, "wids_version": 1, "name": folder.name, "shardlist": present}
        save_index(folder, SHARD_INDEX, doc)
    return out  # type: ignore[return-value]


def _by_url(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["url"]: e for e in doc.get("shardlist", []) if isinstance(e, dict) and "url" in e and "nsamples" in e}


# ---- image folders -----------------------------------------------------------------------------------


def _walk_images(class_dir: Path, extensions: tuple[str, ...]) -> tuple[list[str], dict[str, int | None]]:
    """Image files under one class folder as torchvision's make_dataset lists them (sorted walk,
    symlinks followed), relative to it, and the mtime of every folder walked."""
    files, mtimes = [], {}
    for dirpath, _, filenames in sorted(os.walk(class_dir, followlinks=True)):
        rel = os.path.relpath(dirpath, class_dir)
        mtimes[rel] = _settled_mtime(os.stat(dirpath))
        files += [os.path.normpath(os.path.join(rel, f)) for f in sorted(filenames) if f.lower().endswith(extensions)]
    return files, mtimes


def _current(entry: dict[str, Any], class_dir: Path) -> bool:
    try:
        return all(os.stat(class_dir / rel).st_mtime_ns == m for rel, m in entry["dirs"].items())
    except (OSError, KeyError, AttributeError):
        return False


def indexed_files(folder: Path, classes: list[str], extensions: tuple[str, ...]) -> dict[str, list[str]]:
    """Per class folder of `folder`, its image files (paths relative to the class folder), from the file
    index where the class's folders' mtimes are unchanged, else walked and written to the index."""
    docs = [doc.get("classes", {}) for doc in load_index(folder, FILE_INDEX, FILES_KIND)]
    known: dict[str, Any] = {k: v for d in reversed(docs) for k, v in d.items()}  # beside the data wins
    out: dict[str, list[str]] = {}
    stale = 0
    for c in classes:
        entry = next((d[c] for d in docs if c in d and _current(d[c], folder / c)), None)
        if entry is not None:
            known[c], out[c] = entry, entry["files"]
            continue
        files, dirs = _walk_images(folder / c, extensions)
        known[c] = {"dirs": dirs, "files": files}
        out[c] = files
        stale += 1
    if stale:
        log.info("listed %d of %d class folders in %s (written to the file index for later starts)",
                 stale, len(classes), folder)  # fmt: skip
        kept = {c: known[c] for c in classes}
        save_index(folder, FILE_INDEX, {"__kind__": FILES_KIND, "extensions": list(extensions), "classes": kept})
    return out


# ---- streamed datasets (Hugging Face) ------------------------------------------------------------------


def indexed_rows(key: dict[str, Any], count: Callable[[], list[int]]) -> list[int]:
    """Rows per shard of a streamed dataset that `key` identifies (its description, split, shard count and
    its local files' mtimes): from the cache folder's index, else `count()`, then written there."""
    text = json.dumps(key, sort_keys=True, default=str)
    path = cache_root() / "streams" / f"{hashlib.blake2b(text.encode(), digest_size=10).hexdigest()}.json"
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no index yet, or an unreadable one
        doc = json.loads(path.read_text())
        if doc.get("key") == json.loads(text):
            return doc["shard_rows"]
    rows = count()
    try:
        _write_json(path, {"key": json.loads(text), "shard_rows": rows})
    except OSError:
        log.warning("could not write the row index %s", path)
    return rows
