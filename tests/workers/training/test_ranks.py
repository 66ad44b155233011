"""The pieces of a train job in several processes that need no process group: each rank's
slice of a global batch is DistributedSampler's deal (NOTE [ Ranks' batches ] in
workers/training/ranks.py), the worker's ``--device`` names the GPUs it serves, and the ranks
find the machine's loopback interface."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from workers.processes.supervisor import gpu_indices, worker_commands
from workers.training.ranks import loopback_interface
from workers.training.training import RankSlice, batch_bounds


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rank_slices_are_distributed_samplers_batches(world_size: int) -> None:
    batch_size, batches = 6 * world_size, 5
    order = torch.randperm(batch_size * batches, generator=torch.Generator().manual_seed(7))
    for rank in range(world_size):
        sampler = DistributedSampler(
            order.tolist(), num_replicas=world_size, rank=rank, shuffle=False, drop_last=True
        )
        dealt = order[list(sampler)]  # the rank's samples of the epoch, in order
        per_rank = batch_size // world_size
        for k, (start, stop) in enumerate(batch_bounds(order.numel(), batch_size)):
            taken = RankSlice(rank, world_size).take(order[start:stop])
            assert torch.equal(taken, dealt[k * per_rank : (k + 1) * per_rank])


def test_ranks_share_a_global_batch_without_overlap() -> None:
    batch = torch.arange(10)
    slices = [RankSlice(r, 4).take(batch) for r in range(4)]
    assert [s.tolist() for s in slices] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # 8, 9 cut
    assert RankSlice().take(batch).tolist() == batch.tolist()


def test_a_short_last_batch_that_leaves_a_rank_one_sample_is_dropped() -> None:
    bounds = batch_bounds(43, 20)  # 20, 20, 3
    assert RankSlice(0, 2).keep(bounds) == bounds[:2]
    assert RankSlice(0, 1).keep(bounds) == bounds
    assert RankSlice(1, 2).keep(batch_bounds(44, 20)) == [(0, 20), (20, 40), (40, 44)]


def test_device_names_the_gpus_a_worker_serves() -> None:
    assert gpu_indices("cuda") is None and gpu_indices("cpu") is None
    assert gpu_indices("cuda:1") == ["1"]
    assert gpu_indices("cuda:0,cuda:2") == ["0", "2"]
    for bad in ("cuda:0,1", "cuda:0,cuda:0", "cuda:x", "cuda:0,cpu"):
        with pytest.raises(ValueError, match="--device"):
            gpu_indices(bad)
    (_, argv, env), _ = worker_commands("cuda:0,cuda:2")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert argv[argv.index("--device") + 1] == "cuda"
    (_, _, everything), _ = worker_commands("cuda")
    assert "CUDA_VISIBLE_DEVICES" not in everything


def test_the_loopback_interface_is_read_from_the_system() -> None:
    """The interface a job's ranks name to gloo and NCCL (NOTE [ Ranks meet on the loopback ]
    in workers/training/ranks.py): the machine's loopback, whatever its name."""
    name = loopback_interface()
    assert name in {n for _, n in socket.if_nameindex()}
    flags = Path("/sys/class/net") / name / "flags"
    if flags.exists():  # Linux: the kernel flags it IFF_LOOPBACK (0x8)
        assert int(flags.read_text(), 16) & 0x8
