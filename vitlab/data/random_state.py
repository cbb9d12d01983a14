"""Random-stream state: capture and restore a process's torch / python / numpy streams, and
`WorkerRandomState`, which makes each DataLoader worker's streams part of the loader's saved state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info


class WorkerRandomState(Dataset):
    """A map-style `dataset` whose DataLoader workers' random streams travel with the loader's state.

    torchdata's StatefulDataLoader saves each worker's dataset state (`state_dict`) with every batch
    it yields and hands it back to the worker (`load_state_dict`) when a loader is restored. Here
    that state is the worker's random streams after the batch, so a mid-epoch resume continues the
    augmentation (random crops, flips, RandAugment) exactly where the interrupted run was; without it
    the restored workers would reseed and draw the epoch's first numbers again. In the main process
    (`num_workers=0`) it stores nothing: `ExactResume` restores the main streams.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        # The wrapped dataset's attributes (samples, targets, bad_image_count...); __dict__ is looked
        # up directly so unpickling in a worker (an empty instance) raises AttributeError, not recursion.
        if name == "dataset" or "dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": get_rng_state()} if get_worker_info() is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rng") and get_worker_info() is not None:
            set_rng_state(state["rng"])


def get_rng_state() -> dict[str, Any]:
    """This process's torch / python / numpy (and CUDA) random states, as tensors and plain values
    (loadable with `torch.load(weights_only=True)`)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {
        "kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
        "has_gauss": int(has_gauss), "gauss": float(gauss),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))  # a list in checkpoints of earlier vitlab versions
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])

