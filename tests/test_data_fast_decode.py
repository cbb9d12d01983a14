"""The 224px data paths (decode="cpu" and decode="device", vitlab.data.fast_decode / device_prep) on
generated ImageNet-size JPEGs (500x375 gradients + noise, made here): reduced-scale decode against a full
decode, crop statistics against torchvision's RandomResizedCrop, eval pixels against eval_transform, bad
and unusual images, and the data modules end to end."""

from __future__ import annotations

import io
import math
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from vitlab.data import BadImageError, ImageFolderDataModule, ShardDataModule, eval_transform
from vitlab.data.decode import load_rgb
from vitlab.data.device_prep import DeviceBatchPrep, EncodedBatch, EncodedImage, KeepEncoded, decode_batch
from vitlab.data.fast_decode import FastEvalDecode, FastTrainDecode, dct_scale, reduced_decode

W, H = 500, 375  # ImageNet's typical size


def photo(seed: int, w: int = W, h: int = H) -> np.ndarray:
    """A smooth 'photograph': colour gradients, a few blobs and mild noise, HxWx3 uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([255 * x / w, 255 * y / h, 128 + 60 * np.sin(x / 37 + y / 23 + seed)], axis=-1)
    for _ in range(3):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(20, 80)
        img += (80 * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r)))[..., None] * rng.uniform(-1, 1, 3)
    img += rng.normal(0, 4, img.shape)
    return img.clip(0, 255).astype(np.uint8)


def jpeg(arr: np.ndarray, mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [jpeg(photo(i)) for i in range(8)]


def test_reduced_scale_decode_matches_full_decode_and_resize(photos: list[bytes]) -> None:
    """libjpeg's 1/2 and 1/4 DCT decodes against PIL's full decode + antialiased resize to that size."""
    for data in photos:
        for scale in (2, 4):
            img = Image.open(io.BytesIO(data))
            assert dct_scale(img, W // scale, H // scale) == scale
            small = TF.pil_to_tensor(reduced_decode(img, scale, "x")).float()
            full = TF.pil_to_tensor(load_rgb(data).resize((small.shape[2], small.shape[1]), Image.Resampling.BOX))
            diff = (small - full.float()).abs()
            assert small.shape[1:] == (math.ceil(H / scale), math.ceil(W / scale))
            assert diff.mean() < 2.5 and diff.quantile(0.99) < 12, (scale, diff.mean(), diff.quantile(0.99))
    # no reduction where it would leave fewer pixels than needed, nor for other formats
    img = Image.open(io.BytesIO(photos[0]))
    assert dct_scale(img, W // 2 + 1, H // 2) == 1
    assert dct_scale(Image.open(io.BytesIO(jpeg(photo(0), fmt="PNG"))), 10, 10) == 1


def ks(a: np.ndarray | list, b: np.ndarray | list) -> float:
    """Two-sample Kolmogorov-Smirnov distance, divided by its 0.1% critical value (> 1: different laws)."""
    a, b = np.sort(np.asarray(a, dtype=float)), np.sort(np.asarray(b, dtype=float))
    grid = np.concatenate([a, b])
    d = np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b)).max()
    return float(d / (1.95 * math.sqrt((len(a) + len(b)) / (len(a) * len(b)))))


def _crop_stats(src: np.ndarray, out: torch.Tensor) -> tuple[float, float, bool]:
    """(area fraction, log aspect, flipped) of the box `out` was cut from, read off the R=x, G=y ramps."""
    r, g = out[0].float(), out[1].float()
    left, right = r[:, 0].mean() / 255 * W, r[:, -1].mean() / 255 * W
    top, bottom = g[0].mean() / 255 * H, g[-1].mean() / 255 * H
    flipped = bool(right < left)
    w, h = abs(right - left) * (1 + 1 / out.shape[-1]), (bottom - top) * (1 + 1 / out.shape[-2])
    return float(w * h / (W * H)), float(math.log(w / h)), flipped


def test_rrc_statistics_match_torchvision() -> None:
    """The crop boxes the fast path cuts (read back from the output's coordinate ramps, through the
    reduced-scale decode where it applies) have torchvision RandomResizedCrop's area and aspect laws,
    and half the crops are flipped. A wrong scale or ratio range fails the KS tests."""
    y, x = np.mgrid[0:H, 0:W].astype(np.float32)
    ramps = np.stack([255 * (x + 0.5) / W, 255 * (y + 0.5) / H, np.full_like(x, 128)], -1).astype(np.uint8)
    data = jpeg(ramps)
    torch.manual_seed(0)
    fast = FastTrainDecode(112)  # 112 px: many crops allow a 1/2-scale decode, so it is exercised
    got = [_crop_stats(ramps, fast(data)) for _ in range(600)]
    ref_img = torch.zeros(3, H, W)
    ref = []
    for _ in range(3000):
        _, _, h, w = T.RandomResizedCrop.get_params(ref_img, [0.08, 1.0], [3 / 4, 4 / 3])
        ref.append((w * h / (W * H), math.log(w / h)))
    area, aspect = np.array([g[0] for g in got]), np.array([g[1] for g in got])
    ref_area, ref_aspect = np.array([r[0] for r in ref]), np.array([r[1] for r in ref])
    assert ks(area, ref_area) < 1 and ks(aspect, ref_aspect) < 1
    # the test has power: a crop law with scale (0.25, 1) or ratio (1/2, 2) is told apart
    wrong_area = [T.RandomResizedCrop.get_params(ref_img, [0.25, 1.0], [3 / 4, 4 / 3]) for _ in range(600)]
    assert ks(area, [h * w / (W * H) for _, _, h, w in wrong_area]) > 2
    wrong_ratio = [T.RandomResizedCrop.get_params(ref_img, [0.08, 1.0], [1 / 2, 2]) for _ in range(600)]
    assert ks(aspect, [math.log(w / h) for _, _, h, w in wrong_ratio]) > 2
    flips = sum(g[2] for g in got)
    assert abs(flips - 300) < 4 * math.sqrt(600 * 0.25)


def test_train_crop_pixels_match_torchvision_resized_crop(photos: list[bytes]) -> None:
    """With the box fixed, the fast path's pixels are torchvision's resized_crop of the full decode."""
    fast = FastTrainDecode(224, hflip=False)
    for data in photos[:4]:
        torch.manual_seed(1)
        out = fast(data).float()
        torch.manual_seed(1)
        top, left, h, w = T.RandomResizedCrop.get_params(load_rgb(data), [0.08, 1.0], [3 / 4, 4 / 3])
        ref = TF.pil_to_tensor(TF.resized_crop(load_rgb(data), top, left, h, w, [224, 224],
                                               v2.InterpolationMode.BICUBIC, antialias=True)).float()  # fmt: skip
        assert out.shape == (3, 224, 224)
        assert (out - ref).abs().mean() < 2.0


def test_eval_pixels_match_eval_transform(photos: list[bytes]) -> None:
    cfg = dict(img_size=[224, 224], crop_pct=0.9, mean=[0.5] * 3, std=[0.5] * 3, interpolation="bicubic")
    ref_t = v2.Compose(eval_transform(cfg).transforms[:3])
    for size, crop_pct in ((224, 0.9), (96, 0.875)):  # 96 / 0.875: a 1/2-scale decode applies
        fast = FastEvalDecode(size, crop_pct)
        ref_t = v2.Compose(eval_transform({**cfg, "img_size": [size, size], "crop_pct": crop_pct}).transforms[:3])
        for data in photos[:4]:
            out, ref = fast(data), TF.pil_to_tensor(ref_t(load_rgb(data)))
            assert out.dtype == torch.uint8 and out.shape == ref.shape == (3, size, size)
            assert (out.float() - ref.float()).abs().mean() < 2.0


@pytest.mark.parametrize("mode", ["L", "CMYK", "PNG", "P"])
def test_grey_cmyk_png_and_palette_load_as_rgb(mode: str) -> None:
    arr = photo(3)
    data = jpeg(arr, fmt="PNG") if mode == "PNG" else jpeg(arr, "P", "PNG") if mode == "P" else jpeg(arr, mode)
    ref = TF.pil_to_tensor(load_rgb(data)).float()
    for out in (FastEvalDecode(224, 1.0)(data), decode_batch(EncodedBatch([EncodedImage(data, "k")]), "cpu")[0]):
        assert out.shape[0] == 3
        want = TF.pil_to_tensor(TF.center_crop(TF.resize(load_rgb(data), 224, antialias=True), 224)).float() \
            if out.shape[-1] == 224 else ref  # fmt: skip
        assert (out.float() - want).abs().mean() < 6, mode  # CMYK and grey: libjpeg vs PIL colour conversion
    assert FastTrainDecode(224, auto_augment="randaugment")(data).shape == (3, 224, 224)


@pytest.mark.parametrize("bad", [b"", b"not an image at all", "truncated"])
def test_bad_bytes_are_named(photos: list[bytes], bad: bytes | str) -> None:
    data = photos[0][:4000] if bad == "truncated" else bad
    for fn in (FastTrainDecode(224), FastEvalDecode(224)):
        with pytest.raises(BadImageError, match="shard-3.tar:key7"):
            fn(data, "shard-3.tar:key7")
    with pytest.raises(BadImageError, match="shard-3.tar:key7"):
        decode_batch(EncodedBatch([EncodedImage(photos[1], "ok"), EncodedImage(data, "shard-3.tar:key7")]), "cpu")


def test_device_prep_matches_the_cpu_path(photos: list[bytes]) -> None:
    """decode="device" on the CPU: eval pixels as eval_transform's; train crops of the RRC law, flipped
    in half of the batch, normalised."""
    mean, std = [0.5] * 3, [0.5] * 3
    prep = DeviceBatchPrep(224, 0.08, True, mean, std, crop_pct=0.9)
    batch = EncodedBatch([KeepEncoded()(d, f"k{i}") for i, d in enumerate(photos)])
    x, y = prep(batch, torch.arange(8), train=False)
    ref_t = eval_transform(dict(img_size=[224, 224], crop_pct=0.9, mean=mean, std=std))
    ref = torch.stack([ref_t(load_rgb(d)) for d in photos])
    assert x.shape == ref.shape and (x - ref).abs().mean() < 2.0 / 127.5
    assert torch.equal(y, torch.arange(8))
    x, _ = prep(batch, torch.arange(8), train=True, size=96)
    assert x.shape == (8, 3, 96, 96) and x.dtype == torch.float32 and -1 <= x.min() and x.max() <= 1


def _tree(root: Path, n_per_class: int = 4) -> Path:
    for split in ("train", "val"):
        for k, c in enumerate(("cat", "dog")):
            (root / split / c).mkdir(parents=True)
            for i in range(n_per_class):
                (root / split / c / f"{c}{i}.jpg").write_bytes(jpeg(photo(10 * k + i + (split == "val") * 100)))
    return root


def _shards(root: Path, src: Path) -> Path:
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        with tarfile.open(root / split / "s-000000.tar", "w") as tar:
            for i, f in enumerate(sorted((src / split).rglob("*.jpg"))):
                for ext, data in (("jpg", f.read_bytes()), ("cls", str(int(f.parent.name == "dog")).encode())):
                    info = tarfile.TarInfo(f"{f.stem}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        (root / split / "classes.txt").write_text("cat\ndog\n")
    return root


@pytest.mark.parametrize("decode", ["cpu", "device"])
@pytest.mark.parametrize("kind", ["folder", "shards"])
def test_data_modules_serve_normalised_batches_on_the_device_side(tmp_path: Path, decode: str, kind: str) -> None:
    """Workers hand over uint8 crops (cpu) or bytes (device); on_after_batch_transfer gives what the
    decode="pil" path gives: normalised float at the train size, eval pixels as eval_transform's."""
    tree = _tree(tmp_path / "tree")
    common = dict(img_size=96, batch_size=4, num_workers=0, auto_augment=None, mixup_alpha=0.8, crop_pct=0.875)
    if kind == "folder":
        make = lambda d: ImageFolderDataModule(str(tree), decode=d, **common)  # noqa: E731
    else:
        sh = _shards(tmp_path / "sh", tree)
        make = lambda d: ShardDataModule(str(sh / "train"), val_shards=str(sh / "val"), decode=d, **common)  # noqa: E731
    dm, ref_dm = make(decode), make("pil")
    for m in (dm, ref_dm):
        m.setup("fit")
    dm.trainer = SimpleNamespace(training=True, current_epoch=0, world_size=1, global_rank=0, num_devices=1)
    raw = next(iter(dm.train_dataloader()))
    if decode == "cpu":
        assert raw[0].dtype == torch.uint8 and raw[0].shape == (4, 3, 96, 96)
    else:
        assert isinstance(raw[0], EncodedBatch) and len(raw[0]) == 4
    x, y = dm.on_after_batch_transfer(raw, 0)
    assert x.shape == (4, 3, 96, 96) and x.dtype == torch.float32 and y.shape == (4, 2)  # mixed soft targets
    assert torch.allclose(y.sum(1), torch.ones(4))
    dm.trainer.training = False
    xs = torch.cat([dm.on_after_batch_transfer(b, 0)[0] for b in dm.val_dataloader()])
    refs = torch.cat([b[0] for b in ref_dm.val_dataloader()])
    assert xs.shape == refs.shape == (8, 3, 96, 96)
    assert (xs - refs).abs().mean() < 2.0 / 127.5


def test_decode_settings_are_checked(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree", 1)
    with pytest.raises(ValueError, match="train_crop='rrc'"):
        ImageFolderDataModule(str(tree), decode="cpu", train_crop="pad")
    with pytest.raises(ValueError, match="unknown decode"):
        ImageFolderDataModule(str(tree), decode="gpu")
    with pytest.raises(ValueError, match="skip_bad_images"):
        ImageFolderDataModule(str(tree), decode="device", skip_bad_images=True)


@pytest.mark.parametrize("decode", ["cpu", "device"])
def test_fit_under_a_real_trainer_sees_normalised_float_batches(tmp_path: Path, decode: str) -> None:
    """Lightning calls the data module's on_after_batch_transfer: the model gets float batches at the
    train size (normalised, mixed targets) in training and at img_size in validation."""
    import lightning as L

    seen: list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...]]] = []

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3 * 64 * 64, 2)

        def training_step(self, batch, _):
            x, y = batch
            seen.append(("train", x.dtype, tuple(x.shape), tuple(y.shape)))
            return torch.nn.functional.cross_entropy(self.lin(x.flatten(1)), y)

        def validation_step(self, batch, _):
            x, y = batch
            seen.append(("val", x.dtype, tuple(x.shape), tuple(y.shape)))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    dm = ImageFolderDataModule(str(_tree(tmp_path / "tree")), img_size=64, batch_size=4, num_workers=1,
                               auto_augment="randaugment", cutmix_alpha=1.0, decode=decode)  # fmt: skip
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))  # fmt: skip
    trainer.fit(Probe(), datamodule=dm)
    assert seen == [("train", torch.float32, (4, 3, 64, 64), (4, 2))] * 2 + [("val", torch.float32, (4, 3, 64, 64), (4,))]
