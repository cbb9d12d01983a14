"""Masked patch prediction (vitlab.train.MaskedPatchPretraining): the corruption, the 3-bit colour
target, learning on real images, the checkpoint feeding a classifier, unlabelled data, the CLI."""

from __future__ import annotations

import csv
import math
import tarfile
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import timm.layers
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from vitlab import load_pretrained
from vitlab.cli import VitlabCLI, main
from vitlab.recipe import check_recipe
from vitlab.data import ImageFolderDataModule, ShardDataModule
from vitlab.train import MaskedPatchPretraining, ViTClassifier
from vitlab.train.objectives.mpp import (
    CLEAN,
    KEPT,
    MASKED,
    RANDOM,
    Corruption,
    apply_corruption,
    draw_corruption,
    mean_color_ids,
)
from helpers import image_tree

REPO = Path(__file__).resolve().parents[1]
# A small encoder of the CPU recipes' kind: conv tokenizer, sequence pooling, no class token.
TINY = {"stem": "conv", "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0,
        "class_token": False, "pool": "seq"}  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """These models are tiny: a second thread costs more in synchronisation than it computes, and on a
    busy machine far more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def real_images(root: Path, split: str, n: int) -> torch.Tensor:
    """n images spread over the classes of a cifar10-subset split, as [n, 3, 32, 32] in [0, 1]."""
    files = sorted((root / split).glob("*/*.png"))
    files = files[:: max(1, len(files) // n)][:n]
    return torch.stack([TF.to_tensor(Image.open(f).convert("RGB")) for f in files])


# ---- 1. corruption ---------------------------------------------------------------------------------


def test_corruption_statistics_on_a_large_batch() -> None:
    b, n, d = 2048, 16, 8
    kind, source = draw_corruption(b, n, generator=torch.Generator().manual_seed(0))

    # Exactly half of every image's patches: the count is fixed per image, so the tolerance is zero.
    corrupted = kind != CLEAN
    assert corrupted.sum(dim=1).eq(n // 2).all()
    # Every position is chosen equally often: per position, a binomial(b, 1/2) count, 5 sigma = 5 * sqrt(b / 4).
    assert (corrupted.sum(dim=0).float() - b / 2).abs().max() < 5 * math.sqrt(b / 4)
    # Of the corrupted ones, 80 / 10 / 10: each independently, so the fractions are binomial over
    # m = b * n / 2 = 16384 draws; 5 sigma of sqrt(p (1 - p) / m) is 0.016 for 0.8 and 0.012 for 0.1.
    m = int(corrupted.sum())
    for which, p in [(MASKED, 0.8), (RANDOM, 0.1), (KEPT, 0.1)]:
        frac = float((kind == which).sum()) / m
        assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / m), (which, frac)

    tokens, mask_token = torch.randn(b, n, d), torch.randn(d)
    out = apply_corruption(tokens, Corruption(kind, source), mask_token)
    flat_in, flat_out, k = tokens.reshape(-1, d), out.reshape(-1, d), kind.flatten()
    # Uncorrupted and kept tokens are untouched; masked ones are the mask token.
    assert torch.equal(flat_out[(k == CLEAN) | (k == KEPT)], flat_in[(k == CLEAN) | (k == KEPT)])
    assert torch.equal(flat_out[k == MASKED], mask_token.expand(int((k == MASKED).sum()), d))
    # A randomly replaced token holds another patch's embedding (random floats: each row is unique).
    where = {tuple(row): i for i, row in enumerate(flat_in.tolist())}
    assert len(where) == b * n
    rows = torch.nonzero(k == RANDOM).flatten().tolist()
    assert all(where.get(tuple(flat_out[r].tolist()), r) != r for r in rows)


def test_the_encoder_sees_the_paper_corruption_of_patch_embeddings() -> None:
    """Through the module with the paper's patch tokenizer: the tokens entering the first block
    (less the position embedding) are the clean embeddings except where corrupted."""
    model = MaskedPatchPretraining(model_args={"patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2},
                                   img_size=32).eval()  # fmt: skip
    x = torch.randn(64, 3, 32, 32)
    seen: list[torch.Tensor] = []
    model.model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        _, (kind, source) = model(x, torch.Generator().manual_seed(0))
        clean = model.model.patch_embed(x).reshape(-1, 32)
    got = (seen[0] - model.model.pos_embed)[:, 1:].reshape(-1, 32)  # the class token comes first
    k, src = kind.flatten(), source.flatten()
    assert set(k.tolist()) == {CLEAN, MASKED, RANDOM, KEPT}
    untouched = (k == CLEAN) | (k == KEPT)
    torch.testing.assert_close(got[untouched], clean[untouched], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[k == MASKED], model.mask_token.reshape(1, 32).expand(int((k == MASKED).sum()), 32),
                               rtol=0, atol=1e-6)  # fmt: skip
    random = k == RANDOM
    assert (src[random] != torch.nonzero(random).flatten()).all()
    torch.testing.assert_close(got[random], clean[src[random]], rtol=0, atol=1e-6)


# ---- 2. the 3-bit colour target ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "rgb, expected",
    [((1.0, 0.0, 0.0), 448), ((0.0, 1.0, 0.0), 56), ((0.0, 0.0, 1.0), 7), ((1.0, 1.0, 1.0), 511),
     ((0.0, 0.0, 0.0), 0), ((0.5, 0.25, 0.125), 4 * 64 + 2 * 8 + 1), ((0.124, 0.126, 0.999), 0 * 64 + 1 * 8 + 7)],
)  # fmt: skip
def test_mean_color_ids_of_solid_images(rgb: tuple[float, float, float], expected: int) -> None:
    """id = 64 r + 8 g + b with each channel's patch mean quantised to floor(8 m), 7 at most."""
    image = torch.tensor(rgb).view(1, 3, 1, 1).expand(1, 3, 16, 16)
    assert mean_color_ids(image, 4).tolist() == [[expected] * 16]


def test_mean_color_ids_use_each_patch_mean() -> None:
    # Red in columns 0-5, blue in 6-15: the first 8px patch averages both, the second is pure blue.
    image = torch.zeros(1, 3, 8, 16)
    image[:, 0, :, :6] = 1.0
    image[:, 2, :, 6:] = 1.0
    # Patches (8x8): [0:8] has red mean 6/8 = 0.75 -> 6, blue 2/8 -> 2; [8:16] pure blue -> 7.
    assert mean_color_ids(image, 8).tolist() == [[6 * 64 + 2, 7]]


# ---- 3. learning on real images -----------------------------------------------------------------------


def test_loss_falls_and_accuracy_beats_the_constant_colour_on_real_images(cifar_subset: Path) -> None:
    train, val = real_images(cifar_subset, "train", 512), real_images(cifar_subset, "val", 256)
    normalise = lambda x: (x - 0.5) / 0.5  # noqa: E731 - the module's default data_config mean/std
    # The paper's patch tokenizer, 4px patches: 32 corrupted patches per image to learn from.
    model = MaskedPatchPretraining(model_args={"patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 2},
                                   img_size=32)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    # The constant-colour baseline: always answer the commonest colour of the training patches.
    commonest = mean_color_ids(train, 4).flatten().bincount(minlength=512).argmax()
    baseline = float((mean_color_ids(val, 4) == commonest).float().mean())

    def evaluate() -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            loss, acc, *_ = model.objective(normalise(val), torch.Generator().manual_seed(1))
        model.train()
        return float(loss), float(acc)

    loss0, _ = evaluate()
    assert loss0 == pytest.approx(math.log(512), abs=0.3)  # an untrained head: near-uniform over 512 colours
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        loss, *_ = model.objective(normalise(train[torch.randint(0, len(train), (32,), generator=g)]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss1, acc1 = evaluate()
    assert loss1 < loss0 - 1.8, (loss0, loss1)
    # 8192 corrupted validation patches: the accuracy's standard error is about 0.0025 (it reaches
    # 0.10-0.12 against a baseline of 0.049 here; the margin allows for seed-to-seed swings).
    assert acc1 > baseline + 0.02, (acc1, baseline)


# ---- 4. MPP checkpoint -> init_from -> classifier -----------------------------------------------------


def mpp_checkpoint(tmp_path: Path, model: MaskedPatchPretraining, steps: int = 2) -> Path:
    """A Lightning checkpoint of `model` after a few real optimizer steps (random images)."""
    data = TensorDataset(torch.rand(8, 3, 32, 32) * 2 - 1, torch.full((8,), -1))
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=4))
    path = tmp_path / "mpp.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize(
    "model_args",
    [TINY, {"patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2}],  # conv + seq pool; patch + class token
    ids=["conv-seqpool", "patch-cls"],
)
def test_mpp_checkpoint_initialises_a_classifier_at_a_new_resolution(tmp_path: Path, model_args: dict) -> None:
    mpp = MaskedPatchPretraining(model_args=model_args, img_size=32, lr=1e-2)
    before = {k: v.clone() for k, v in mpp.model.state_dict().items()}
    ckpt = mpp_checkpoint(tmp_path, mpp)
    encoder = mpp.model.state_dict()
    assert not torch.equal(encoder["blocks.0.attn.qkv.weight"], before["blocks.0.attn.qkv.weight"])  # it trained
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert {"mask_token", "mpp_head.weight", "mpp_head.bias"} <= set(saved["state_dict"])

    clf = ViTClassifier(arch="vit_tiny_patch16", model_args=model_args, num_classes=10, img_size=64,
                        init_from=str(ckpt))  # fmt: skip
    tuned = clf.model.state_dict()
    assert not any("mask_token" in k or "mpp_head" in k for k in clf.state_dict())
    # Every encoder tensor carries over bit for bit, except the resampled position embedding.
    same = [k for k in encoder if k != "pos_embed" and not k.startswith("head")]
    assert same and all(torch.equal(tuned[k], encoder[k]) for k in same)
    assert set(tuned) - set(encoder) == {"head.weight", "head.bias"}
    # The new head: zero-initialised, 10 classes.
    assert tuned["head.weight"].shape == (10, 64) and not tuned["head.weight"].any() and not tuned["head.bias"].any()
    # Position embeddings resampled to the 64px grid by timm's rule (bicubic, antialiased).
    p = model_args["patch_size"]
    prefix = clf.model.num_prefix_tokens
    expected = timm.layers.resample_abs_pos_embed(
        encoder["pos_embed"], new_size=[64 // p, 64 // p], old_size=[32 // p, 32 // p], num_prefix_tokens=prefix
    )
    assert tuned["pos_embed"].shape == (1, prefix + (64 // p) ** 2, 64)
    torch.testing.assert_close(tuned["pos_embed"], expected)


# ---- 5. unlabelled data ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unlabelled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same 24 generated images as a flat folder (no class folders) and as shards without `.cls` in
    train/ (two shards, 16 images) and val/ (one, 8), the Tiny-ImageNet layout."""
    root = tmp_path_factory.mktemp("unlabelled")
    files = sorted((image_tree(root / "generated", ["a", "b", "c"], 8, 0) / "train").glob("*/*.png"))
    folder, shards = root / "images", root / "shards"
    for d in (folder, shards / "train", shards / "val"):
        d.mkdir(parents=True)
    for i, f in enumerate(files):
        (folder / f"img{i:03d}.png").symlink_to(f)
    for split, s, part in [("train", 0, files[:8]), ("train", 1, files[8:16]), ("val", 0, files[16:])]:
        with tarfile.open(shards / split / f"part-{s:06d}.tar", "w") as tar:
            for i, f in enumerate(part):
                tar.add(f, arcname=f"{split}{s}-{i:06d}.png")
    return folder, shards


DATA_ARGS = {"img_size": 32, "batch_size": 4, "num_workers": 0, "auto_augment": None, "crop_pct": 1.0,
             "val_fraction": 0.25, "labels": False}  # fmt: skip


@pytest.mark.parametrize("kind", ["folder", "shards", "shards-in-memory"])
def test_unlabelled_data_yields_images_with_label_minus_one(unlabelled: tuple[Path, Path], kind: str) -> None:
    folder, shards = unlabelled
    if kind == "folder":
        dm = ImageFolderDataModule(root=str(folder), **DATA_ARGS)
    else:
        dm = ShardDataModule(train_shards=str(shards / "train"), val_shards=str(shards / "val"),
                             in_memory=kind == "shards-in-memory", **DATA_ARGS)  # fmt: skip
    dm.setup("fit")
    assert dm.num_classes == 0 and dm.data_config["class_names"] is None
    seen = 0
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for images, labels in loader:
            if kind == "shards-in-memory":  # uint8 batches, augmented and normalised after the transfer
                images = dm.on_after_batch_transfer((images, labels), 0)[0]
            assert images.shape[1:] == (3, 32, 32) and images.dtype == torch.float32
            assert labels.tolist() == [-1] * len(labels)
            seen += len(labels)
    assert seen == 24  # every image, in train or held-out val


def test_a_classifier_pointed_at_unlabelled_data_is_told_the_fix(unlabelled: tuple[Path, Path], tmp_path: Path) -> None:
    folder, shards = unlabelled
    recipe = ["--config", str(REPO / "recipes/pretrain/cifar10_vit_tiny_cpu.yaml"), "--run_dir", str(tmp_path)]
    with pytest.raises(FileNotFoundError, match=r"no class folders in .*images.*MaskedPatchPretraining"):
        VitlabCLI(args=[*recipe, "--data_path", str(folder)], run=False)
    with pytest.raises(KeyError, match=r"no \.cls label \(has png\); a classifier needs labelled data.*labels: false"):
        VitlabCLI(args=[*recipe, "--data_path", str(shards / "train")], run=False)
    with pytest.raises(SystemExit, match=r"without labels \(labels: false\) but ViTClassifier trains on labels"):
        VitlabCLI(args=[*recipe, "--data_path", str(folder), "--data.labels=false"], run=False)


# ---- the CLI: the MPP recipe, then the fine-tune recipe from its checkpoint ------------------------------


def test_a_recipe_naming_its_module_is_checked_against_that_module(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  class_path: vitlab.train.MaskedPatchPretraining\n  init_args:\n    mask_ratoi: 0.8\n")
    with pytest.raises(SystemExit, match=r"unknown key .*model\.init_args\.mask_ratoi; did you mean 'mask_ratio'"):
        check_recipe(str(bad))
    bad.write_text("model:\n  class_path: vitlab.train.MaskedPatchPretraining\n  init_args:\n"
                   "    model_args:\n      patchsize: 8\n")  # fmt: skip
    with pytest.raises(SystemExit, match=r"model\.init_args\.model_args\.patchsize; did you mean 'patch_size'"):
        check_recipe(str(bad))
    bad.write_text("model:\n  class_path: vitlab.train.NoSuchModule\n")
    with pytest.raises(SystemExit, match=r"'vitlab.train.NoSuchModule' cannot be imported"):
        check_recipe(str(bad))
    check_recipe(str(REPO / "recipes/pretrain/tinyimagenet_mpp_cpu.yaml"))  # the shipped recipe passes


def test_mpp_recipe_through_the_cli_then_finetune_from_its_checkpoint(
    unlabelled: tuple[Path, Path], tmp_path: Path
) -> None:
    _, shards = unlabelled  # train/ + val/ shards without labels, read through the recipe's in-memory path
    pre_run, ft_run = tmp_path / "pretrain", tmp_path / "finetune"
    quick = ["--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.log_every_n_steps=1",
             "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--loggers=[csv]",
             "--data.batch_size=4"]  # fmt: skip
    main(["fit", "--config", str(REPO / "recipes/pretrain/tinyimagenet_mpp_cpu.yaml"), "--data_path", str(shards),
          "--run_dir", str(pre_run), *quick])  # fmt: skip
    with open(pre_run / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(0 < v < 8 for v in losses)  # cross-entropy over 512 colours: ln 512 = 6.2
    assert [r["val/acc1"] for r in rows if r.get("val/acc1")]
    assert (pre_run / "figures" / "masked_patches.png").is_file()
    ckpt = pre_run / "checkpoints" / "last.ckpt"
    encoder = load_pretrained(ckpt)
    assert encoder.num_classes == 0 and encoder.patch_embed.grid_size == (4, 4)

    # What `make finetune CKPT=...` runs, with the CPU fine-tune recipe on a labelled tree at 64px.
    lab = image_tree(tmp_path / "lab", ["cat", "dog"], 6, 2)
    ft = ["fit", "--config", str(REPO / "recipes/finetune/cifar10_vit_tiny_64px_cpu.yaml"), "--run_dir", str(ft_run),
          "--model.init_from", str(ckpt), "--data_path", str(lab), *quick]  # fmt: skip
    model = VitlabCLI(args=ft[1:], run=False).model.model
    assert model.num_classes == 2 and model.patch_embed.grid_size == (8, 8)
    assert all(torch.equal(v, model.blocks.state_dict()[k]) for k, v in encoder.blocks.state_dict().items())
    main(ft)
    tuned = load_pretrained(ft_run / "checkpoints" / "last.ckpt")
    assert tuned.num_classes == 2 and tuned.data_config["class_names"] == ["cat", "dog"]


def test_init_log_lists_kept_new_and_dropped_tensors(tmp_path: Path) -> None:
    mpp = MaskedPatchPretraining(model_args=TINY, img_size=32)
    ckpt = mpp_checkpoint(tmp_path, mpp)
    s = ViTClassifier(
        arch="vit_tiny_patch16", model_args=TINY, num_classes=10, img_size=64, init_from=str(ckpt)
    ).init_summary
    assert s["tensors_dropped"] == "mask_token, mpp_head.bias, mpp_head.weight"
    assert s["tensors_new"] == "head.weight, head.bias" and int(s["tensors_kept"]) == len(mpp.model.state_dict())
