"""The checkpoint tools through the real command line (`vitlab.cli.main`, and `python -m vitlab.cli` in a
subprocess) on a tiny model trained here on generated images: predict, explain, inspect, export."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from vitlab import load_pretrained
from vitlab.analysis import commands
from vitlab.cli import main
from helpers import image_tree

pytestmark = pytest.mark.slow

CLASSES = ["cat", "dog", "ship"]
TINY = {"patch_size": 4, "depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}
# `explain` draws `plot_rollout` at its default figsize (9, 3.4) and 100 dpi, saved without a tight bbox.
EXPLAIN_SIZE = (900, 340)
# `inspect`: plot_attention_distance (5, 4), plot_pos_embed_similarity (6, 5.2), and plot_patch_components
# for 28 components in 7 columns: (max(3, 0.7 * 7 + 0.4), 0.7 * 4 + 0.5) inches; all at 100 dpi.
INSPECT_SIZES = {
    "attention_distance.png": (500, 400),
    "pos_embed_similarity.png": (600, 520),
    "patch_embedding_filters.png": (530, 330),
}
RANK_LINE = re.compile(r"^\s+(\d+)\. (\S+)\s+([\d.]+)%$")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ViT (linear patch stem, class token) trained one epoch on cat/dog/ship through `vitlab fit`."""
    tmp = tmp_path_factory.mktemp("cli_tools")
    data = image_tree(tmp / "data", CLASSES, 16, 4)
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_epochs": 1, "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "model": {"arch": "vit_tiny_patch16", "model_args": TINY, "lr": 2e-3},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(data), "img_size": 32, "batch_size": 16, "num_workers": 0,
                               "train_crop": "pad", "auto_augment": None}},
    }  # fmt: skip
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(recipe), "--run_dir", str(tmp / "run")]) == 0
    path = tmp / "run" / "checkpoints" / "last.ckpt"
    assert path.is_file()
    return path


@pytest.fixture(scope="module")
def photo() -> Path:
    """matplotlib's sample photograph: a real full-size (512x600) JPEG."""
    import matplotlib.cbook

    path = Path(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    assert path.is_file(), f"matplotlib ships no grace_hopper.jpg at {path}"
    with Image.open(path) as im:
        assert im.size == (512, 600)
    return path


@pytest.fixture(scope="module")
def images(photo: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One 32x32 image of each trained class (its colour, new noise), one of a class the model never saw,
    the photograph."""
    tree = image_tree(tmp_path_factory.mktemp("images"), [*CLASSES, "airplane"], 0, 1, seed=1)
    return [*(next((tree / "val" / c).iterdir()) for c in [*CLASSES, "airplane"]), photo]


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.load()
        return im.size


def assert_not_blank(path: Path) -> None:
    with Image.open(path) as im:
        lo, hi = zip(*im.convert("RGB").getextrema())
    assert max(hi) - min(lo) > 100, f"{path} looks blank"


def parse_predictions(text: str) -> list[tuple[str, list[tuple[int, str, float]]]]:
    """`print_predictions` output -> [(image, [(rank, class name, percent), ...]), ...]."""
    blocks: list[tuple[str, list[tuple[int, str, float]]]] = []
    for line in text.splitlines():
        m = RANK_LINE.match(line)
        if m:
            assert blocks, f"rank line before any image line: {line!r}"
            blocks[-1][1].append((int(m[1]), m[2], float(m[3])))
        elif line.strip():
            assert not line[0].isspace(), f"unexpected line {line!r}"
            blocks.append((line, []))
    return blocks


def check_predictions(text: str, images: list[Path], ckpt: Path, topk: int) -> list:
    blocks = parse_predictions(text)
    assert [image for image, _ in blocks] == [str(p) for p in images]
    model = load_pretrained(ckpt)
    with torch.no_grad():
        probs = model(commands.preprocess(model, images)).softmax(-1)
    k = min(topk, len(CLASSES))
    for (_, rows), p in zip(blocks, probs):
        assert [r[0] for r in rows] == list(range(1, k + 1))
        names = [r[1] for r in rows]
        assert set(names) <= set(CLASSES) and len(set(names)) == k  # the checkpoint's names, nothing else
        percents = [r[2] for r in rows]
        assert percents == sorted(percents, reverse=True)
        want = p.topk(k)
        assert names == [CLASSES[i] for i in want.indices.tolist()]
        assert percents == pytest.approx([100 * v for v in want.values.tolist()], abs=0.006)
    if k == len(CLASSES):
        assert all(sum(r[2] for r in rows) == pytest.approx(100, abs=0.02) for _, rows in blocks)
    return blocks


def test_predict_prints_the_checkpoints_class_names(ckpt, images, capsys):
    assert load_pretrained(ckpt).data_config["class_names"] == CLASSES
    assert main(["predict", "--ckpt", str(ckpt), *map(str, images)]) == 0
    check_predictions(capsys.readouterr().out, images, ckpt, topk=5)  # top-5 of 3 classes: all 3
    assert main(["predict", "--ckpt", str(ckpt), "--topk", "2", *map(str, images)]) == 0
    check_predictions(capsys.readouterr().out, images, ckpt, topk=2)


def test_explain_writes_the_figure(ckpt, images, photo, tmp_path, monkeypatch, capsys):
    for image in (images[0], photo):  # a 32x32 image and the full-size photograph
        out = tmp_path / "out" / f"{image.stem}.png"
        assert main(["explain", "--ckpt", str(ckpt), "--image", str(image), "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == str(out)
        assert png_size(out) == EXPLAIN_SIZE
        assert_not_blank(out)
    # Without --out: `<image stem>_explain.png` in the current folder, not next to the image.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["explain", "--ckpt", str(ckpt), "--image", str(images[1])]) == 0
    written = cwd / f"{images[1].stem}_explain.png"
    assert capsys.readouterr().out.strip() == str(written)
    assert png_size(written) == EXPLAIN_SIZE
    assert not (images[1].parent / written.name).exists()


def test_tools_as_a_subprocess(ckpt, images, photo, tmp_path, capsys):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    def run(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "vitlab.cli", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    out = tmp_path / "photo_explain.png"
    assert run("explain", "--ckpt", str(ckpt), "--image", str(photo), "--out", str(out)).strip() == str(out)
    assert png_size(out) == EXPLAIN_SIZE
    assert_not_blank(out)

    printed = run("predict", "--ckpt", str(ckpt), *map(str, images))
    blocks = check_predictions(printed, images, ckpt, topk=5)
    assert main(["predict", "--ckpt", str(ckpt), *map(str, images)]) == 0
    in_process = parse_predictions(capsys.readouterr().out)
    assert [[r[:2] for r in rows] for _, rows in blocks] == [[r[:2] for r in rows] for _, rows in in_process]


def test_inspect_writes_its_three_figures(ckpt, images, tmp_path, capsys):
    for out, extra in ((tmp_path / "noise", []), (tmp_path / "images", ["--images", *map(str, images)])):
        assert main(["inspect", "--ckpt", str(ckpt), "--out", str(out), *extra]) == 0
        printed = capsys.readouterr().out.split()
        assert printed == [str(out / name) for name in INSPECT_SIZES]
        for name, size in INSPECT_SIZES.items():
            assert png_size(out / name) == size, name
            assert_not_blank(out / name)


def test_export_round_trips_the_weights(ckpt, images, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "export"
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    # The file holds exactly the weights the training run saved.
    trained = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    trained = {k.removeprefix("model."): v for k, v in trained.items() if k.startswith("model.")}
    saved = load_file(out / "model.safetensors")
    assert sorted(saved) == sorted(trained)
    for name, tensor in trained.items():
        assert torch.equal(saved[name], tensor), name

    meta = json.loads((out / "config.json").read_text())
    assert meta["data"]["class_names"] == CLASSES and meta["model"]["patch_size"] == TINY["patch_size"]

    original = load_pretrained(ckpt)
    for source in (out, out / "model.safetensors"):
        loaded = load_pretrained(source)
        assert loaded.config == original.config and loaded.data_config == original.data_config
        want, got = original.state_dict(), loaded.state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
        x = commands.preprocess(original, images)
        with torch.no_grad():
            assert torch.equal(loaded(x), original(x))

    # The tools read the export as they read the checkpoint.
    assert main(["predict", "--ckpt", str(out), *map(str, images)]) == 0
    from_export = capsys.readouterr().out
    assert main(["predict", "--ckpt", str(ckpt), *map(str, images)]) == 0
    assert from_export == capsys.readouterr().out
