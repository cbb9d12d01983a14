"""2 gloo ranks (started as torchrun would: RANK, WORLD_SIZE, MASTER_ADDR/PORT): on every data path
(image folder and shards; decode pil, cpu and device) the ranks' train loaders cover the split with
equal counts (shards: disjoint, at most world_size - 1 dropped; folders: DistributedSampler's one
repeat), and their validation loaders read every validation image once (shards: at most
world_size - 1 dropped, the streamed split's rule). Each sample's label is unique, so the
labels a rank sees say which samples it read."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

N = 13  # samples per split, one per class in each: odd, so a padded or repeated split would show
PATHS = [(kind, decode) for kind in ("folder", "shards") for decode in ("pil", "cpu", "device")]


def make_data(root: Path) -> Path:
    """The same 2 x 13 pictures as an image folder (train/ and val/, class c<i> holding sample i) and as
    shards (`KEY.jpg` + `KEY.cls` = i)."""
    import io
    import tarfile

    from test_data_fast_decode import jpeg, photo

    for split in ("train", "val"):
        (root / "shards" / split).mkdir(parents=True)
        with tarfile.open(root / "shards" / split / "s-000000.tar", "w") as tar:
            for i in range(N):
                data = jpeg(photo(i + N * (split == "val"), 120, 90))
                (root / "tree" / split / f"c{i:03d}").mkdir(parents=True)
                (root / "tree" / split / f"c{i:03d}" / f"{split}{i}.jpg").write_bytes(data)
                for ext, payload in (("jpg", data), ("cls", str(i).encode())):
                    info = tarfile.TarInfo(f"{split}{i}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        (root / "shards" / split / "classes.txt").write_text("".join(f"c{i:03d}\n" for i in range(N)))
    return root


def rank_main(root: Path, out: Path) -> None:
    import torch.distributed as dist

    from vitlab.data import ImageFolderDataModule, ShardDataModule

    dist.init_process_group("gloo")
    seen: dict[str, dict[str, list[int]]] = {}
    for kind, decode in PATHS:
        common = dict(img_size=32, batch_size=4, num_workers=2, auto_augment=None, decode=decode, crop_pct=1.0)
        if kind == "folder":
            dm = ImageFolderDataModule(str(root / "tree"), **common)
        else:
            dm = ShardDataModule(str(root / "shards/train"), val_shards=str(root / "shards/val"), **common)
        dm.prepare_data()
        dist.barrier()
        dm.setup("fit")
        seen[f"{kind}-{decode}"] = {
            split: [int(v) for _, y in loader for v in y] for split, loader in
            (("train", dm.train_dataloader()), ("val", dm.val_dataloader()))
        }  # fmt: skip
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_path_reads_each_sample_once_over_2_gloo_ranks(tmp_path: Path) -> None:
    root = make_data(tmp_path / "data")
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, __file__, str(root), str(tmp_path)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]  # fmt: skip
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for path in r0:
        a, b = r0[path], r1[path]
        assert len(a["train"]) == len(set(a["train"])) and len(b["train"]) == len(set(b["train"])), path
        train = set(a["train"]) | set(b["train"])
        if path.startswith("shards"):  # one sample dropped, as vitlab.data.shards documents
            assert not set(a["train"]) & set(b["train"]), path
            assert len(a["train"]) == len(b["train"]) == N // 2 and train < set(range(N)), path
        else:  # DistributedSampler: equal counts by repeating one sample on the short rank
            assert len(a["train"]) == len(b["train"]) == (N + 1) // 2 and train == set(range(N)), path
            assert len(set(a["train"]) & set(b["train"])) == 1, path
        val = sorted(a["val"] + b["val"])
        if path.startswith("shards"):  # streamed validation splits as training does: disjoint, one dropped
            assert len(val) == len(set(val)) == 2 * (N // 2) and set(val) < set(range(N)), path
        else:
            assert val == list(range(N)), path  # every image once: no padding


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank_main(Path(sys.argv[1]), Path(sys.argv[2]))
