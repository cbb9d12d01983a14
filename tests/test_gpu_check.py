"""`make gpu-check DEVICE=cpu`: the prepared device run at tiny sizes on the CPU, and the data packer
that feeds it. The run must pass every check and write a report with every section and real numbers;
it runs with a `wandb` that cannot be imported, as on the GPU machine, which has none."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import pack_gpu_data  # noqa: E402

SECTIONS = ["environment", "feed", "transfer", "recipe", "correctness", "distributed", "speed"]
PER_CLASS = {"cifar10": 20, "cifar10_small": 10, "tinyimagenet": 2, "tinyimagenet_val": 1, "imagenette": 8}


def read_shards(folder: Path) -> dict[str, tuple[bytes, int]]:
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted(folder.glob("*.tar*")):
        with tarfile.open(shard) as tar:
            for m in tar:
                if m.isfile():
                    key, _, ext = m.name.rpartition(".")
                    samples.setdefault(key, {})[ext] = tar.extractfile(m).read()  # type: ignore[union-attr]
    return {k: (v["jpg"], int(v["cls"])) for k, v in samples.items() if "jpg" in v and "cls" in v}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, cifar_shards: Path) -> Path:
    out = tmp_path_factory.mktemp("gpudata")
    counts = pack_gpu_data.pack(cifar_shards.parent, out, PER_CLASS)
    assert counts == {"cifar10": 200, "cifar10_small": 100, "tinyimagenet": 400, "tinyimagenet_val": 200, "imagenette": 80}
    return out


def test_packed_subsets_are_balanced_copies_with_the_source_classes(packed: Path, cifar_shards: Path) -> None:
    source = read_shards(cifar_shards)
    subset = read_shards(packed / "cifar10" / "train")
    assert Counter(label for _, label in subset.values()) == {c: 20 for c in range(10)}
    for key, (image, label) in subset.items():  # the original bytes and label, not a re-encoding
        assert source[key] == (image, label), key
    for name, (src, dest) in pack_gpu_data.SOURCES.items():
        assert (packed / dest / "classes.txt").read_text() == (cifar_shards.parent / src / "classes.txt").read_text()
    tin = read_shards(packed / "tinyimagenet" / "train")
    assert Counter(label for _, label in tin.values()) == {c: 2 for c in range(200)}
    from PIL import Image

    for image, _ in list(tin.values())[:5]:
        assert Image.open(io.BytesIO(image)).size == (64, 64)


@pytest.mark.slow
def test_cpu_run_passes_every_check_and_reports_every_section(packed: Path, tmp_path: Path) -> None:
    # The GPU machine has no wandb: a stand-in that fails on import proves no code path needs it.
    blocker = tmp_path / "no_wandb" / "wandb"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('wandb is not installed here (test stand-in)')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker.parent), str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--data", str(packed),
           "--out", str(out), "--work", str(tmp_path / "work")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert (out / "gpu_check.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    failures = {k: s["error"] for k, s in report["sections"].items() if s["status"] != "pass"}
    assert proc.returncode == 0 and not failures, (failures, proc.stdout[-3000:])
    assert list(report["sections"]) == SECTIONS
    assert report["mode"] == "cpu" and report["all_passed"] and report["failed"] == 0
    rows = {(name, r["check"]): r for name, s in report["sections"].items() for r in s["rows"]}

    env_row = rows[("environment", "device")]
    assert env_row["torch"] and env_row["lightning"] and env_row["wandb_imported"] is False
    assert rows[("environment", "peak bf16 matmul")]["tflops"] > 0

    speed = {k[1]: r for k, r in rows.items() if k[0] == "speed"}
    for cand in ("vitlab", "timm"):
        r = speed[f"ti4-32 fp32 b8 {cand}"]
        assert r["train_ips"] > 0 and r["infer_ips"] > 0 and 0 < r["mfu"] < 1
    assert speed["ti4-32 parity vitlab/timm"]["max_abs"] < 1e-4

    assert 0.0 <= rows[("recipe", "CIFAR-10 val top-1")]["acc1"] <= 1.0
    assert rows[("recipe", "CIFAR-10 train img/s")]["ips"] > 0
    assert rows[("recipe", "CIFAR-10 recipe")]["steps"] > 0
    feed = {k[1]: r for k, r in rows.items() if k[0] == "feed"}
    assert all(feed[f"feed {name}"]["train_ips"] > 0 for name in ("synthetic", "cpu", "device"))
    transfer = [r for k, r in rows.items() if k[0] == "transfer"]
    assert len(transfer) == 2 and all(0.0 <= r["acc1"] <= 1.0 and r["minutes"] > 0 for r in transfer)
    assert "128px" in transfer[1]["check"] and "64px" in transfer[0]["check"]

    bf16 = rows[("correctness", "bf16 vs fp32 logits")]
    assert 0 < bf16["max_abs"] and bf16["rel"] < 0.05 and bf16["agreement"] >= 0.95
    comp = rows[("correctness", "compiled vs eager (fp32)")]
    assert comp["logits_rel"] < 1e-3 and comp["grad_rel"] < 1e-2
    resume = rows[("correctness", "SIGKILL + resume vs uninterrupted")]
    assert 0 < resume["killed_at"] < report["profile"]["resume_steps"]
    assert resume["resumed_from_checkpoint"] is True
    assert resume["weights_rel"] == 0.0 and resume["loss_diff"] == 0.0  # CPU kernels: bit-equal
    ddp = rows[("distributed", "DDP via torchrun, 1 process")]
    assert ddp["backend"] == "gloo" and ddp["steps"] == report["profile"]["ddp_steps"]

    md = (out / "gpu_check.md").read_text()
    for name in SECTIONS:
        assert f"| {name} | section | pass" in md
    assert md.count("| FAIL |") == 0 and proc.stdout.count("| section | check | value | ok |") == 1  # one table
