"""A training checkpoint: everything a train job needs to go on exactly where it was, as one
safetensors file, without pickle.

NOTE [ Training checkpoints ]
A checkpoint is written after an optimizer step (every ``save_every_steps`` steps or
``save_every_s`` seconds) and once at the end of training. It holds:

- tensors: the model's ``state_dict`` (``model.<key>``, the unwrapped model's keys), the
  optimizer's per-parameter state (``optimizer.<index>.<name>``), the best epoch's weights
  with ``keep_best`` (``best.<key>``), the epoch's running loss sum (float64, so the epoch's
  train_loss comes out bitwise the same) and the RNG states as uint8 tensors: torch's CPU
  generator, the CUDA generator of the job's device where it trains on CUDA, and the
  data-order generator as it was at the start of the epoch in progress (the epoch's order is
  drawn again from it on resume);
- the safetensors metadata, one JSON document under ``bnadapt.train_state``: the format
  version, the position (``epoch`` in progress from 1, ``batch``: its micro-batches done,
  ``step``: optimizer steps done, ``batches`` and ``samples`` done in all), the epoch logs so
  far, the optimizer's param groups and non-tensor state, the gradient scaler's state (fp16),
  the best epoch and its loss, and ``world_size``: the processes of the job that wrote it
  (1 when absent, as in checkpoints of earlier releases).

NOTE [ Ranks in a checkpoint ]
A job in several processes (workers/training/ranks.py) writes one checkpoint, rank 0's, at a
step all ranks agree on: ``save_every_steps`` counts the same steps on every rank, and the
``save_every_s`` clock is rank 0's, its decision broadcast to the others after each step
(``RankSlice.agree``). The model, the optimizer, the data-order generator and the position are
the same on every rank (DDP keeps the parameters equal, and the order is drawn from the seed);
what differs is each rank's global RNG (CPU and CUDA) and its running loss sum of the epoch,
its own slices' (NOTE [ Ranks' batches ]). Those are gathered to every rank
(``RankSlice.gather``, fixed-size tensors, no pickle) and rank 0 writes them beside its own:
``rank.<r>.rng.cpu``, ``rank.<r>.rng.cuda``, ``rank.<r>.epoch_loss_sum`` for ranks 1 to N - 1
(rank 0's are the plain names, so a one-process checkpoint is one of world size 1). One file,
one store object, one record: a retried attempt never finds the ranks' parts from different
steps. A checkpoint resumes only with the world size that wrote it (:meth:`TrainState.for_rank`
says what to change): the ranks' slices, the batches a short last one drops and the loss sums
are those of that world size.

Nothing is unpickled on reading: safetensors holds raw tensors and a JSON header. The store
writes an object atomically (NOTE [ Atomic commit ] in service/store/base.py) and names it by
its digest, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import safetensors
import safetensors.torch
import torch

from workers.errors import TrainError

__all__ = [
    "FORMAT_VERSION",
    "EpochLog",
    "RankState",
    "TrainState",
    "load_state",
    "state_bytes",
    "state_position",
]

FORMAT_VERSION: Final = 1
_METADATA_KEY: Final = "bnadapt.train_state"


@dataclass(frozen=True)
class EpochLog:
    epoch: int  # from 1
    train_loss: float  # mean over the epoch's samples, as measured during the epoch
    val_loss: float | None  # None without a validation split
    val_accuracy: float | None  # None without a validation split or for mse
    lr: float | None = None  # the learning rate of the epoch's last step (None: earlier files)
    best: bool = False  # the lowest validation loss so far (False without validation)


@dataclass(frozen=True)
class RankState:
    """What one rank of a job in several processes keeps of its own (NOTE [ Ranks in a
    checkpoint ])."""

    cpu_rng: torch.Tensor  # uint8
    cuda_rng: torch.Tensor | None  # uint8, the rank's CUDA device
    epoch_loss_sum: torch.Tensor  # () float64


@dataclass
class TrainState:
    """Where a training run is, and all it needs to go on from there."""

    epoch: int  # the epoch in progress, from 1 (epochs + 1 once all are done)
    batch: int  # micro-batches of that epoch done
    step: int  # optimizer steps done
    batches: int  # micro-batches done, all epochs
    samples: int  # training samples seen, all epochs
    epoch_samples: int  # of the epoch in progress
    epoch_loss_sum: torch.Tensor  # () float64: the epoch's sum of loss * batch size
    logs: list[EpochLog]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # torch's optimizer state_dict
    order_rng: torch.Tensor  # uint8: the data-order generator at the start of `epoch`
    cpu_rng: torch.Tensor  # uint8
    cuda_rng: torch.Tensor | None = None  # uint8, the job's CUDA device
    scaler: dict[str, Any] | None = None  # torch.amp.GradScaler's state_dict (fp16)
    best_epoch: int | None = None
    best_loss: float | None = None
    best_batches: int = 0  # micro-batches done when the best epoch ended
    best_model: dict[str, torch.Tensor] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1  # the processes of the job that wrote it
    other_ranks: list[RankState] = field(default_factory=list)  # ranks 1 to world_size - 1

    def for_rank(self, rank: int, world_size: int) -> TrainState:
        """This checkpoint as rank ``rank`` of ``world_size`` resumes from it: its own RNG
        states and loss sum (NOTE [ Ranks in a checkpoint ]); :class:`TrainError` when the
        world size differs from the one that wrote it."""
        if world_size != self.world_size:
            raise TrainError(
                f"the training checkpoint was written by a job in {self.world_size} "
                f"process(es) and this job runs {world_size}: each rank's slices, RNG and loss "
                f"sums are those of {self.world_size}; submit with processes: "
                f"{self.world_size} to resume from it, or train anew"
            )
        if rank == 0:
            return self
        own = self.other_ranks[rank - 1]
        return replace(
            self, cpu_rng=own.cpu_rng, cuda_rng=own.cuda_rng, epoch_loss_sum=own.epoch_loss_sum
        )


def _cpu(t: torch.Tensor) -> torch.Tensor:
    # A copy of its own: safetensors refuses tensors that share storage (tied weights).
    return t.detach().to("cpu", copy=True).contiguous()


def state_bytes(state: TrainState) -> bytes:
    """``state`` as a safetensors file (NOTE [ Training checkpoints ])."""
    tensors: dict[str, torch.Tensor] = {f"model.{k}": _cpu(v) for k, v in state.model.items()}
    optimizer_values: dict[str, dict[str, Any]] = {}
    for index, values in state.optimizer["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = _cpu(value)
            else:
                optimizer_values.setdefault(str(index), {})[name] = value
    if state.best_model is not None:
        tensors |= {f"best.{k}": _cpu(v) for k, v in state.best_model.items()}
    tensors["epoch_loss_sum"] = _cpu(state.epoch_loss_sum)
    tensors["rng.order"] = _cpu(state.order_rng)
    tensors["rng.cpu"] = _cpu(state.cpu_rng)
    if state.cuda_rng is not None:
        tensors["rng.cuda"] = _cpu(state.cuda_rng)
    for rank, own in enumerate(state.other_ranks, start=1):  # NOTE [ Ranks in a checkpoint ]
        tensors[f"rank.{rank}.rng.cpu"] = _cpu(own.cpu_rng)
        if own.cuda_rng is not None:
            tensors[f"rank.{rank}.rng.cuda"] = _cpu(own.cuda_rng)
        tensors[f"rank.{rank}.epoch_loss_sum"] = _cpu(own.epoch_loss_sum)
    meta = {
        "version": FORMAT_VERSION,
        "epoch": state.epoch,
        "batch": state.batch,
        "step": state.step,
        "batches": state.batches,
        "samples": state.samples,
        "epoch_samples": state.epoch_samples,
        "logs": [asdict(log) for log in state.logs],
        "model_keys": list(state.model),
        "optimizer_tensors": {
            str(i): [n for n, v in values.items() if isinstance(v, torch.Tensor)]
            for i, values in state.optimizer["state"].items()
        },
        "optimizer_values": optimizer_values,
        "param_groups": state.optimizer["param_groups"],
        "scaler": state.scaler,
        "best_epoch": state.best_epoch,
        "best_loss": state.best_loss,
        "best_batches": state.best_batches,
        "extra": state.extra,
        "world_size": state.world_size,
    }
    return safetensors.torch.save(tensors, metadata={_METADATA_KEY: json.dumps(meta)})


def _metadata(f: Any) -> dict[str, Any]:
    """The JSON document of an open checkpoint file (NOTE [ Training checkpoints ])."""
    raw = (f.metadata() or {}).get(_METADATA_KEY)
    if raw is None:
        raise TrainError(
            "the training checkpoint has no bnadapt.train_state metadata: it is not a "
            "checkpoint a train job wrote; resume from a train job's own checkpoint"
        )
    meta: dict[str, Any] = json.loads(raw)
    if meta.get("version") != FORMAT_VERSION:
        raise TrainError(
            f"the training checkpoint is of format {meta.get('version')}, this worker "
            f"reads format {FORMAT_VERSION}; rerun the job from the start"
        )
    return meta


def state_position(path: Path) -> tuple[int, int]:
    """(step, epoch) of the checkpoint at ``path``, read from its metadata alone: no tensor is
    loaded (a job's process whose ranks load the checkpoint themselves)."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = _metadata(f)
    return int(meta["step"]), int(meta["epoch"])


def load_state(path: Path) -> TrainState:
    """The checkpoint in the safetensors file at ``path``; :class:`TrainError` for a file that
    is not one this version writes."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = _metadata(f)
        names = set(f.keys())
        model = {k: f.get_tensor(f"model.{k}") for k in meta["model_keys"]}
        best = None
        if meta["best_epoch"] is not None:
            best = {k: f.get_tensor(f"best.{k}") for k in meta["model_keys"]}
        optimizer_state: dict[int, dict[str, Any]] = {}
        for index, tensor_names in meta["optimizer_tensors"].items():
            optimizer_state[int(index)] = {
                n: f.get_tensor(f"optimizer.{index}.{n}") for n in tensor_names
            }
        for index, values in meta["optimizer_values"].items():
            optimizer_state.setdefault(int(index), {}).update(values)
        world_size = int(meta.get("world_size", 1))
        other_ranks = [
            RankState(
                cpu_rng=f.get_tensor(f"rank.{r}.rng.cpu"),
                cuda_rng=(
                    f.get_tensor(f"rank.{r}.rng.cuda") if f"rank.{r}.rng.cuda" in names else None
                ),
                epoch_loss_sum=f.get_tensor(f"rank.{r}.epoch_loss_sum"),
            )
            for r in range(1, world_size)
        ]
        return TrainState(
            epoch=meta["epoch"],
            batch=meta["batch"],
            step=meta["step"],
            batches=meta["batches"],
            samples=meta["samples"],
            epoch_samples=meta["epoch_samples"],
            epoch_loss_sum=f.get_tensor("epoch_loss_sum"),
            logs=[EpochLog(**log) for log in meta["logs"]],
            model=model,
            optimizer={"state": optimizer_state, "param_groups": meta["param_groups"]},
            order_rng=f.get_tensor("rng.order"),
            cpu_rng=f.get_tensor("rng.cpu"),
            cuda_rng=f.get_tensor("rng.cuda") if "rng.cuda" in names else None,
            scaler=meta["scaler"],
            best_epoch=meta["best_epoch"],
            best_loss=meta["best_loss"],
            best_batches=meta["best_batches"],
            best_model=best,
            extra=meta["extra"],
            world_size=world_size,
            other_ranks=other_ranks,
        )
