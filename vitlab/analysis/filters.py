"""Principal components of the patch-embedding filters (ViT paper Fig. 7 left).

The first layer of a ViT linearly projects flattened patches; the top principal components of its
filters look like plausible basis functions for the fine structure inside a patch.
"""

from __future__ import annotations

import torch


def patch_embedding_components(
    weight: torch.Tensor, k: int = 28, *, center: bool = True, rescale: bool = True
) -> torch.Tensor:
    """Top-`k` principal components of the filters `weight` `[D, C, p, p]`, as `[k, C, p, p]`.

    Each of the D filters is one sample of a `C*p*p`-dimensional vector; with `center` the mean
    filter is removed first (plain PCA). Components come in order of explained variance; `k` is
    capped at the number available, `min(D, C*p*p)`. The sign of a component is arbitrary; it is
    fixed so that its largest-magnitude entry is positive. With `rescale` each component is mapped
    to [0, 1] on its own (min to 0, max to 1) for display as an RGB patch; without, components are
    unit vectors.
    """
    if weight.ndim != 4:
        raise ValueError(f"expected conv filters [D, C, p, p], got a tensor of shape {tuple(weight.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    d, c, ph, pw = weight.shape
    x = weight.detach().double().reshape(d, -1)
    if center:
        x = x - x.mean(dim=0, keepdim=True)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    comps = vh[: min(k, vh.shape[0])]
    peak = comps.gather(1, comps.abs().argmax(dim=1, keepdim=True))
    comps = comps * torch.where(peak < 0, -1.0, 1.0)
    if rescale:
        lo, hi = comps.amin(dim=1, keepdim=True), comps.amax(dim=1, keepdim=True)
        comps = (comps - lo) / (hi - lo).clamp_min(1e-12)
    return comps.reshape(-1, c, ph, pw).to(weight.dtype if weight.is_floating_point() else torch.float32)
