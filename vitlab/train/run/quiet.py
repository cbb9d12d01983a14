"""The library warnings a vitlab run would print that a user cannot act on, silenced by their text."""

from __future__ import annotations

import warnings

# (message regex, why it is harmless)
KNOWN_HARMLESS = (
    # Lightning 2.6's own pytree helper (lightning/pytorch/utilities/_pytree.py) uses torch's deprecated LeafSpec.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "Lightning's code, not vitlab's"),
    # vitlab's shard datasets define __len__ knowing each worker reads its own shards (data/shard_stream.py).
    (r"Your `IterableDataset` has `__len__` defined", "each loader worker reads its own shards"),
    # torchdata's StatefulDataLoader calls torch.set_vital, deprecated in torch.
    (r"'set_vital' is deprecated", "torchdata's code, not vitlab's"),
)


def silence_known_warnings() -> None:
    """Ignore `KNOWN_HARMLESS` (and only those) from here on."""
    for pattern, _ in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=pattern)
