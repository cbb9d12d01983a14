"""`vitlab pack-shards` (vitlab.data.pack) on small generated data: sizes, labels, classes.txt and the
index; a rerun after a kill redoes only the missing shards; the output trains through ShardDataModule."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from PIL import Image
from test_data_fast_decode import _shards, jpeg, photo

from vitlab.data import ShardDataModule
from vitlab.data.pack import main, pack
from vitlab.data.shard_index import SHARD_INDEX


def _members(shard: Path) -> dict[str, bytes]:
    with tarfile.open(shard) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """train/ and val/ with 2 classes of 500x375 JPEGs, a grey one and a PNG among them, one bad file."""
    root = tmp_path / "src"
    for split, n in (("train", 6), ("val", 2)):
        for k, c in enumerate(("cat", "dog")):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                (root / split / c / f"{c}{i}.jpg").write_bytes(jpeg(photo(10 * k + i)))
    (root / "train/cat/grey.jpg").write_bytes(jpeg(photo(50), "L"))
    (root / "train/dog/flat.png").write_bytes(jpeg(photo(51), fmt="PNG"))
    (root / "train/dog/broken.jpg").write_bytes(b"\xff\xd8\xff not really")
    return root


def _samples(folder: Path) -> dict[str, tuple[int, tuple[int, int]]]:
    """key -> (label, image size) over every shard of `folder`."""
    out = {}
    for shard in sorted(folder.glob("*.tar")):
        m = _members(shard)
        for name in m:
            if name.endswith(".jpg"):
                key = name[:-4]
                out[key] = int(m[key + ".cls"]), Image.open(io.BytesIO(m[name])).size
    return out


def test_pack_folder_resizes_keeps_labels_and_indexes(tree: Path, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "dst"
    assert main([str(tree), str(dst), "--max-side", "160", "--shard-size", "4", "--workers", "2"]) == 0
    train = _samples(dst / "train")
    assert len(train) == 14 and len(_samples(dst / "val")) == 4  # 15 train files, the broken one left out
    assert all(max(size) == 160 for _, size in train.values())  # 500x375 -> 160x120, grey and PNG too
    assert train["cat_cat3"][0] == 0 and train["dog_flat"][0] == 1 and train["cat_grey"][0] == 0
    assert (dst / "train/classes.txt").read_text() == "cat\ndog\n"
    assert (dst / "train" / SHARD_INDEX).is_file()
    out = capsys.readouterr().out
    assert "broken.jpg" in out and "1 bad images left out" in out
    assert len(list((dst / "train").glob("*.tar"))) == 4  # ceil(15 / 4): shards planned from the file list

    dm = ShardDataModule(str(dst / "train"), val_shards=str(dst / "val"), img_size=64, batch_size=4, num_workers=0,
                         auto_augment=None, decode="cpu")  # fmt: skip
    dm.setup("fit")
    assert dm.class_names == ["cat", "dog"] and len(dm.train_dataset) == 14
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 64, 64)


def test_pack_resumes_after_a_kill(tree: Path, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "dst"
    pack(tree, dst, max_side=128, shard_size=4, workers=1)
    before = {p.name: p.read_bytes() for p in (dst / "train").glob("*.tar")}
    # as a kill would leave it: one shard never renamed (a partial .tmp), another never started
    names = sorted(before)
    (dst / "train" / names[1]).rename(dst / "train" / (names[1] + ".tmp"))
    (dst / "train" / (names[1] + ".tmp")).write_bytes(before[names[1]][:700])
    (dst / "train" / names[3]).unlink()
    keep = (dst / "train" / names[0]).stat().st_mtime_ns
    capsys.readouterr()
    pack(tree, dst, max_side=128, shard_size=4, workers=1)
    assert "(2 already done)" in capsys.readouterr().out
    after = {p.name: p.read_bytes() for p in (dst / "train").glob("*.tar")}
    assert after == before  # the redone shards are byte for byte what the first run wrote
    assert (dst / "train" / names[0]).stat().st_mtime_ns == keep  # a complete shard is not rewritten
    assert not list((dst / "train").glob("*.tmp"))


def test_pack_from_shards(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for k, c in enumerate(("cat", "dog")):
        for split in ("train", "val"):
            (src / "tree" / split / c).mkdir(parents=True)
            for i in range(3):
                (src / "tree" / split / c / f"{c}{i}.jpg").write_bytes(jpeg(photo(k * 10 + i)))
    sh = _shards(tmp_path / "sh", src / "tree")
    dst = tmp_path / "dst"
    assert main([str(sh), str(dst), "--max-side", "100", "--workers", "1"]) == 0
    got = _samples(dst / "train")
    assert sorted(got) == [f"{c}{i}" for c in ("cat", "dog") for i in range(3)]
    assert all(label == (key.startswith("dog")) and max(size) == 100 for key, (label, size) in got.items())
    assert (dst / "val/classes.txt").read_text() == "cat\ndog\n"


def test_pack_errors_are_one_line(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "nope"), str(tmp_path / "d")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty/a").mkdir(parents=True)
    assert main([str(tmp_path / "empty"), str(tmp_path / "d")]) == 2
    assert "no images" in capsys.readouterr().err
    assert main([str(tmp_path / "empty"), str(tmp_path / "d"), "--max-side", "4"]) == 2
    assert "--max-side must be >= 16" in capsys.readouterr().err
