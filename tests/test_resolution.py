"""Resolution: a new patch size (FlexiViT's PI-resize, against timm), checkpoints evaluated at another
input size, and the `vitlab resolution` sweep."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import perturb
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from vitlab.interop import load_pretrained
from vitlab.models import VisionTransformer
from vitlab.models.resize import resample_patch_kernel
from vitlab.train import ViTClassifier

TOL = 1e-4
TINY = dict(embed_dim=32, depth=2, num_heads=2, num_classes=5)


def _timm_vit(img_size: int, patch_size: int, **kw: object) -> torch.nn.Module:
    args = dict(img_size=img_size, patch_size=patch_size, **TINY)
    return perturb(timm.models.vision_transformer.VisionTransformer(**{**args, **kw}))


def _as_vitlab(peer: torch.nn.Module, tmp_path: Path) -> VisionTransformer:
    save_file({k: v.contiguous() for k, v in peer.state_dict().items()}, str(tmp_path / "w.safetensors"))
    return load_pretrained(tmp_path / "w.safetensors", config={"num_heads": TINY["num_heads"]})


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


@pytest.mark.parametrize(
    "img_size,patch_size,new_img,new_patch",
    [
        (32, 4, 64, 8),  # square, kernel up, same grid
        (32, 4, 48, 8),  # square, kernel up, grid down
        (64, 8, 32, 4),  # square, kernel down
        (32, 4, (48, 32), 8),  # to non-square
        (48, 8, (32, 64), 2),  # kernel down to 2, non-square, grid up
        (32, 4, 32, 8),  # patch only: grid 8x8 -> 4x4
    ],
)
@pytest.mark.parametrize("pool", ["token", "avg"])
def test_patch_size_change_matches_timm_set_input_size(
    img_size: int, patch_size: int, new_img: int | tuple[int, int], new_patch: int, pool: str, tmp_path: Path
) -> None:
    kw = {} if pool == "token" else dict(global_pool="avg", class_token=False)
    peer = _timm_vit(img_size, patch_size, **kw)
    model = _as_vitlab(peer, tmp_path)
    assert model.pool == pool and model.patch_embed.patch_size == patch_size

    peer.set_input_size(img_size=_pair(new_img), patch_size=new_patch)
    model.set_image_size(new_img, patch_size=new_patch)

    h, w = _pair(new_img)
    assert model.patch_embed.grid_size == (h // new_patch, w // new_patch)
    assert model.config["patch_size"] == new_patch and model.config["img_size"] == [h, w]
    assert model.patch_embed.proj.weight.shape[-2:] == (new_patch, new_patch)
    x = torch.randn(2, 3, h, w)
    with torch.no_grad():
        assert (model(x) - peer(x)).abs().max().item() <= TOL


def test_pi_resize_gives_each_upsampled_patch_its_old_token() -> None:
    """FlexiViT's identity, written out: <resize(x), w'> = <x, w> for every patch x when the kernel grows
    (bicubic with antialias, the resize FlexiViT's PI-resize inverts)."""
    w = torch.randn(6, 3, 4, 4)
    patches = torch.randn(10, 3, 4, 4)
    for new in (8, 12, 6):
        up = F.interpolate(patches, size=(new, new), mode="bicubic", antialias=True, align_corners=False)
        w_new = resample_patch_kernel(w, new)
        ref = torch.einsum("nchw,dchw->nd", patches, w)
        assert (torch.einsum("nchw,dchw->nd", up, w_new) - ref).abs().max().item() < 1e-4, new


def test_pi_resize_down_is_the_least_squares_kernel() -> None:
    """Shrinking: w' minimises ||R^T w' - w|| (R: the 8 -> 4 resize matrix, built column by column from
    resized one-hot patches), so the residual is orthogonal to R's column space: R (R^T w' - w) = 0."""
    w = torch.randn(5, 2, 8, 8, dtype=torch.float64)
    cols = [F.interpolate(torch.eye(64, dtype=torch.float64)[i].reshape(1, 1, 8, 8), size=(4, 4), mode="bicubic",
                          antialias=True).flatten() for i in range(64)]  # fmt: skip
    r = torch.stack(cols, dim=1)  # [16 new pixels, 64 old pixels]
    w_new = resample_patch_kernel(w, 4).reshape(5, 2, 16)
    residual = w_new @ r - w.reshape(5, 2, 64)  # (R^T w' - w) for every (out, in) channel, as rows
    assert (residual @ r.T).abs().max().item() < 1e-9


@pytest.mark.parametrize(
    "stem,patch_size,why",
    [
        ("conv", 4, "number of conv-and-pool stages"),
        ("resnet", 4, "ResNet's stride"),
        ("spt", 4, "LayerNorm"),
    ],
)
def test_stems_without_a_patch_kernel_refuse_a_new_patch_size(stem: str, patch_size: int, why: str) -> None:
    extra = {"stem_layers": [], "stem_channels": 32} if stem == "resnet" else {}
    model = VisionTransformer(img_size=32, patch_size=patch_size, stem=stem, **TINY, **extra)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"stem='{stem}' cannot change its patch size.*{why}.*change img_size instead"):
        model.set_image_size(64, patch_size=8)
    assert model.patch_embed.patch_size == patch_size and model.patch_embed.img_size == (32, 32)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.set_image_size(48)  # the resolution itself changes fine
    assert model(torch.randn(1, 3, 48, 48)).shape == (1, 5)


def test_an_indivisible_size_for_the_new_patch_leaves_the_model_untouched() -> None:
    model = VisionTransformer(img_size=32, patch_size=4, **TINY)
    kernel = model.patch_embed.proj.weight.clone()
    with pytest.raises(ValueError, match="img_size 36x36 is not a multiple of patch_size 8"):
        model.set_image_size(36, patch_size=8)
    assert model.patch_embed.patch_size == 4 and torch.equal(model.patch_embed.proj.weight, kernel)
    assert model.config["patch_size"] == 4 and model.patch_embed.grid_size == (8, 8)


def _train_source(tmp_path: Path, **model_args: object) -> Path:
    """A tiny classifier trained one step; its `last.ckpt`."""
    L.seed_everything(0)
    args = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, **model_args)
    source = ViTClassifier(model_args=args, num_classes=5)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 32, 32, generator=g), torch.randint(5, (8,), generator=g)),
                        batch_size=8)  # fmt: skip
    cb = ModelCheckpoint(dirpath=tmp_path / "src", save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb], default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(source, loader)
    return tmp_path / "src" / "last.ckpt"


def test_init_from_with_another_patch_size_pi_resizes_like_timm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = _train_source(tmp_path)
    source = load_pretrained(ckpt)
    peer = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=4, **TINY).eval()
    peer.load_state_dict(source.state_dict())
    peer.set_input_size(img_size=(64, 64), patch_size=8)

    with caplog.at_level(logging.INFO):
        tuned = ViTClassifier(model_args=dict(patch_size=8, embed_dim=32, depth=2, num_heads=2), num_classes=5,
                              img_size=64, init_from=str(ckpt))  # fmt: skip
    assert "patch 4 -> 8, kernel PI-resized" in caplog.text
    assert "grid [8, 8] -> [8, 8]" in caplog.text
    assert tuned.init_summary["patch_size"] == "4 -> 8 (kernel PI-resized)"
    model = tuned.model.eval()
    assert model.config["patch_size"] == 8 and model.patch_embed.grid_size == (8, 8)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (model(x) - peer(x)).abs().max().item() <= TOL


def test_init_from_a_conv_tokenizer_with_another_patch_size_says_why_not(tmp_path: Path) -> None:
    ckpt = _train_source(tmp_path, stem="conv")
    with pytest.raises(ValueError, match="stem='conv' cannot change its patch size.*keep patch_size=4"):
        ViTClassifier(model_args=dict(stem="conv", patch_size=8, embed_dim=32, depth=2, num_heads=2), num_classes=5,
                      img_size=64, init_from=str(ckpt))  # fmt: skip


# ---- a checkpoint at another size: load_state_dict, `vitlab validate|test --data.img_size=S` --------------


def test_a_checkpoint_of_another_grid_loads_resampled_as_timm_resamples(caplog: pytest.LogCaptureFixture) -> None:
    from timm.layers import resample_abs_pos_embed, resample_patch_embed

    src = perturb(VisionTransformer(img_size=32, patch_size=4, **TINY))
    sd = {f"model.{k}": v for k, v in src.state_dict().items()}
    module = ViTClassifier(model_args=dict(patch_size=8, embed_dim=32, depth=2, num_heads=2), num_classes=5,
                           img_size=48)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        module.load_state_dict(sd)
    assert "pos_embed resampled from the checkpoint's 8x8 token grid to 6x6 (img_size 48x48)" in caplog.text
    assert "patch 4 -> 8: kernel PI-resized" in caplog.text
    want_pos = resample_abs_pos_embed(src.pos_embed, [6, 6], [8, 8], num_prefix_tokens=1)
    want_kernel = resample_patch_embed(src.patch_embed.proj.weight, [8, 8])
    assert (module.model.pos_embed - want_pos).abs().max().item() < 1e-6
    assert (module.model.patch_embed.proj.weight - want_kernel).abs().max().item() < 1e-6
    torch.testing.assert_close(module.model.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight, rtol=0, atol=0)

    # To a non-square grid (the checkpoint's square one inferred), and sin-cos tables drawn for the new grid.
    wide = VisionTransformer(img_size=(32, 64), patch_size=4, **TINY)
    wide.load_state_dict(src.state_dict())
    want = resample_abs_pos_embed(src.pos_embed, [8, 16], [8, 8], num_prefix_tokens=1)
    assert (wide.pos_embed - want).abs().max().item() < 1e-6
    sincos = VisionTransformer(img_size=32, patch_size=4, pos_embed="sincos", **TINY)
    bigger = VisionTransformer(img_size=48, patch_size=4, pos_embed="sincos", **TINY)
    fresh = bigger.pos_embed.clone()
    bigger.load_state_dict(sincos.state_dict())
    assert torch.equal(bigger.pos_embed, fresh) and not bigger.pos_embed.requires_grad


CLASSES = ["cat", "dog", "ship"]
N_VAL = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny ViT trained one epoch at 32px through `vitlab fit`, and fine-tuned from it one epoch at 48px."""
    import yaml
    from helpers import image_tree

    from vitlab.cli import main

    tmp = tmp_path_factory.mktemp("resolution")
    data = image_tree(tmp / "data", CLASSES, 16, N_VAL)
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_epochs": 1, "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "model": {"arch": "vit_tiny_patch16", "lr": 2e-3,
                  "model_args": {"patch_size": 4, "depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}},
        "data": {"class_path": "vitlab.data.ImageFolderDataModule",
                 "init_args": {"root": str(data), "img_size": 32, "batch_size": 16, "num_workers": 0,
                               "train_crop": "pad", "auto_augment": None, "crop_pct": 0.9}},
    }  # fmt: skip
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(recipe), "--run_dir", str(tmp / "pretrain")]) == 0
    source = tmp / "pretrain" / "checkpoints" / "last.ckpt"
    assert main(["fit", "--config", str(recipe), "--run_dir", str(tmp / "finetune"), "--data.init_args.img_size=48",
                 "--model.init_from", str(source)]) == 0  # fmt: skip
    return {"tmp": tmp, "data": data, "recipe": recipe, "source": source,
            "finetune": tmp / "finetune" / "checkpoints" / "last.ckpt"}  # fmt: skip


def _validate(runs: dict[str, Path], img_size: int, stage: str = "validate") -> tuple[float, float]:
    from cli_probe import csv_rows, last_value

    from vitlab.cli import main

    run = runs["tmp"] / f"{stage}{img_size}"
    assert main([stage, "--config", str(runs["recipe"]), "--run_dir", str(run), f"--data.init_args.img_size={img_size}",
                 "--ckpt_path", str(runs["source"])]) == 0  # fmt: skip
    rows = csv_rows(run)
    key = "val" if stage == "validate" else "test"
    return last_value(rows, f"{key}/acc1"), last_value(rows, f"{key}/loss")


@pytest.mark.slow
def test_validate_and_test_at_another_size_resample_say_so_and_equal_the_sweep(
    runs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from vitlab.analysis.resolution import sweep

    with caplog.at_level(logging.WARNING, logger="vitlab"):
        at48 = _validate(runs, 48)
    assert "pos_embed resampled from the checkpoint's 8x8 token grid to 12x12 (img_size 48x48)" in caplog.text
    at24, at32 = _validate(runs, 24), _validate(runs, 32)
    assert _validate(runs, 48, "test") == at48  # no test/ folder: `vitlab test` scores the validation images
    assert len({at24[1], at32[1], at48[1]}) == 3  # the size really changed what was scored

    rows = {r.img_size: r for r in sweep(str(runs["source"]), None, [24, 32, 48])}
    for size, (acc1, loss) in ((24, at24), (32, at32), (48, at48)):
        assert rows[size].images == len(CLASSES) * N_VAL
        assert rows[size].acc1 == pytest.approx(acc1, abs=1e-6), size
        assert rows[size].loss == pytest.approx(loss, rel=1e-5), size


@pytest.mark.slow
def test_validate_and_test_score_at_the_recorded_test_size(
    runs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint that records a test size is validated and tested at it by default, with one line saying
    so; `--use_test_size=false` scores at the recipe's size. Each equals the sweep at that size."""
    import shutil

    from cli_probe import csv_rows, last_value

    from vitlab.analysis.resolution import sweep
    from vitlab.cli import main
    from vitlab.interop import EvalSize
    from vitlab.interop.eval_size import record_test_size

    ckpt = tmp_path / "tuned.ckpt"
    shutil.copy(runs["finetune"], ckpt)
    record_test_size(ckpt, EvalSize((40, 40), 0.9))
    scores = {}
    for stage, extra in (("validate", []), ("test", []), ("validate", ["--use_test_size=false"])):
        run = tmp_path / f"{stage}{len(extra)}"
        with caplog.at_level(logging.INFO):
            caplog.clear()
            assert main([stage, "--config", str(runs["recipe"]), "--run_dir", str(run), "--ckpt_path", str(ckpt),
                         *extra]) == 0  # fmt: skip
        said = [r.getMessage() for r in caplog.records if "recorded test size" in r.getMessage()]
        assert said == ([] if extra else [f"{stage}: at the checkpoint's recorded test size 40x40, crop 0.9 "
                                          "(the recipe's 32; --use_test_size=false scores at that)"])  # fmt: skip
        key = "val" if stage == "validate" else "test"
        scores[stage, len(extra)] = last_value(csv_rows(run), f"{key}/acc1"), last_value(csv_rows(run), f"{key}/loss")
    rows = {r.img_size: r for r in sweep(str(ckpt), None, [32, 40])}
    assert scores["validate", 0] == scores["test", 0]  # no test/ folder: `vitlab test` scores the validation images
    for size, n in ((40, 0), (32, 1)):
        assert rows[size].acc1 == pytest.approx(scores["validate", n][0], abs=1e-6), size
        assert rows[size].loss == pytest.approx(scores["validate", n][1], rel=1e-5), size


@pytest.mark.slow
def test_resolution_command_table_json_and_one_curve_per_checkpoint(
    runs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    import json

    from PIL import Image

    from vitlab.analysis.resolution import main

    out = runs["tmp"] / "sweep"
    # No --data: each checkpoint on the data it was trained on.
    rc = main(["--ckpt", str(runs["source"]), "--ckpt", str(runs["finetune"]), "--sizes", "24,30,32,48",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "pretrain/last.ckpt" in table and "finetune/last.ckpt" in table
    assert "skipped: img_size 30x30 is not a multiple of patch_size 4; use e.g. 28x28 or 32x32" in table
    assert " 32*" in table and " 48*" in table  # each trained size marked

    rows = json.loads((out / "resolution.json").read_text())["rows"]
    assert [(r["label"], r["img_size"]) for r in rows] == [
        (label, s) for label in ("pretrain/last.ckpt", "finetune/last.ckpt") for s in (24, 30, 32, 48)
    ]
    scored = [r for r in rows if not r["skipped"]]
    assert len(scored) == 6 and all(r["images"] == len(CLASSES) * N_VAL and 0 <= r["acc1"] <= 1 for r in scored)
    assert {r["grid"] for r in scored if r["img_size"] == 48} == {"12x12"}
    with Image.open(out / "resolution.png") as im:
        assert im.size == (600, 400)
        lo, hi = zip(*im.convert("RGB").getextrema())
        assert max(hi) - min(lo) > 100

    from vitlab.interop import recorded_test_size

    assert recorded_test_size(runs["source"]) is None  # --ckpt records only with --record

    # Explicit --data gives the same rows as the recorded data (the same folder).
    rc = main(["--ckpt", str(runs["finetune"]), "--data", str(runs["data"]), "--sizes", "48", "--out", str(out / "b"),
               "--record"])  # fmt: skip
    assert rc == 0
    assert f"recorded test size 48x48 (crop 0.9) in {runs['finetune']}: top-1" in capsys.readouterr().out
    assert recorded_test_size(runs["finetune"]).img_size == (48, 48)
    again = json.loads((out / "b" / "resolution.json").read_text())["rows"][0]
    first = next(r for r in rows if r["label"] == "finetune/last.ckpt" and r["img_size"] == 48)
    assert (again["acc1"], again["loss"]) == (first["acc1"], first["loss"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        dict(stem="patch", pool="token"),
        dict(stem="conv", pool="seq", class_token=False),
        dict(stem="spt", pool="avg", class_token=False, pos_embed="sincos"),
        dict(stem="resnet", stem_layers=[], stem_channels=32, patch_size=8),
        dict(stem="patch", distilled=True),
    ],
    ids=["patch-token", "conv-seq", "spt-avg-sincos", "resnet", "distilled"],
)
def test_the_sweep_scores_every_tokenizer_and_pooling(
    options: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Untrained models saved with `save_pretrained` (no recorded data module: `--data` and the model's
    preprocessing), against the images run through `eval_transform` and a model loaded at that size."""
    from helpers import image_tree
    from PIL import Image

    from vitlab.analysis.resolution import sweep
    from vitlab.data import eval_transform
    from vitlab.interop import save_pretrained

    data = image_tree(tmp_path / "data", CLASSES, 1, 4)
    args = {**dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3), **options}
    folder = save_pretrained(perturb(VisionTransformer(**args), std=0.2), tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    rows = {r.img_size: r for r in sweep(str(folder), str(data), [4, 16, 20, 32])}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "model"]  # scoring writes nothing (no figures)
    if args["patch_size"] == 8:  # sizes the tokenizer cannot take are skipped, with the reason
        assert "img_size 4x4 is not a multiple of patch_size 8" in rows[4].skipped
        assert "img_size 20x20 is not a multiple of patch_size 8" in rows[20].skipped
    assert sum(not r.skipped for r in rows.values()) == (2 if args["patch_size"] == 8 else 4)
    images = [(p, CLASSES.index(c)) for c in CLASSES for p in sorted((data / "val" / c).iterdir())]
    for size, row in rows.items():
        if row.skipped:
            continue
        model = load_pretrained(folder, img_size=size)
        transform = eval_transform(model)
        x = torch.stack([transform(Image.open(p)) for p, _ in images])
        with torch.no_grad():
            pred = model(x).argmax(-1)
        want = (pred == torch.tensor([y for _, y in images])).float().mean().item()
        assert row.images == len(images) and row.acc1 == pytest.approx(want, abs=1e-6), size


@pytest.mark.slow
def test_finetune_report_draws_the_source_and_the_fine_tuned_model_around_both_sizes(runs: dict[str, Path]) -> None:
    import json

    from vitlab.analysis.resolution import finetune_report

    run = runs["tmp"] / "finetune"
    events = lambda: set(run.glob("events.*")) | set(run.glob("tensorboard/events.*"))  # noqa: E731
    events_before = events()
    json_path, png = finetune_report(run)
    assert json_path == run / "resolution" / "resolution.json" and png.is_file()
    rows = json.loads(json_path.read_text())["rows"]
    sizes = [24, 32, 40, 48, 60]  # pretrained at 32, fine-tuned at 48 (patch 4): 0.75 x 32, midpoint, 1.25 x 48
    assert [(r["label"], r["img_size"]) for r in rows] == [
        (label, s) for label in ("pretrained source", "fine-tuned") for s in sizes
    ]
    assert all(r["acc1"] is not None and r["images"] == len(CLASSES) * N_VAL for r in rows)
    assert {(r["label"], r["trained_img_size"]) for r in rows} == {("pretrained source", 32), ("fine-tuned", 48)}
    assert events() - events_before  # the figure went to TensorBoard
    # The fine-tuned model's best validation size is recorded in its checkpoint as its test size.
    from vitlab.interop import recorded_test_size

    tuned = [r for r in rows if r["label"] == "fine-tuned"]
    best = max(tuned, key=lambda r: (r["acc1"], -abs(r["img_size"] - 48), -r["img_size"]))
    assert recorded_test_size(run / "checkpoints" / "last.ckpt").img_size == (best["img_size"],) * 2
    # ... and on the run's dashboard row (TensorBoard's HParams tab reads these tags).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run))
    acc.Reload()
    assert [e.value for e in acc.Scalars("vitals/val/test_size")] == [best["img_size"]]
    assert acc.Scalars("vitals/val/test_size_acc1")[0].value == pytest.approx(best["acc1"], abs=1e-6)


@pytest.mark.slow
def test_finetune_report_follows_the_runs_limit_val_batches(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A smoke run (`--trainer.limit_val_batches=1`) is swept over its one batch per size, not the whole split."""
    import json
    import shutil

    import yaml

    from vitlab.analysis.resolution import finetune_report

    run = shutil.copytree(runs["tmp"] / "finetune", tmp_path / "smoke")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"]["limit_val_batches"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    json_path, _ = finetune_report(run)
    assert "the first 1 validation batches at each size (the run's trainer.limit_val_batches)" in capsys.readouterr().out
    rows = json.loads(json_path.read_text())["rows"]
    assert len(rows) == 10 and {r["images"] for r in rows} == {16}  # batch_size 16 of the 60 images
    json_path, _ = finetune_report(run, limit_batches=2)  # the flag wins
    assert {r["images"] for r in json.loads(json_path.read_text())["rows"]} == {32}


def test_the_data_of_a_progressive_resize_run_is_rebuilt_at_any_test_size(tmp_path: Path) -> None:
    """A source pretrained with `img_size_schedule` (ending at 32) records it; scoring it at 24 must not
    reject the schedule for ending above the test size."""
    from helpers import image_tree

    from vitlab.analysis.resolution import datamodule_for

    data = image_tree(tmp_path / "data", CLASSES, 2, 2)
    recorded = {"datamodule_hyper_parameters": {
        "_class_path": "vitlab.data.ImageFolderDataModule", "root": str(data), "img_size": 32, "batch_size": 4,
        "num_workers": 0, "img_size_schedule": [[0, 16], [1, 32]]}}  # fmt: skip
    model = VisionTransformer(img_size=24, patch_size=4, **{**TINY, "num_classes": 3})
    dm = datamodule_for(model, recorded, None, 24)
    assert dm.img_size == 24 and not dm.img_size_schedule
