"""``ElasticSampler``: a sampler that repartitions the epoch's unprocessed samples after every reset."""

from __future__ import annotations

import math
import random
from typing import Any, Iterator

import torch.utils.data

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Partition a dataset across ranks, skipping what the epoch has processed, as Horovod's does.

    Args:
        dataset: the dataset (of constant length).
        shuffle: shuffle the indices each epoch (deterministically: ``seed + epoch``).
        seed: the shuffle's seed, the same on every rank.

    Track it in a ``TorchState``, call ``record_batch`` after each batch and ``set_epoch``
    at the end of each epoch; after a reset, the samples of the epoch not yet processed
    (counted across all ranks) are split over the new number of ranks.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        try:
            len(dataset)
        except TypeError:
            raise TypeError(f"ElasticSampler needs a dataset with a length, got {type(dataset).__name__}; "
                            "use a map-style Dataset (with __len__)") from None
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (call at the END of an epoch): clears the processed count and reshuffles."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that every rank processed one more batch of ``batch_size`` samples."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the epoch and the processed count from ``state_dict`` and repartition."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> dict[str, Any]:
        """Return the epoch and the processed count (what a commit keeps)."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def reset(self) -> None:
        """Repartition the epoch's unprocessed samples over the current ranks."""
        from ..basics import rank, size

        self.num_replicas = size()
        self.rank = rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]  # pad to a multiple of the ranks
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
