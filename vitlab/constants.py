"""Normalisation statistics, one place for every module that names them (as timm's data/constants.py)."""

IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)  # torchvision's CNNs, DeiT
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)
IMAGENET_INCEPTION_MEAN = (0.5, 0.5, 0.5)  # Google's ViT checkpoints, and vitlab's default
IMAGENET_INCEPTION_STD = (0.5, 0.5, 0.5)
# As the interop data configs store them (lists, as JSON round-trips them).
INCEPTION_NORM = {"mean": list(IMAGENET_INCEPTION_MEAN), "std": list(IMAGENET_INCEPTION_STD)}
IMAGENET_NORM = {"mean": list(IMAGENET_DEFAULT_MEAN), "std": list(IMAGENET_DEFAULT_STD)}
