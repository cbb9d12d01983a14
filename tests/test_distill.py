"""DeiT's distillation token (arXiv 2012.12877): the distilled model (two prefix tokens, two heads, the
prediction as the mean of both heads' logits), the loss on hand-computed cases, the frozen
teacher and its own input transform, and parity with timm's distilled DeiT."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, TensorDataset

from helpers import image_tree
from vitlab import VisionTransformer, create_model, load_pretrained, save_pretrained
from vitlab.cli import main
from vitlab.train.objectives.distill import DistillClassifier, distillation_loss, to_teacher_input

import timm
import torchvision
from timm.models.vision_transformer import checkpoint_filter_fn  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune" / "imagenette_deit_distill_cpu.yaml"
TV_MEAN, TV_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # torchvision's ImageNet transform
STUDENT = dict(depth=1, embed_dim=32, num_heads=2, patch_size=8, distilled=True)


def tiny_distilled(**kw: object) -> VisionTransformer:
    return VisionTransformer(**{"img_size": 32, "num_classes": 4, **STUDENT, **kw})


def test_two_prefix_tokens_two_heads_and_the_mean_of_logits() -> None:
    m = tiny_distilled(depth=2).eval()
    with torch.no_grad():  # heads start at zero-ish; make them differ
        m.head.weight.normal_(std=0.5), m.head_dist.weight.normal_(std=0.5)
    assert m.num_prefix_tokens == 2 and m.pos_embed.shape == (1, 2 + 16, 32)
    assert m.dist_token.shape == (1, 1, 32) and m.head_dist.out_features == 4
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        tokens = m.forward_features(x)
        cls_logits, dist_logits = m.head(tokens[:, 0]), m.head_dist(tokens[:, 1])
        fast_cls, fast_dist = m.forward_distilled(x)  # the last block computes the two prefix tokens only
        pred = m(x)
    torch.testing.assert_close(fast_cls, cls_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_dist, dist_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pred, (cls_logits + dist_logits) / 2, atol=1e-6, rtol=1e-5)  # DeiT, timm, HF
    assert not torch.allclose(cls_logits.softmax(-1), dist_logits.softmax(-1))


def test_reset_head_and_resolution_change_keep_both_prefix_tokens() -> None:
    m = tiny_distilled()
    before = m.pos_embed[:, :2].detach().clone()
    m.set_image_size(48)
    assert m.pos_embed.shape == (1, 2 + 36, 32)
    torch.testing.assert_close(m.pos_embed[:, :2].detach(), before)
    m.reset_head(7)
    assert m.head.out_features == 7 and m.head_dist.out_features == 7
    assert torch.count_nonzero(m.head_dist.weight) == 0
    assert m(torch.randn(1, 3, 48, 48)).shape == (1, 7)


def test_distilled_needs_class_token_pooling() -> None:
    with pytest.raises(ValueError, match="needs pool='token'"):
        tiny_distilled(pool="avg", class_token=False)
    with pytest.raises(ValueError, match="needs a distilled model"):
        tiny_distilled(distilled=False).forward_heads(torch.zeros(1, 17, 32))


# ---- the loss --------------------------------------------------------------------------------------


def test_hard_distillation_loss_hand_case() -> None:
    cls_logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax (1/4, 3/4)
    dist_logits = torch.tensor([[0.0, math.log(3.0)]])
    label = torch.tensor([0])
    teacher = torch.tensor([[1.0, 5.0]])  # the teacher's hard label is 1, not the true label 0
    total, cls_loss, dist_loss = distillation_loss(cls_logits, dist_logits, label, teacher, "hard")
    assert cls_loss.item() == pytest.approx(math.log(4.0))  # -log(1/4)
    assert dist_loss.item() == pytest.approx(math.log(4.0 / 3.0))  # -log(3/4)
    assert total.item() == pytest.approx(0.5 * math.log(4.0) + 0.5 * math.log(4.0 / 3.0))
    # MixUp/CutMix probabilities as targets: the class head reads them, the distillation head does not.
    soft, _, soft_dist = distillation_loss(cls_logits, dist_logits, torch.tensor([[0.5, 0.5]]), teacher, "hard")
    assert soft_dist.item() == pytest.approx(math.log(4.0 / 3.0))
    cls_soft = 0.5 * math.log(4.0) + 0.5 * math.log(4.0 / 3.0)  # half -log(1/4), half -log(3/4)
    assert soft.item() == pytest.approx(0.5 * cls_soft + 0.5 * math.log(4.0 / 3.0))


def test_soft_distillation_loss_hand_case() -> None:
    tau = 2.0
    cls_logits = torch.tensor([[0.0, 0.0]])  # CE = log 2 for any label
    dist_logits = torch.tensor([[0.0, 0.0]])  # student at tau: (1/2, 1/2)
    teacher = torch.tensor([[0.0, 2 * math.log(3.0)]])  # teacher at tau: (1/4, 3/4)
    total, _, dist_loss = distillation_loss(
        cls_logits, dist_logits, torch.tensor([1]), teacher, "soft", alpha=0.25, tau=tau
    )
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert dist_loss.item() == pytest.approx(tau * tau * kl)
    assert total.item() == pytest.approx(0.75 * math.log(2.0) + 0.25 * tau * tau * kl)


def test_soft_distillation_kl_reductions_hand_case() -> None:
    """batchmean: the summed KL over the batch size; deit (DeiT's code): over batch x classes."""
    tau = 2.0
    logits = torch.zeros(2, 2)  # the student at tau: (1/2, 1/2) for both samples
    teacher = torch.tensor([[0.0, 2 * math.log(3.0)], [0.0, 0.0]])  # at tau: (1/4, 3/4), then (1/2, 1/2): KL 0
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # the first sample's; the second adds 0
    label = torch.tensor([0, 1])
    _, _, batchmean = distillation_loss(logits, logits, label, teacher, "soft", tau=tau)
    _, _, deit = distillation_loss(logits, logits, label, teacher, "soft", tau=tau, kl_reduction="deit")
    assert batchmean.item() == pytest.approx(tau * tau * kl / 2)
    assert deit.item() == pytest.approx(tau * tau * kl / 4)
    with pytest.raises(ValueError, match="distill_kl_reduction"):
        distillation_loss(logits, logits, label, teacher, "soft", kl_reduction="mean")  # type: ignore[arg-type]


def test_teacher_input_transform_hand_case() -> None:
    x = torch.zeros(1, 3, 4, 4)  # student-normalised with mean 0.5, std 0.5: every pixel is 0.5
    out = to_teacher_input(x, [0.5] * 3, [0.5] * 3, [0.25, 0.5, 0.75], [0.5, 0.25, 0.125], teacher_size=(8, 8))
    assert out.shape == (1, 3, 8, 8)
    expect = torch.tensor([(0.5 - 0.25) / 0.5, 0.0, (0.5 - 0.75) / 0.125]).view(1, 3, 1, 1).expand(1, 3, 8, 8)
    torch.testing.assert_close(out, expect)


# ---- the teacher -----------------------------------------------------------------------------------


def _cnn_teacher(tmp_path: Path, num_classes: int = 4) -> Path:
    net = torchvision.models.get_model("resnet18", weights=None, num_classes=num_classes)
    path = tmp_path / "teacher.pth"
    torch.save({"state_dict": net.state_dict()}, path)  # a training-checkpoint wrapper
    return path


def _student(teacher: Path, **kw: object) -> DistillClassifier:
    args = dict(arch="vit_tiny_patch16", model_args=STUDENT, num_classes=4, img_size=32, teacher=str(teacher),
                teacher_arch="resnet18", lr=1e-3, warmup_steps=0)  # fmt: skip
    return DistillClassifier(**{**args, **kw})


def test_teacher_is_frozen_in_eval_mode_and_stays_out_of_the_checkpoint(tmp_path: Path) -> None:
    module = _student(_cnn_teacher(tmp_path))
    module.setup("fit")
    teacher_before = {k: v.clone() for k, v in module.teacher.state_dict().items()}
    student_before = {k: v.clone() for k, v in module.model.state_dict().items()}
    data = TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,)))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=4))
    assert not module.teacher.training
    assert all(not p.requires_grad and p.grad is None for p in module.teacher.parameters())
    for k, v in module.teacher.state_dict().items():  # BatchNorm statistics too: eval mode all along
        assert torch.equal(v, teacher_before[k]), k
    assert any(not torch.equal(v, student_before[k]) for k, v in module.model.state_dict().items())
    assert not any(k.startswith("teacher") or "_teacher" in k for k in module.state_dict())
    teacher_params = {id(p) for p in module.teacher.parameters()}
    assert not teacher_params & {id(p) for p in module.parameters()}
    logged = trainer.callback_metrics
    assert {"train/loss", "train/loss_cls", "train/loss_distill"} <= set(logged)


def test_training_step_loss_is_the_stated_mix(tmp_path: Path) -> None:
    module = _student(_cnn_teacher(tmp_path), distill_alpha=0.5)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    module.train()
    loss = module.training_step((x, y), 0)
    with torch.no_grad():
        cls_logits, dist_logits = module.model.forward_distilled(x)
        teacher_x = (x * 0.5 + 0.5 - torch.tensor(TV_MEAN).view(1, 3, 1, 1)) / torch.tensor(TV_STD).view(1, 3, 1, 1)
        teacher_label = module.teacher(teacher_x).argmax(-1)
    expect = 0.5 * F.cross_entropy(cls_logits, y) + 0.5 * F.cross_entropy(dist_logits, teacher_label)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5)
    # The training accuracy reads what the model predicts: the mean of the two heads' logits.
    _, logged, _ = module.compute_loss(x, y)
    torch.testing.assert_close(logged, (cls_logits + dist_logits) / 2, atol=1e-6, rtol=1e-5)


def test_vit_teacher_through_load_pretrained_with_its_own_input_size(tmp_path: Path) -> None:
    vit = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=4).eval()
    vit.data_config.update(mean=[0.2, 0.3, 0.4], std=[0.3, 0.3, 0.3])
    save_pretrained(vit, tmp_path / "vit_teacher")
    module = _student(tmp_path / "vit_teacher", teacher_arch=None)
    module.setup("fit")
    assert module.teacher_transform == {"mean": [0.2, 0.3, 0.4], "std": [0.3, 0.3, 0.3], "img_size": [16, 16]}
    x = torch.randn(2, 3, 32, 32)
    pixels = F.interpolate(x * 0.5 + 0.5, size=(16, 16), mode="bicubic", antialias=True, align_corners=False)
    expect = vit((pixels - torch.tensor([0.2, 0.3, 0.4]).view(1, 3, 1, 1)) / 0.3)
    torch.testing.assert_close(module.teacher_logits(x), expect.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("source", ["vitlab", "timm"])
def test_init_from_a_plain_vit_gives_the_student_a_copied_distillation_token(tmp_path: Path, source: str) -> None:
    """A plain pretrained ViT -> distilled student: encoder kept, dist_token and its position copied
    from the class token's, head_dist from head, so both heads agree before training."""
    plain = VisionTransformer(img_size=32, num_classes=4, **{**STUDENT, "distilled": False}).eval()
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.1)  # zero-initialised heads would make the copies trivially equal
    if source == "vitlab":
        save_pretrained(plain, tmp_path / "plain")
        path = tmp_path / "plain"
    else:
        peer = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                                 num_heads=2, num_classes=4)  # fmt: skip
        peer.load_state_dict(plain.state_dict())
        path = tmp_path / "timm.pth"
        torch.save(peer.state_dict(), path)
    teacher = _cnn_teacher(tmp_path)
    student = _student(teacher, init_from=str(path)).model.eval()
    want = plain.state_dict()
    got = student.state_dict()
    assert torch.equal(got["dist_token"], want["cls_token"])
    assert torch.equal(got["pos_embed"][:, 0], want["pos_embed"][:, 0])
    assert torch.equal(got["pos_embed"][:, 1], want["pos_embed"][:, 0])
    assert torch.equal(got["pos_embed"][:, 2:], want["pos_embed"][:, 1:])
    assert torch.equal(got["head_dist.weight"], want["head.weight"])
    for k, v in want.items():
        if k != "pos_embed":
            assert torch.equal(got[k], v), k
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        cls_logits, dist_logits = student.forward_distilled(x)
    torch.testing.assert_close(cls_logits, dist_logits, atol=1e-6, rtol=0)  # the two tokens are one until trained
    if source == "vitlab":
        module = _student(teacher, init_from=str(path))
        assert module.init_summary["tensors_new"].startswith("dist_token, head_dist.weight, head_dist.bias")
    # At another resolution both prefix rows stay as they are; the grid is resampled.
    bigger = _student(teacher, init_from=str(path), img_size=48).model
    assert bigger.pos_embed.shape == (1, 2 + 36, 32)
    assert torch.equal(bigger.pos_embed[:, :2], want["pos_embed"][:, :1].expand(1, 2, 32))


def test_bad_teachers_and_students_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a distilled student"):
        _student(_cnn_teacher(tmp_path), model_args={**STUDENT, "distilled": False})
    # The teacher is read when fitting starts (setup("fit")), not to validate or export a student.
    with pytest.raises(ValueError, match="does not fit torchvision's resnet18 with 4 classes"):
        _student(_cnn_teacher(tmp_path, num_classes=10)).setup("fit")
    with pytest.raises(ValueError, match="not a torchvision model"):
        _student(_cnn_teacher(tmp_path), teacher_arch="resnet_huge").setup("fit")
    student = _student(tmp_path / "nowhere.pth")
    student.setup("validate")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        student.setup("fit")
    torch.save({"step": 3}, tmp_path / "no_weights.pth")
    with pytest.raises(ValueError, match="holds no state dict"):
        _student(tmp_path / "no_weights.pth").setup("fit")


def test_a_lightning_checkpoint_of_a_compiled_teacher_loads_its_weights(tmp_path: Path) -> None:
    net = torchvision.models.get_model("resnet18", weights=None, num_classes=4)
    want = net.state_dict()
    path = tmp_path / "teacher.ckpt"  # nested under state_dict, names prefixed by the module and compile
    torch.save({"epoch": 3, "state_dict": {f"model._orig_mod.{k}": v for k, v in want.items()}}, path)
    student = _student(path)
    student.setup("fit")
    got = student.teacher.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())


# ---- timm parity -----------------------------------------------------------------------------------


def test_distilled_deit_matches_timm_and_resizes_with_both_prefix_tokens() -> None:
    peer = timm.create_model("deit_tiny_distilled_patch16_224", num_classes=5, depth=2)
    with torch.no_grad():
        for p in peer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    peer.eval()
    model = create_model("deit_tiny_distilled_patch16", num_classes=5, img_size=224, depth=2).eval()
    model.load_state_dict(peer.state_dict(), strict=True)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        feats = peer.forward_features(x)
        ref_cls, ref_dist = peer.head(feats[:, 0]), peer.head_dist(feats[:, 1])
        ours_cls, ours_dist = model.forward_distilled(x)
        pred = model(x)
    assert (ours_cls - ref_cls).abs().max() <= 1e-4 and (ours_dist - ref_dist).abs().max() <= 1e-4
    assert (pred - (ref_cls + ref_dist) / 2).abs().max() <= 1e-4

    big = timm.create_model("deit_tiny_distilled_patch16_224", num_classes=5, depth=2, img_size=384).eval()
    big.load_state_dict(checkpoint_filter_fn(peer.state_dict(), big))  # keeps both prefix tokens
    model.set_image_size(384)
    torch.testing.assert_close(model.pos_embed, big.pos_embed, atol=1e-6, rtol=0)
    x = torch.randn(1, 3, 384, 384)
    with torch.no_grad():
        feats = big.forward_features(x)
        ours_cls, ours_dist = model.forward_distilled(x)
    assert (ours_cls - big.head(feats[:, 0])).abs().max() <= 1e-4
    assert (ours_dist - big.head_dist(feats[:, 1])).abs().max() <= 1e-4


def test_timm_distilled_deit_loaded_predicts_timms_logits(tmp_path: Path) -> None:
    """timm's deit_tiny_distilled_patch16_224 (random init) read through load_pretrained: timm's own
    eval-mode logits (the mean of the two heads'), which the predictions of `vitlab predict` read."""
    peer = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False)
    with torch.no_grad():  # timm zero-initialises the heads: make them differ, so the mean is tested
        for p in peer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    peer.eval()
    torch.save(peer.state_dict(), tmp_path / "deit.pth")
    model = load_pretrained(tmp_path / "deit.pth")
    assert model.distilled and model.num_classes == 1000
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (model(x) - peer(x)).abs().max() <= 1e-4


# ---- the recipe, through the CLI -------------------------------------------------------------------


@pytest.mark.slow
def test_distill_recipe_trains_through_the_cli(tmp_path: Path) -> None:
    data = image_tree(tmp_path / "data", ["cat", "dog"], 8, 4)
    teacher = tmp_path / "teacher.pth"
    torch.save(torchvision.models.get_model("resnet18", weights=None, num_classes=2).state_dict(), teacher)
    run = tmp_path / "run"
    main(["fit", "--config", str(RECIPE), "--data_path", str(data), "--run_dir", str(run), "--loggers=[csv]",
          f"--model.init_args.teacher={teacher}", "--model.init_args.model_args.depth=1", "--data.img_size=32",
          "--trainer.max_epochs=1", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
          "--data.batch_size=8"])  # fmt: skip
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["model"]["class_path"] == "vitlab.train.DistillClassifier"
    with open(run / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("train/loss_distill") for r in rows) and any(r.get("val/acc1") for r in rows)
    student = load_pretrained(run / "checkpoints" / "last.ckpt")  # the student alone, no teacher needed
    assert student.distilled and student.num_prefix_tokens == 2 and student.num_classes == 2
    assert student.data_config["class_names"] == ["cat", "dog"]
