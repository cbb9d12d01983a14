"""Public checkpoints by name (`hf-hub:ORG/NAME[@REV]`, `https://...`), without a network: each test
builds a Hugging Face cache in huggingface_hub's own layout (refs/, snapshots/<commit>/ -> blobs/)
holding a tiny random ViT, with downloads off (HF_HUB_OFFLINE=1), and checks vitlab against timm's and
transformers' own loaders reading the same cache. URLs are served from a local HTTP server."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import transformers
import yaml
from PIL import Image
from safetensors.torch import load_file, save_file
from timm.models._hub import save_for_hf

from helpers import perturb
from vitlab.cli import main
from vitlab.interop import CheckpointError, SourceError, load_pretrained, resolve_source
from vitlab.interop.hub import parse_hub

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY_ARGS = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 3}
NAMES = ["cat", "dog", "bird"]


def put_repo(cache: Path, repo: str, folder: Path, commit: str = COMMIT) -> Path:
    """Copy `folder` into the cache as huggingface_hub lays out a downloaded repo; returns the snapshot."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    snapshot, blobs = root / "snapshots" / commit, root / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache with downloads off, for this process (huggingface_hub reads its environment at
    import, so its constants are set too) and for the CLI subprocesses (the environment)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "TORCH_HOME": str(tmp_path / "torch")}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


# A ResNet-stem hybrid (timm's R+ViT-Ti/16, root conv only): 64px -> stride-4 map -> 8x8 projection, 2x2 grid.
HYBRID_ARGS = {"img_size": 64, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2, "num_classes": 3}


def timm_repo(
    hub: Path, tmp_path: Path, repo: str = "acme/vit-tiny-timm", std: float = 0.02, arch: str = "vit_tiny_patch16_224"
) -> torch.nn.Module:
    args = HYBRID_ARGS if "_r_" in arch else TINY_ARGS
    peer = perturb(timm.create_model(arch, **args), std)
    folder = tmp_path / "timm_export"
    save_for_hf(peer, str(folder), model_config={"label_names": NAMES}, model_args=args,
                safe_serialization="both")  # fmt: skip
    put_repo(hub, repo, folder)
    return peer


def _tiny_hf_config(cls: type, **kw: object) -> object:
    labels = {"id2label": dict(enumerate(NAMES)), "label2id": {n: i for i, n in enumerate(NAMES)}}
    return cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
               patch_size=8, num_labels=3, **labels, **kw)  # fmt: skip


def hf_repo(hub: Path, tmp_path: Path, deit: bool = False) -> tuple[str, torch.nn.Module]:
    if deit:
        repo = "acme/deit-tiny-distilled"
        peer = transformers.DeiTForImageClassificationWithTeacher(_tiny_hf_config(transformers.DeiTConfig))
        processor = transformers.DeiTImageProcessor(
            size={"height": 40, "width": 40}, crop_size={"height": 32, "width": 32},
            image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
        )  # fmt: skip
    else:
        repo = "acme/vit-tiny-hf"
        peer = transformers.ViTForImageClassification(_tiny_hf_config(transformers.ViTConfig))
        processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.4, 0.45, 0.5],
                                                   image_std=[0.2, 0.25, 0.3])  # fmt: skip
    perturb(peer)
    folder = tmp_path / f"{repo.split('/')[1]}_export"
    peer.save_pretrained(folder)
    processor.save_pretrained(folder)
    put_repo(hub, repo, folder)
    return repo, peer


# ---- names that resolve, and parity with the peers' own hub loaders ----------------------------------


@pytest.mark.parametrize("arch", ["vit_tiny_patch16_224", "vit_tiny_r_s16_p8_224"], ids=["vit", "hybrid"])
def test_timm_repo_matches_timm_reading_the_same_cache(hub: Path, tmp_path: Path, arch: str) -> None:
    timm_repo(hub, tmp_path, arch=arch)
    ours = load_pretrained("hf-hub:acme/vit-tiny-timm")
    theirs = timm.create_model("hf-hub:acme/vit-tiny-timm", pretrained=True).eval()
    size = (HYBRID_ARGS if "_r_" in arch else TINY_ARGS)["img_size"]
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert (ours(x) - theirs(x)).abs().max() <= 1e-4
    assert ours.data_config["class_names"] == NAMES
    assert ours.data_config["mean"] == list(theirs.pretrained_cfg["mean"])
    if "_r_" in arch:
        assert ours.config["stem"] == "resnet"
        return
    # A revision: the commit itself, and the branch that points at it.
    for rev in (COMMIT, "main"):
        pinned = resolve_source(f"hf-hub:acme/vit-tiny-timm@{rev}")
        assert pinned.pinned == f"hf-hub:acme/vit-tiny-timm@{COMMIT}" and pinned.revision == COMMIT
        assert pinned.path.name == "model.safetensors" and pinned.path.parent.name == COMMIT


@pytest.mark.parametrize("deit", [False, True], ids=["vit", "deit_distilled"])
def test_transformers_repo_matches_from_pretrained_reading_the_same_cache(
    hub: Path, tmp_path: Path, deit: bool
) -> None:
    repo, _ = hf_repo(hub, tmp_path, deit)
    ours = load_pretrained(f"hf-hub:{repo}")
    cls = transformers.DeiTForImageClassificationWithTeacher if deit else transformers.ViTForImageClassification
    theirs = cls.from_pretrained(repo, cache_dir=str(hub), local_files_only=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - theirs(pixel_values=x).logits).abs().max() <= 1e-4
    assert ours.distilled == deit and ours.data_config["class_names"] == NAMES
    if deit:  # DeiTImageProcessor: 40 -> crop 32, bicubic, ImageNet statistics
        assert ours.data_config["crop_pct"] == pytest.approx(0.8) and ours.data_config["interpolation"] == "bicubic"
        assert ours.data_config["mean"] == pytest.approx([0.485, 0.456, 0.406])
    else:  # the repo's preprocessor_config.json, not transformers' defaults
        assert ours.data_config["mean"] == pytest.approx([0.4, 0.45, 0.5])
        assert ours.data_config["std"] == pytest.approx([0.2, 0.25, 0.3])
        assert ours.data_config["interpolation"] == "bilinear" and ours.data_config["crop_pct"] == 1.0


def test_transformers_vit_hybrid_repo_matches_transformers_4(hub: Path, tmp_path: Path) -> None:
    """ViTHybridForImageClassification left transformers in 5.x; tests/data/vit_hybrid_tiny holds a tiny
    random one written by transformers 4.44.2 (make_fixture.py) and its logits on a fixed input."""
    fixture = Path(__file__).parent / "data" / "vit_hybrid_tiny"
    folder = tmp_path / "hybrid"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((fixture / name).read_bytes())
    put_repo(hub, "acme/vit-hybrid-tiny", folder)
    model = load_pretrained("hf-hub:acme/vit-hybrid-tiny")
    expected = load_file(str(fixture / "expected.safetensors"))
    with torch.no_grad():
        assert (model(expected["pixel_values"]) - expected["logits"]).abs().max() <= 1e-4
    assert model.config["stem"] == "resnet" and model.data_config["class_names"] == NAMES


def test_a_repo_with_pytorch_model_bin_only(hub: Path, tmp_path: Path) -> None:
    peer = perturb(timm.create_model("vit_tiny_patch16_224", **TINY_ARGS))
    folder = tmp_path / "bin_only"
    save_for_hf(peer, str(folder), model_args=TINY_ARGS, safe_serialization=False)
    assert not (folder / "model.safetensors").exists()
    put_repo(hub, "acme/bin-only", folder)
    resolved = resolve_source("hf-hub:acme/bin-only")
    assert resolved.path.name == "pytorch_model.bin"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (load_pretrained("hf-hub:acme/bin-only")(x) - peer(x)).abs().max() <= 1e-4


def test_hub_name_spelling() -> None:
    assert parse_hub("hf-hub:google/vit-base-patch16-224@v1.0") == ("google/vit-base-patch16-224", "v1.0")
    assert parse_hub("hf-hub:acme/x") == ("acme/x", None)
    with pytest.raises(SourceError, match="not a hub name"):
        parse_hub("hf-hub:a/b/c")


# ---- through the CLI ---------------------------------------------------------------------------------


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("VITLAB_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "vitlab.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def _image(path: Path, size: int = 48) -> Path:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(path)
    return path


def _command_line(
    args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """`vitlab ARGS` as the console script runs it (user errors: one line, exit code 1), in this process."""
    monkeypatch.setattr(sys, "argv", ["vitlab", *args])
    monkeypatch.delenv("VITLAB_DEBUG", raising=False)
    capsys.readouterr()
    rc = main()
    return rc, capsys.readouterr().err


def test_predict_prints_the_repos_class_names(hub: Path, tmp_path: Path) -> None:
    """A fresh process: the cache and offline mode come from the environment alone."""
    repo, _ = hf_repo(hub, tmp_path)
    image = _image(tmp_path / "cat.png")
    done = _cli(["predict", "--ckpt", f"hf-hub:{repo}", str(image)], tmp_path)
    assert done.returncode == 0, done.stderr
    printed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert sorted(printed) == sorted(NAMES)


def test_offline_miss_is_one_line_naming_the_repo_the_cache_and_the_fix(
    hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    image = _image(tmp_path / "cat.png")
    rc, err = _command_line(["predict", "--ckpt", "hf-hub:acme/not-downloaded", str(image)], monkeypatch, capsys)
    assert rc == 1 and "Traceback" not in err
    line = err.splitlines()[0]
    assert line.startswith("vitlab: error: hf-hub:acme/not-downloaded is not in the Hugging Face cache")
    assert str(hub) in line and "hf download acme/not-downloaded" in line and "HF_HUB_OFFLINE=1" in line
    assert not any(hub.iterdir())  # nothing written


def test_a_repo_that_is_not_a_vit_is_named(
    hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "resnet"
    folder.mkdir()
    net = timm.create_model("resnet18", num_classes=3)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": "resnet18", "num_classes": 3}))
    put_repo(hub, "acme/resnet", folder)
    with pytest.raises(CheckpointError, match=r"hf-hub:acme/resnet@0123456789ab \(model.safetensors\).*not a ViT"):
        load_pretrained("hf-hub:acme/resnet")
    out = tmp_path / "out"
    rc, err = _command_line(["export", "--ckpt", "hf-hub:acme/resnet", "--format", "vitlab", "--out", str(out)],
                            monkeypatch, capsys)  # fmt: skip
    assert rc == 1 and "Traceback" not in err and not out.exists()
    assert "hf-hub:acme/resnet" in err.splitlines()[0] and "not a ViT checkpoint" in err.splitlines()[0]
    # A repo without weights (huggingface_hub records the files the Hub said are missing in .no_exist/):
    # said so, not taken for an offline miss.
    (folder / "model.safetensors").unlink()
    put_repo(hub, "acme/config-only", folder)
    for name in ("model.safetensors", "pytorch_model.bin", "preprocessor_config.json"):
        marker = hub / "models--acme--config-only" / ".no_exist" / COMMIT / name
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    with pytest.raises(SourceError, match="holds no model.safetensors or pytorch_model.bin"):
        resolve_source("hf-hub:acme/config-only")


# ---- a fake Hub: missing, gated, unauthorised ----------------------------------------------------------


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers as the Hub does for a missing repo (404 RepoNotFound), a gated one (403 GatedRepo) and a
    rejected token (401)."""

    def do_HEAD(self) -> None:
        self._answer()

    def do_GET(self) -> None:
        self._answer()

    def _answer(self) -> None:
        code, error = (403, "GatedRepo") if "/gated/" in self.path else (401, None) if "/private/" in self.path else (
            404, "RepoNotFound")  # fmt: skip
        self.send_response(code)
        if error:
            self.send_header("X-Error-Code", error)
            self.send_header("X-Error-Message", "Access to this repo is restricted" if code == 403 else "not found")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[Callable[[type], str]]:
    servers: list[http.server.HTTPServer] = []

    def start(handler: type) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_missing_gated_and_unauthorised_repos_say_which_and_never_echo_the_token(
    hub: Path, tmp_path: Path, serve: Callable[[type], str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from huggingface_hub import constants

    endpoint = serve(_FakeHub)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    token = "hf_secretsecretsecret123"
    monkeypatch.setenv("HF_TOKEN", token)
    image = _image(tmp_path / "x.png")
    cases = {"acme/nowhere": "no such repository", "gated/model": "is gated", "private/model": "refused access (401)"}
    for repo, says in cases.items():
        rc, err = _command_line(["predict", "--ckpt", f"hf-hub:{repo}", str(image)], monkeypatch, capsys)
        assert rc == 1 and "Traceback" not in err and token not in err, err
        line = err.splitlines()[0]
        assert f"hf-hub:{repo}" in line and says in line and "HF_TOKEN" in line, line
    assert not [p for p in hub.rglob("*") if p.is_file() and ".locks" not in p.parts]


# ---- URLs ----------------------------------------------------------------------------------------------


def _file_server(files: dict[str, bytes], cut: set[str], seen: list[str | None] | None = None) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if seen is not None:
                seen.append(self.headers.get("Authorization"))
            name = self.path.lstrip("/").split("?")[0]
            if name not in files:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = files[name]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2] if name in cut else body)  # a connection cut mid-body

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def test_url_downloads_once_reads_offline_after_and_recovers_from_a_cut_download(
    hub: Path, tmp_path: Path, serve: Callable[[type], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    peer = perturb(timm.create_model("vit_tiny_patch16_224", **TINY_ARGS))
    weights = tmp_path / "w.pth"
    torch.save(peer.state_dict(), weights)
    body = weights.read_bytes()
    digest = hashlib.sha256(body).hexdigest()
    files = {"vit.pth": body, f"vit-{digest[:8]}.pth": body, "bad-deadbeef.pth": body}
    cut: set[str] = {"vit.pth"}
    base = serve(_file_server(files, cut))
    cache = tmp_path / "torch" / "hub" / "checkpoints"

    # Cut short: nothing kept, one line saying so.
    with pytest.raises(SourceError, match=r"stopped after \d+ of \d+ bytes"):
        resolve_source(f"{base}/vit.pth")
    assert not [p for p in cache.rglob("*") if p.is_file()]
    # The next run downloads the whole file.
    cut.clear()
    model = load_pretrained(f"{base}/vit.pth", config={"num_heads": 2})  # a bare state dict does not say
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), peer(x), atol=1e-4, rtol=0)
    resolved = resolve_source(f"{base}/vit.pth")
    assert resolved.pinned == f"{base}/vit.pth#sha256={digest}"
    # A hash in the name (torch hub's convention) or in the URL is checked; a mismatch keeps nothing.
    assert resolve_source(f"{base}/vit-{digest[:8]}.pth").revision == digest
    with pytest.raises(SourceError, match="hashes to sha256"):
        resolve_source(f"{base}/bad-deadbeef.pth")
    with pytest.raises(SourceError, match="hashes to sha256"):
        resolve_source(f"{base}/vit.pth#sha256={'0' * 64}")  # the cached file, checked against the caller's
    assert sorted(p.name for p in cache.rglob("*.pth")) == sorted(["vit.pth", f"vit-{digest[:8]}.pth"])
    assert not list(cache.rglob("*.part"))

    # Server gone, downloads off: read from the cache.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    files.clear()
    again = load_pretrained(f"{base}/vit.pth#sha256={digest}", config={"num_heads": 2})
    assert torch.equal(again.pos_embed, model.pos_embed)
    with pytest.raises(SourceError, match="not in the download cache"):
        resolve_source(f"{base}/other.npz")


def test_url_credentials_stay_out_of_messages(hub: Path, tmp_path: Path, serve: Callable[[type], str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    seen: list[str | None] = []
    base = serve(_file_server({}, set(), seen))
    with pytest.raises(SourceError) as err:
        resolve_source(base.replace("http://", "http://user:pa55word@") + "/missing.safetensors?token=abc123")
    assert "404" in str(err.value) and "pa55word" not in str(err.value) and "abc123" not in str(err.value)
    assert seen == ["Basic dXNlcjpwYTU1d29yZA=="]  # base64("user:pa55word"): sent to the server, not shown


# ---- fine-tuning from a hub name -----------------------------------------------------------------------


def _image_folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("val", 2)):
        for c in ("ants", "bees"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")
    return root


def test_fit_from_a_hub_name_swaps_the_head_resamples_and_records_the_revision(hub: Path, tmp_path: Path) -> None:
    peer = timm_repo(hub, tmp_path, std=0.1)
    data, run = _image_folder(tmp_path / "images"), tmp_path / "run"
    recipe = REPO / "recipes" / "finetune" / "hub_vit_small_cpu.yaml"
    main(["fit", "--config", str(recipe), "--model.init_from=hf-hub:acme/vit-tiny-timm", "--data_path", str(data),
          '--model.model_args={"embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8}', "--model.lr=0.001",
          "--data.img_size=48", "--data.batch_size=4", "--data.num_workers=0", "--trainer.max_steps=2",
          "--trainer.val_check_interval=2", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
          "--run_dir", str(run), "--loggers=[csv]"])  # fmt: skip
    pinned = f"hf-hub:acme/vit-tiny-timm@{COMMIT}"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["hyper_parameters"]["init_from"] == pinned and ckpt["global_step"] == 2
    hparams = yaml.safe_load(next(run.rglob("hparams.yaml")).read_text())
    assert hparams["finetune/init_from"] == pinned
    assert hparams["finetune/pos_embed_grid"] == "4x4 -> 6x6" and hparams["finetune/num_classes"] == "3 -> 2"
    sd = ckpt["state_dict"]
    assert sd["model.pos_embed"].shape == (1, 1 + 36, 32) and sd["model.head.weight"].shape == (2, 32)
    # Two steps at lr 1e-3 with clipping move a weight by < 0.01; the source's differ from a fresh init by ~0.1.
    src = peer.state_dict()
    for k in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight", "patch_embed.proj.weight"):
        assert (sd[f"model.{k}"] - src[k]).abs().max() < 0.01, k
    assert ckpt["vitlab"]["data_config"]["class_names"] == ["ants", "bees"]


def test_distillation_teacher_by_hub_name_is_read_from_the_cache_and_pinned(hub: Path, tmp_path: Path) -> None:
    from vitlab.train.objectives.distill import DistillClassifier

    peer = timm_repo(hub, tmp_path)
    student_args = {"embed_dim": 32, "depth": 1, "num_heads": 2, "patch_size": 8, "distilled": True}
    module = DistillClassifier(arch="vit_tiny_patch16", model_args=student_args, num_classes=3, img_size=32,
                               teacher="hf-hub:acme/vit-tiny-timm")  # fmt: skip
    module.setup("fit")
    assert module.hparams["teacher"] == f"hf-hub:acme/vit-tiny-timm@{COMMIT}"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (module.teacher(x) - peer(x)).abs().max() <= 1e-4
