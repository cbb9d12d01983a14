"""Indexed starts (vitlab.data.shard_index): shard counts and image-file lists read once, then from the index.

Bytes read are the kernel's count for this process (/proc/self/io rchar), not vitlab's own.
Everything runs on small shards and trees generated here.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from vitlab.data import ImageFolderDataModule, ShardDataModule
from vitlab.data import shard_index
from vitlab.data.shard_counts import index_shards_main

SMALL = dict(img_size=32, batch_size=4, num_workers=0, train_crop="pad", crop_pct=1.0, auto_augment=None)
COUNTS = [30, 30, 30, 17]  # samples per generated shard
PROC_IO = Path("/proc/self/io")


def rchar() -> int:
    """Bytes this process has read through read() system calls (the kernel's count, cache hits included)."""
    return int(dict(line.split(": ") for line in PROC_IO.read_text().splitlines())["rchar"])


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache folder: no test sees another's (or the user's) indexes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if not PROC_IO.exists():
        pytest.skip("bytes read are measured with /proc/self/io (Linux)")
    return tmp_path / "xdg"


def settle(*paths: Path) -> None:
    """Date files/folders 10 s back, as data written before the run would be (fresh mtimes are not trusted)."""
    t = time.time_ns() - 10_000_000_000
    for p in paths:
        os.utime(p, ns=(t, t))


def noise_png(rng: np.random.Generator, size: int = 40) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_shard(path: Path, n: int, start: int, rng: np.random.Generator, num_classes: int = 3) -> None:
    with wds.TarWriter(str(path)) as sink:
        for k in range(start, start + n):
            sink.write({"__key__": f"s{k:05d}", "png": noise_png(rng), "cls": str(k % num_classes)})


def make_shards(folder: Path, counts: list[int] = COUNTS, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    start = 0
    for i, n in enumerate(counts):
        write_shard(folder / f"part-{i:06d}.tar", n, start, rng)
        start += n
    (folder / "classes.txt").write_text("a\nb\nc\n")
    settle(*folder.iterdir())
    return folder


def shard_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.tar"))


def held_out(keys: list[str], fraction: float) -> int:
    """Keys whose blake2b-64 hash falls below fraction * 2^64: the held-out rule, written out."""
    digests = (hashlib.blake2b(k.encode(), digest_size=8).digest() for k in keys)
    return sum(int.from_bytes(d, "big") < fraction * 2.0**64 for d in digests)


def start(folder: Path, **kw) -> tuple[ShardDataModule, int]:
    """A fresh DataModule's setup('fit'); returns it and the bytes read during setup."""
    dm = ShardDataModule(str(folder), **{**SMALL, **kw})
    before = rchar()
    dm.setup("fit")
    return dm, rchar() - before


def batch_counts(dm: ShardDataModule) -> tuple[int, int, int]:
    loader = dm.train_dataloader()
    return len(loader), sum(1 for _ in loader), sum(1 for _ in dm.val_dataloader())


# ---- shards ------------------------------------------------------------------------------------------


def test_index_is_written_in_wids_format_and_a_later_start_reads_under_5_percent(tmp_path: Path) -> None:
    folder = make_shards(tmp_path / "shards")
    total = shard_bytes(folder)
    first, read_first = start(folder, val_fraction=0.2)
    assert read_first >= total  # the unindexed start reads every shard

    doc = json.loads((folder / "shardindex.json").read_text())
    assert doc["__kind__"] == "wids-shard-index-v1" and doc["wids_version"] == 1
    keys = [f"s{k:05d}" for k in range(sum(COUNTS))]
    bounds = np.cumsum([0, *COUNTS])
    for i, entry in enumerate(doc["shardlist"]):
        path = folder / entry["url"]
        assert entry["url"] == f"part-{i:06d}.tar" and entry["nsamples"] == COUNTS[i]
        assert entry["filesize"] == path.stat().st_size and entry["max_label"] == 2
        assert entry["val"] == {"0.2": held_out(keys[bounds[i] : bounds[i + 1]], 0.2)}

    second, read_second = start(folder, val_fraction=0.2)
    assert read_second < 0.05 * total, f"indexed start read {read_second} of {total} shard bytes"
    assert batch_counts(second) == batch_counts(first)
    n_val = held_out(keys, 0.2)
    assert len(second.train_dataset) == sum(COUNTS) - n_val and len(second.val_dataset) == n_val


def test_symlinked_shards_are_indexed_beside_the_links(tmp_path: Path) -> None:
    real = make_shards(tmp_path / "real")
    links = tmp_path / "links"
    links.mkdir()
    for p in real.iterdir():
        (links / p.name).symlink_to(p)
    start(links)
    assert [e["url"] for e in json.loads((links / "shardindex.json").read_text())["shardlist"]] == [
        f"part-{i:06d}.tar" for i in range(len(COUNTS))
    ]
    _, read = start(links)
    assert read < 0.05 * shard_bytes(real)


def test_changed_shard_is_recounted_and_only_it(tmp_path: Path) -> None:
    folder = make_shards(tmp_path / "shards")
    start(folder, val_fraction=0.0)
    changed = folder / "part-000001.tar"
    write_shard(changed, 41, 1000, np.random.default_rng(1))  # another count, size and mtime
    settle(changed)
    dm, read = start(folder, val_fraction=0.0)
    assert changed.stat().st_size <= read < changed.stat().st_size + 0.05 * shard_bytes(folder)
    assert len(dm.train_dataset) == sum(COUNTS) - 30 + 41
    entry = {e["url"]: e for e in json.loads((folder / "shardindex.json").read_text())["shardlist"]}[changed.name]
    assert entry["nsamples"] == 41 and entry["filesize"] == changed.stat().st_size
    _, read = start(folder, val_fraction=0.0)
    assert read < 0.05 * shard_bytes(folder)


def test_a_new_val_fraction_is_counted_and_kept_beside_the_old_one(tmp_path: Path) -> None:
    folder = make_shards(tmp_path / "shards")
    start(folder, val_fraction=0.1)
    start(folder, val_fraction=0.3)
    vals = [e["val"] for e in json.loads((folder / "shardindex.json").read_text())["shardlist"]]
    assert all(set(v) == {"0.1", "0.3"} for v in vals)
    for vf in (0.1, 0.3):
        _, read = start(folder, val_fraction=vf)
        assert read < 0.05 * shard_bytes(folder)


def test_fresh_shards_are_not_trusted_until_their_mtime_settles(tmp_path: Path) -> None:
    """A shard modified within the last seconds could change again under the same mtime (coarse
    timestamps): its entry is written without an mtime, and the next start counts it again."""
    folder = make_shards(tmp_path / "shards")
    os.utime(folder / "part-000000.tar")  # now
    start(folder)
    _, read = start(folder)
    assert read >= (folder / "part-000000.tar").stat().st_size


def test_read_only_shard_folder_indexes_into_the_cache_folder(tmp_path: Path, _cache: Path) -> None:
    """A folder without write permission bits is left alone (also by root, whom the kernel would let write)."""
    folder = make_shards(tmp_path / "shards")
    folder.chmod(0o555)
    try:
        first, _ = start(folder)
        assert not (folder / "shardindex.json").exists()
        cached = list((_cache / "vitlab" / "shardindex").glob("shards-*.json"))
        assert len(cached) == 1
        assert [e["nsamples"] for e in json.loads(cached[0].read_text())["shardlist"]] == COUNTS
        second, read = start(folder)
        assert read < 0.05 * shard_bytes(folder)
        assert batch_counts(second) == batch_counts(first)
    finally:
        folder.chmod(0o755)


def test_index_shards_command_writes_the_index_ahead(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "data"
    make_shards(root / "train")
    make_shards(root / "val", [9, 8], seed=1)
    assert index_shards_main([str(root)]) == 0
    out = capsys.readouterr().out
    assert f"{root / 'train'}: 4 shards, {sum(COUNTS)} samples" in out
    assert f"{root / 'val'}: 2 shards, 17 samples" in out
    for split, counts in (("train", COUNTS), ("val", [9, 8])):
        doc = json.loads((root / split / "shardindex.json").read_text())
        assert [e["nsamples"] for e in doc["shardlist"]] == counts
    dm, read = start(root / "train", val_shards=str(root / "val"))
    assert read < 0.05 * (shard_bytes(root / "train") + shard_bytes(root / "val"))
    assert len(dm.train_dataset) == sum(COUNTS) and len(dm.val_dataset) == 17
    _, read = start(root / "train")  # held out at the default 0.02, which index-shards counted too
    assert read < 0.05 * shard_bytes(root / "train")


# ---- DDP: rank 0 builds, the other rank reads -------------------------------------------------------


class RecordingShards(ShardDataModule):
    """Writes, per rank, whether prepare_data ran there and the bytes its setup read."""

    def __init__(self, report_dir: str, **kw) -> None:
        super().__init__(**kw)
        self.report_dir = report_dir
        self.prepared = False

    def prepare_data(self) -> None:
        self.prepared = True
        super().prepare_data()

    def setup(self, stage: str | None = None) -> None:
        before = rchar()
        super().setup(stage)
        report = {"prepared": self.prepared, "setup_bytes": rchar() - before, "batches": len(self.train_dataloader())}
        Path(self.report_dir, f"rank{self.trainer.global_rank}.json").write_text(json.dumps(report))


class LinearProbe(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3 * 32 * 32, 3)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(x.flatten(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow
def test_ddp_rank_0_builds_the_index_and_the_other_rank_reads_it(tmp_path: Path) -> None:
    folder = make_shards(tmp_path / "shards")
    reports = tmp_path / "reports"
    reports.mkdir()
    dm = RecordingShards(str(reports), train_shards=str(folder), val_fraction=0.0, **SMALL)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(LinearProbe(), datamodule=dm)
    r0, r1 = (json.loads((reports / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["prepared"] and not r1["prepared"]
    assert (folder / "shardindex.json").is_file()
    assert r1["setup_bytes"] < 0.05 * shard_bytes(folder), r1
    assert r0["batches"] == r1["batches"] == -(-(sum(COUNTS) // 2) // 2)  # per rank: N // 2 samples, batches of 2


# ---- image folders -----------------------------------------------------------------------------------


def make_tree(root: Path, files_per_class: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for c, n in files_per_class.items():
        (root / c).mkdir(parents=True)
        for i in range(n):
            (root / c / f"{i:03d}.png").write_bytes(noise_png(rng, 8))
        (root / c / "notes.txt").write_text("not an image")
    settle(*root.iterdir())
    return root


def test_image_folder_lists_files_once_and_rewalks_only_a_changed_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_tree(tmp_path / "flat", {"cat": 5, "dog": 4, "fox": 3})
    (root / "dog" / "sub").mkdir()
    (root / "dog" / "sub" / "x.PNG").write_bytes((root / "dog" / "000.png").read_bytes())
    settle(root / "dog" / "sub", root / "dog")
    oracle = make_dataset(str(root), {"cat": 0, "dog": 1, "fox": 2}, extensions=IMG_EXTENSIONS)

    walked: list[str] = []
    real_walk = os.walk

    def spy_walk(top, **kw):
        walked.append(Path(top).name)
        return real_walk(top, **kw)

    monkeypatch.setattr(shard_index.os, "walk", spy_walk)

    def samples() -> list[tuple[str, int]]:
        dm = ImageFolderDataModule(str(root), val_fraction=0.0, **SMALL)
        dm.setup("fit")
        return dm.train_dataset.samples

    assert samples() == oracle and sorted(walked) == ["cat", "dog", "fox"]
    assert json.loads((root / "fileindex.json").read_text())["classes"]["dog"]["files"][-1] == "sub/x.PNG"
    walked.clear()
    assert samples() == oracle and walked == []  # from the index: no folder walked
    (root / "fox" / "new.png").write_bytes((root / "fox" / "000.png").read_bytes())  # fox's mtime changes
    now = samples()
    assert walked == ["fox"] and len(now) == len(oracle) + 1
    assert now == make_dataset(str(root), {"cat": 0, "dog": 1, "fox": 2}, extensions=IMG_EXTENSIONS)


def test_image_folder_without_images_says_so(tmp_path: Path) -> None:
    root = tmp_path / "d"
    (root / "train" / "cat").mkdir(parents=True)
    (root / "train" / "cat" / "readme.txt").write_text("no images here")
    dm = ImageFolderDataModule(str(root), **SMALL)
    with pytest.raises(FileNotFoundError, match=f"no images found in {root / 'train'}: its class folder cat holds no"):
        dm.num_classes


@pytest.mark.slow
def test_cli_reports_an_image_folder_without_images_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "d"
    (root / "train" / "cat").mkdir(parents=True)
    (root / "train" / "cat" / "readme.txt").write_text("no images here")
    recipe = Path(__file__).resolve().parents[1] / "recipes/pretrain/tinyimagenet_vit_cpu.yaml"
    env = {k: v for k, v in os.environ.items() if k != "VITLAB_DEBUG"}
    args = ["fit", "--config", str(recipe), "--run_dir", str(tmp_path / "run"), "--data_path", str(root)]
    proc = subprocess.run([sys.executable, "-m", "vitlab.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("vitlab: error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith(f"vitlab: error: no images found in {root / 'train'}: "), errors


# ---- streamed HF datasets under DDP ------------------------------------------------------------------


def write_parquet_shards(folder: Path, rows: list[int]) -> list[str]:
    """Parquet files of PNG images whose label is the row's position in the stream (its identity)."""
    import datasets

    rng, files, start = np.random.default_rng(0), [], 0
    for i, n in enumerate(rows):
        images = [{"bytes": noise_png(rng, 64), "path": None} for _ in range(n)]
        part = datasets.Dataset.from_dict(
            {"image": images, "label": list(range(start, start + n))},
            features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
        )
        files.append(str(folder / f"train-{i:05d}.parquet"))
        part.to_parquet(files[-1])
        start += n
    return files


@pytest.mark.parametrize("rows,num_workers", [([6, 6, 6, 6], 0), ([6, 7, 6, 4], 2)])
def test_hf_stream_ranks_read_disjoint_shares_of_equal_size(tmp_path: Path, rows: list[int], num_workers: int) -> None:
    """4 parquet shards over 2 ranks: each rank reads 2 of them, never the other's rows; the ranks yield the
    same number of batches. Equal shards: together they cover the stream. Unequal ones: a rank stops at
    what its 2 shards hold at the least, whichever it got: the 2 smallest (4 + 6); with 2 workers, one
    shard each, each worker stops at the smallest shard (4 + 4)."""
    from types import SimpleNamespace

    from vitlab.data import HFDataModule

    folder = tmp_path / "parquet"
    folder.mkdir()
    files, n = write_parquet_shards(folder, rows), sum(rows)
    seen, sizes, read = [], [], []
    for world_size, rank in ((1, 0), (2, 0), (2, 1)):  # the whole stream, then each rank's share
        dm = HFDataModule("parquet", data_files={"train": files}, streaming=True, val_split=None, val_fraction=0.0,
                          test_split=None, num_classes=n, cache_dir=str(tmp_path / "hf"),
                          **{**SMALL, "num_workers": num_workers})  # fmt: skip
        dm.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, num_devices=1, current_epoch=0)
        dm.prepare_data()  # counts the shards' rows once into the index
        dm.setup("fit")
        before = rchar()
        labels = [y for _, y in dm.train_dataloader()]
        read.append(rchar() - before)
        sizes.append([len(y) for y in labels])
        seen.append(torch.cat(labels).tolist())
    assert sorted(seen[0]) == list(range(n))  # one process: every row
    per_rank = sum(sorted(rows)[:2]) if num_workers == 0 else 2 * min(rows)
    assert len(seen[1]) == len(seen[2]) == per_rank and sizes[1] == sizes[2]
    assert not set(seen[1]) & set(seen[2]) and len(set(seen[1])) == per_rank
    if len(set(rows)) == 1:
        assert sorted(seen[1] + seen[2]) == list(range(n))
    if num_workers == 0:  # (worker processes' reads are not this process's)
        assert read[1] < 0.6 * read[0] and read[2] < 0.6 * read[0], read  # half the stream each, not all of it
