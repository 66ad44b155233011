"""Training checkpoints of two gloo ranks, in this machine's processes, without the service
(NOTE [ Ranks in a checkpoint ] in workers/training/train_state.py): checkpoints by time are
taken at the steps rank 0's clock picks, on every rank, even when another rank's own clock
would pick none; the checkpoint holds each rank's own RNG and loss sum; two ranks resumed from
a mid-training checkpoint, and from the final checkpoint of a shorter run (``resume_from``),
end bitwise where the uninterrupted run ends; another world size is refused."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel

from tests.workers.training.test_training import SETTINGS, digits_cnn
from workers.errors import TrainError
from workers.passes.data import to_tensors
from workers.training.train_state import TrainState, load_state, state_bytes
from workers.training.training import (
    Checkpointing,
    RankSlice,
    TrainHooks,
    TrainSettings,
    train_model,
)

pytestmark = pytest.mark.slow  # two processes that import torch, three runs each

WORLD_SIZE = 2
# 240 training samples in global batches of 32 (16 a rank): 8 steps an epoch, the last of 16.
RANK_SETTINGS = SETTINGS | {"epochs": 3}
MID_STEP = 11  # in epoch 2, mid-epoch: its order, loss sums and position are resumed


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    x, y = to_tensors((data.images[:300, None] / 16).astype(np.float32), data.target[:300])
    assert y is not None
    return x, y


def _train(
    rank: int, checkpointing: Checkpointing | None, epochs: int
) -> tuple[dict[str, torch.Tensor], list[dict[str, object]]]:
    x, y = _digits()
    model = digits_cnn()
    ddp = DistributedDataParallel(model)
    stats = train_model(
        model,
        x,
        y,
        TrainSettings(**(RANK_SETTINGS | {"epochs": epochs})),
        checkpointing=checkpointing,
        hooks=TrainHooks(forward=ddp),
        ranks=RankSlice(rank, WORLD_SIZE),
    )
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    return state, [asdict(e) for e in stats.epochs]


def _rank_main(rank: int, workdir: str) -> None:
    """One rank: an uninterrupted run saving by time, a run resumed from its mid-training
    checkpoint, a 2-epoch run and its continuation to 3 from its final checkpoint; rank 0
    writes what the test compares."""
    out = Path(workdir)
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=WORLD_SIZE
    )
    torch.set_num_threads(1)
    try:
        saved: list[TrainState] = []

        def save(state: TrainState) -> None:
            # The tensors are the live ones: written now, as StoredCheckpoints does.
            if rank == 0 and state.step == MID_STEP:
                (out / f"step-{state.step}.safetensors").write_bytes(state_bytes(state))
            saved.append(state)

        # Rank 0's clock asks for a checkpoint after every step, rank 1's never would.
        by_time = Checkpointing(save, every_s=1e-9 if rank == 0 else 1e9)
        whole, whole_epochs = _train(rank, by_time, epochs=3)
        (out / f"saved-{rank}.json").write_text(json.dumps([s.step for s in saved]))
        dist.barrier()

        def keep_none(state: TrainState) -> None:
            return None

        mid = load_state(out / f"step-{MID_STEP}.safetensors")
        resumed, resumed_epochs = _train(rank, Checkpointing(keep_none, resume=mid), epochs=3)

        def save_final(state: TrainState) -> None:
            if rank == 0 and state.epoch == 3:  # a 2-epoch job's final checkpoint
                (out / "ended.safetensors").write_bytes(state_bytes(state))

        _train(rank, Checkpointing(save_final), epochs=2)
        dist.barrier()
        ended = load_state(out / "ended.safetensors")
        continued, continued_epochs = _train(rank, Checkpointing(keep_none, resume=ended), 3)
        if rank == 0:
            for name, state in (("whole", whole), ("resumed", resumed), ("continued", continued)):
                safetensors.torch.save_file(state, str(out / f"{name}.safetensors"))
            epochs = {"whole": whole_epochs, "resumed": resumed_epochs}
            (out / "epochs.json").write_text(json.dumps(epochs | {"continued": continued_epochs}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_checkpoint_together_and_resume_bitwise(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(str(tmp_path),), nprocs=WORLD_SIZE)
    # Every rank took part in each checkpoint rank 0's clock asked for: every step, and the end.
    steps = [json.loads((tmp_path / f"saved-{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert steps[0] == steps[1] == [*range(1, 25), 24]

    mid = load_state(tmp_path / f"step-{MID_STEP}.safetensors")
    assert mid.world_size == WORLD_SIZE and len(mid.other_ranks) == WORLD_SIZE - 1
    assert (mid.epoch, mid.batch) == (2, 3)
    # Each rank's loss sum is its own slices': the ranks' differ.
    assert not torch.equal(mid.other_ranks[0].epoch_loss_sum, mid.epoch_loss_sum)
    assert mid.for_rank(1, WORLD_SIZE).epoch_loss_sum is mid.other_ranks[0].epoch_loss_sum

    whole = safetensors.torch.load_file(str(tmp_path / "whole.safetensors"))
    epochs = json.loads((tmp_path / "epochs.json").read_text())
    for name in ("resumed", "continued"):
        state = safetensors.torch.load_file(str(tmp_path / f"{name}.safetensors"))
        assert set(state) == set(whole)
        for key in whole:
            assert torch.equal(state[key], whole[key]), (name, key)
        assert epochs[name] == epochs["whole"], name

    # One process cannot take the checkpoint of two.
    x, y = _digits()
    with pytest.raises(TrainError, match=r"written by a job in 2 process.*processes: 2"):
        train_model(
            digits_cnn(),
            x,
            y,
            TrainSettings(**RANK_SETTINGS),
            checkpointing=Checkpointing(lambda state: None, resume=mid),
        )
