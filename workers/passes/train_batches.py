"""An epoch's training micro-batches, read (and augmented) in order by the job's process or
by DataLoader worker processes (``loader_workers``), with the same result either way: a
batch's rows are fixed by the epoch's order and its augmentation by its own generator (NOTE [
Augmentation draws ] in workers/passes/augmentation.py). The loader processes share the
memory of the process that reads them (NOTE [ Loader processes' memory ] in
workers/passes/process_memory.py)."""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch
from torch.utils.data import DataLoader, Dataset

from api_schemas.jobs.train import Augmentation
from workers.passes.augmentation import augment, batch_generator
from workers.passes.data import Data, load_rows
from workers.passes.process_memory import loader_shares

__all__ = ["epoch_batches"]


class _EpochBatches(Dataset[torch.Tensor]):
    """Micro-batch ``i`` of the epoch: rows ``order[start:stop]`` of ``x``, augmented."""

    def __init__(
        self,
        x: Data,
        order: torch.Tensor,
        bounds: list[tuple[int, int]],
        first: int,
        augmentation: Augmentation | None,
        seed: int,
        epoch: int,
        take: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        self.x, self.order, self.bounds, self.first = x, order, bounds, first
        self.augmentation, self.seed, self.epoch, self.take = augmentation, seed, epoch, take

    def __len__(self) -> int:
        return len(self.bounds) - self.first

    def __getitem__(self, i: int) -> torch.Tensor:
        index = self.first + i
        start, stop = self.bounds[index]
        rows = self.order[start:stop]
        if self.take is not None:  # one rank's slice of the global batch
            rows = self.take(rows)
        batch = load_rows(self.x, rows)  # (B, ...) float32 on the CPU
        if self.augmentation is None:
            return batch
        return augment(batch, self.augmentation, batch_generator(self.seed, self.epoch, index))


def epoch_batches(
    x: Data,
    order: torch.Tensor,
    bounds: list[tuple[int, int]],
    *,
    first: int = 0,
    augmentation: Augmentation | None = None,
    seed: int = 0,
    epoch: int = 1,
    workers: int = 0,
    take: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Generator[torch.Tensor, None, None]:
    """The epoch's micro-batches from index ``first`` on, in order; with ``workers`` > 0 read
    ahead by that many DataLoader processes; ``take``: the rows of a batch's that this process
    trains on (one rank's slice)."""
    batches = _EpochBatches(x, order, bounds, first, augmentation, seed, epoch, take)
    if workers == 0 or len(batches) <= 1:
        yield from (batches[i] for i in range(len(batches)))
        return
    loaders = min(workers, len(batches))
    # NOTE [ Loader processes' memory ] in workers/passes/process_memory.py
    with loader_shares(loaders) as hold_loader:
        yield from DataLoader(
            batches,
            batch_size=None,
            num_workers=loaders,
            prefetch_factor=2,
            worker_init_fn=hold_loader,
        )
