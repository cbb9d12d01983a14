"""bench/gpu_feed.py's `feed` section at its CPU sizes: it packs its own data, measures the three
feeds and reports img/s, MFU and idle share for each (speed itself is the device run's to judge)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402
import gpu_feed  # noqa: E402


def test_feed_section_runs_at_cpu_sizes(tmp_path: Path) -> None:
    ctx = gpu_check.Context(device=torch.device("cpu"), profile=gpu_check.CPU, data=tmp_path / "data",
                            work=tmp_path / "work", deadline=time.monotonic() + 600, fit_args=[],
                            results={"peak_tflops": 0.1})  # fmt: skip
    ctx.work.mkdir()
    rows = gpu_feed.section_feed(ctx)
    by = {r["check"]: r for r in rows}
    assert set(by) == {"feed synthetic", "feed cpu", "feed device", "feed fastest / synthetic"}
    for name in ("synthetic", "cpu", "device"):
        r = by[f"feed {name}"]
        assert r["ok"] and r["train_ips"] > 0 and 0 < r["mfu"] and 0 <= r["idle_share"] < 1
    assert by["feed synthetic"]["idle_share"] == 0
    assert (ctx.work / "feed-shards/classes.txt").read_text().split() == [f"c{i}" for i in range(10)]
    assert by["feed fastest / synthetic"]["ok"] is None  # a target only on a GPU
