"""Supervised training on one labelled data set, deterministic given the seed, with a
trainer's recipe and resumable from a training checkpoint (docs/training.md).

The seed fixes the train/validation split and each epoch's order (one ``torch.Generator``,
:func:`epoch_order`) and the global RNG that Dropout and friends draw from, forked so the
caller's RNG state is left as it was. With a checkpoint wrapper applied, the resulting
``state_dict`` is bitwise that of the unwrapped model, ``num_batches_tracked`` included (NOTE
in bnadapt/checkpoint.py).

NOTE [ Micro-batches and steps ]
``batch_size`` samples make a micro-batch: one forward and backward pass, one BatchNorm
statistics update. ``accumulate_steps`` consecutive micro-batches of an epoch make a group,
whose gradients add up before one optimizer step; each micro-batch's mean loss is weighted by
its share of the group's samples, so the step takes the mean gradient over the group's
samples (the last group of an epoch may hold fewer micro-batches). The learning rate of
optimizer step t is set from t alone (workers/training/schedules.py), just before the step. A
training checkpoint is taken after a step, so a resumed run starts at a group's first
micro-batch: at (epoch, batch) it draws the epoch's order again from the data-order generator
as it was at the epoch's start and skips ``batch`` micro-batches.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own convention

from api_schemas.jobs.train import Augmentation, TrainParams
from workers.errors import DataError, JobCanceled, TrainError
from workers.models.modules import training_flags
from workers.passes.data import Data
from workers.passes.precision import autocast
from workers.passes.steps import Forward, StepClock
from workers.passes.train_batches import epoch_batches
from workers.running.evaluation import (
    Loss,
    check_targets,
    compute_loss,
    evaluate_sums,
)
from workers.training.schedules import Schedule
from workers.training.train_state import EpochLog, RankState, TrainState

__all__ = [
    "Checkpointing",
    "EpochLog",
    "Optimizer",
    "RankSlice",
    "Recipe",
    "TrainStats",
    "batch_bounds",
    "epoch_order",
    "split_indices",
    "train_model",
    "train_with_params",
]

Optimizer = Literal["sgd", "adamw"]
Precision = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class Recipe:
    """How each optimizer step is taken (TrainParams' fields of the same names)."""

    lr_schedule: Literal["constant", "cosine", "step", "one_cycle"] = "constant"
    warmup_steps: int = 0
    lr_step_epochs: int = 1
    lr_gamma: float = 0.1
    label_smoothing: float = 0.0
    clip_grad_norm: float | None = None
    accumulate_steps: int = 1
    precision: Precision = "fp32"
    keep_best: bool = False
    augmentation: Augmentation | None = None
    loader_workers: int = 0  # DataLoader processes reading the training batches

    @classmethod
    def of(cls, params: TrainParams) -> Recipe:
        """A train job's recipe."""
        return cls(
            lr_schedule=params.lr_schedule,
            warmup_steps=params.warmup_steps,
            lr_step_epochs=params.lr_step_epochs or 1,
            lr_gamma=params.lr_gamma,
            label_smoothing=params.label_smoothing,
            clip_grad_norm=params.clip_grad_norm,
            accumulate_steps=params.accumulate_steps,
            precision=params.precision,
            keep_best=params.keep_best,
            augmentation=params.augmentation,
            loader_workers=params.loader_workers,
        )


@dataclass(frozen=True)
class Checkpointing:
    """When to hand a :class:`TrainState` to ``save`` (besides once at the end), and the one to
    go on from. ``save`` must write the state before it returns: its tensors are the live
    model's, optimizer's and loss sum's, which the next step changes in place."""

    save: Callable[[TrainState], None]
    every_steps: int | None = None
    every_s: float | None = None
    resume: TrainState | None = None

    @classmethod
    def of(
        cls, params: TrainParams, save: Callable[[TrainState], None], resume: TrainState | None
    ) -> Checkpointing | None:
        """A train job's checkpointing: ``save`` as often as its params ask, going on from
        ``resume``; a job that asks for none writes none (a resumed one goes on all the
        same); None when there is neither."""
        wanted = params.save_every_steps is not None or params.save_every_s is not None
        if not wanted and resume is None:
            return None
        return cls(
            save=save if wanted else _keep_none,
            every_steps=params.save_every_steps,
            every_s=None if params.save_every_s is None else float(params.save_every_s),
            resume=resume,
        )


def _keep_none(state: TrainState) -> None:
    """A resumed job that asks for no checkpoints of its own writes none."""


@dataclass(frozen=True)
class TrainStats:
    epochs: list[EpochLog]
    steps: int  # optimizer steps, all attempts together
    samples: int  # training samples seen, all epochs together
    # Micro-batches run in train mode that the returned weights hold: one BatchNorm update
    # each (with keep_best, those up to the end of the best epoch).
    batches: int = 0
    best_epoch: int | None = None  # keep_best: the epoch whose weights were kept
    resumed_from_step: int | None = None  # the checkpoint's step this run went on from


def split_indices(
    num_samples: int, validation_fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) indices of a random split; a positive fraction keeps at least one
    validation sample."""
    num_val = 0
    if validation_fraction > 0:
        num_val = max(1, int(num_samples * validation_fraction))
    perm = torch.randperm(num_samples, generator=generator)
    return perm[num_val:], perm[:num_val]


def batch_bounds(num_samples: int, batch_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each batch of an epoch. A last batch of one sample is dropped when
    batches are larger: BatchNorm1d cannot train on one sample, and one sample would weigh as
    much as a whole batch in that step."""
    bounds = [(i, min(i + batch_size, num_samples)) for i in range(0, num_samples, batch_size)]
    if batch_size > 1 and len(bounds) > 1 and num_samples % batch_size == 1:
        bounds.pop()
    return bounds


@dataclass(frozen=True)
class RankSlice:
    """The part of each global batch this process trains on, one of ``world_size`` ranks of a
    data-parallel job (NOTE [ Ranks' batches ] in workers/training/ranks.py); the default is the
    whole batch."""

    rank: int = 0
    world_size: int = 1

    def take(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's indices of a global batch's (B,): every ``world_size``-th from the
        ``rank``-th, as DistributedSampler deals them, once a short last batch is cut to a
        multiple of ``world_size``."""
        usable = batch.numel() - batch.numel() % self.world_size
        return batch[:usable][self.rank :: self.world_size]  # (usable / world_size,)

    def global_size(self, start: int, stop: int) -> int:
        """The samples all ranks train on of the global batch ``[start, stop)``."""
        return (stop - start) - (stop - start) % self.world_size

    def keep(self, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``bounds`` less a short last batch that leaves a rank fewer than 2 samples, which
        BatchNorm cannot train on (as :func:`batch_bounds` drops a one-sample batch)."""
        if self.world_size == 1:
            return bounds
        return [(a, b) for a, b in bounds if (b - a) // self.world_size >= 2]

    def average(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the ranks (all ranks call it together)."""
        if self.world_size > 1:
            dist.all_reduce(value)
            value /= self.world_size
        return value

    def agree(self, decided: bool, device: torch.device) -> bool:
        """Rank 0's ``decided``, on every rank (all ranks call it together): a decision taken
        on one clock, as when to write a checkpoint by time (NOTE [ Ranks in a checkpoint ]
        in workers/training/train_state.py)."""
        if self.world_size == 1:
            return decided
        flag = torch.tensor([int(decided)], dtype=torch.int32, device=device)  # (1,)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def gather(self, value: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
        """Every rank's ``value`` (of one shape and dtype on all ranks), in rank order, on the
        CPU (all ranks call it together)."""
        if self.world_size == 1:
            return [value.cpu()]
        # A collective runs on the process group's device: the CPU for gloo, a GPU for NCCL.
        local = value.to(device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return [part.cpu() for part in parts]


def _make_optimizer(
    model: nn.Module, name: Optimizer, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainError("the model has no trainable parameters; there is nothing to train")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":  # momentum is AdamW's beta1 (both default to 0.9)
        return torch.optim.AdamW(params, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay)
    raise TrainError(f"unknown optimizer {name!r}; use 'sgd' or 'adamw'")


def epoch_order(train_idx: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The epoch's order of the training samples' indices (N,): one permutation drawn from
    the data-order ``generator``. Every consumer of an epoch's order calls this, once an
    epoch, so that a resumed run (and each process of a distributed one, slicing each global
    batch) sees the same order."""
    return train_idx[torch.randperm(train_idx.numel(), generator=generator)]


def _train_loss(
    outputs: torch.Tensor, targets: torch.Tensor, loss: Loss, label_smoothing: float
) -> torch.Tensor:
    outputs = outputs.float()  # autocast's half outputs: the loss in float32
    if loss == "cross_entropy" and label_smoothing > 0:
        return F.cross_entropy(outputs, targets, label_smoothing=label_smoothing)
    return compute_loss(outputs, targets, loss, "mean")


def _groups(num_batches: int, accumulate: int) -> Iterator[range]:
    """The micro-batch indices of each optimizer step of an epoch."""
    for first in range(0, num_batches, accumulate):
        yield range(first, min(first + accumulate, num_batches))


def _checkpoint_due(
    checkpointing: Checkpointing,
    steps: int,
    saved_at: float,
    ranks: RankSlice,
    device: torch.device,
) -> bool:
    """Whether to write a checkpoint after optimizer step ``steps``: by steps, the same count
    on every rank; by time, rank 0's clock, agreed by all ranks after every step (NOTE [ Ranks
    in a checkpoint ] in workers/training/train_state.py)."""
    due = bool(checkpointing.every_steps and steps % checkpointing.every_steps == 0)
    if checkpointing.every_s:
        late = time.monotonic() - saved_at >= checkpointing.every_s
        due = ranks.agree(late, device) or due  # every rank takes part, due or not
    return due


def train_model(
    model: nn.Module,
    x: Data,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    optimizer: Optimizer,
    lr: float,
    momentum: float,
    weight_decay: float,
    loss: Loss,
    validation_fraction: float,
    seed: int,
    device: torch.device | str,
    recipe: Recipe | None = None,
    checkpointing: Checkpointing | None = None,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_epoch: Callable[[EpochLog], None] | None = None,
    forward: Forward | None = None,
    clock: StepClock | None = None,
    ranks: RankSlice | None = None,
) -> TrainStats:
    """Train ``model`` in place on ``x`` (N, ...) and ``y`` (N,) class labels or (N, ...)
    targets; the model is moved to ``device``, the data goes there batch by batch.
    ``batch_size`` is the micro-batch (NOTE [ Micro-batches and steps ]).

    ``progress(steps_done, total_steps)`` after each optimizer step; ``should_stop()`` before
    each micro-batch, raising :class:`JobCanceled` when it answers True; ``on_epoch`` with
    each epoch's log once it is validated. Every module's training flag is restored at the
    end. ``checkpointing``: training checkpoints written through its ``save`` (NOTE [
    Training checkpoints ] in workers/training/train_state.py), and the one to resume from.

    ``forward`` runs the train steps' forward passes (default ``model``; a compiled
    ``model``, workers/passes/steps.py); validation runs ``model`` itself, in float32.
    ``clock`` times each optimizer step, from reading its first batch to the update.

    ``ranks``: this process is one rank of a data-parallel job (workers/training/ranks.py):
    each micro-batch trains on its slice of the global micro-batch, ``forward`` is the DDP
    model, and only rank 0 validates. The epochs' train loss is averaged over the ranks.
    """
    recipe = recipe or Recipe()
    ranks = ranks or RankSlice()
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    if loss not in ("cross_entropy", "mse"):
        raise TrainError(f"unknown loss {loss!r}; use 'cross_entropy' or 'mse'")
    if x.shape[0] != y.shape[0]:
        raise DataError(f"x has {x.shape[0]} samples but y has {y.shape[0]}; give one each")
    generator = torch.Generator().manual_seed(seed)
    train_idx, val_idx = split_indices(x.shape[0], validation_fraction, generator)
    if train_idx.numel() < 2:
        raise TrainError(
            f"{x.shape[0]} samples with validation_fraction={validation_fraction} leave "
            f"{train_idx.numel()} for training; BatchNorm needs at least 2: upload more data "
            "or lower validation_fraction"
        )
    if recipe.keep_best and not val_idx.numel():
        raise TrainError("keep_best needs a validation split; set validation_fraction above 0")
    bounds = ranks.keep(batch_bounds(train_idx.numel(), batch_size))
    if not bounds:
        raise TrainError(
            f"{train_idx.numel()} training samples over {ranks.world_size} processes leave "
            "no rank 2 samples a step; upload more data or use fewer processes"
        )
    steps_per_epoch = -(-len(bounds) // recipe.accumulate_steps)
    total_steps = epochs * steps_per_epoch
    schedule = Schedule(
        recipe.lr_schedule,
        lr,
        total_steps,
        recipe.warmup_steps,
        steps_per_epoch,
        recipe.lr_step_epochs,
        recipe.lr_gamma,
    )
    target = torch.device(device)
    if recipe.precision == "fp16" and target.type != "cuda":
        raise TrainError(f"precision fp16 runs on CUDA only, and this job runs on {target}")
    model.to(target)
    opt = _make_optimizer(model, optimizer, lr, momentum, weight_decay)
    params = [p for group in opt.param_groups for p in group["params"]]
    scaler = torch.amp.GradScaler("cuda") if recipe.precision == "fp16" else None
    x_val, y_val = x[val_idx], y[val_idx]  # (V, ...): a view of x, read as it is evaluated

    resume = checkpointing.resume if checkpointing is not None else None
    logs: list[EpochLog] = []
    steps = batches = samples = 0
    first_epoch, first_batch = 1, 0
    best: tuple[int, float, int, dict[str, torch.Tensor]] | None = None
    if resume is not None:
        # At epochs + 1 the checkpoint is the final one of this very job (an attempt lost
        # after training, while saving): nothing to redo, the weights are those.
        if resume.epoch > epochs + 1:
            raise TrainError(
                f"the training checkpoint is past epoch {resume.epoch - 1} and the job asks "
                f"for {epochs} epochs: nothing is left to train; ask for more epochs"
            )
        resume = resume.for_rank(ranks.rank, ranks.world_size)
        model.load_state_dict(resume.model)
        opt.load_state_dict(resume.optimizer)
        if scaler is not None and resume.scaler is not None:
            scaler.load_state_dict(resume.scaler)
        generator.set_state(resume.order_rng)
        logs = list(resume.logs)
        steps, batches, samples = resume.step, resume.batches, resume.samples
        first_epoch, first_batch = resume.epoch, resume.batch
        # Only rank 0 validates, so only it keeps a best epoch (as in an uninterrupted run).
        if resume.best_epoch is not None and resume.best_model is not None and ranks.rank == 0:
            assert resume.best_loss is not None
            best = (resume.best_epoch, resume.best_loss, resume.best_batches, resume.best_model)

    def state_at(
        epoch: int, batch: int, epoch_rng: torch.Tensor, loss_sum: torch.Tensor, seen: int
    ) -> TrainState:
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(target) if target.type == "cuda" else None
        other_ranks: list[RankState] = []
        if ranks.world_size > 1:  # NOTE [ Ranks in a checkpoint ]: every rank's own, gathered
            cpus = ranks.gather(cpu_rng, target)
            cudas = None if cuda_rng is None else ranks.gather(cuda_rng, target)
            sums = ranks.gather(loss_sum.reshape(()), target)
            other_ranks = [
                RankState(cpus[r], None if cudas is None else cudas[r], sums[r])
                for r in range(1, ranks.world_size)
            ]
        return TrainState(
            epoch=epoch,
            batch=batch,
            step=steps,
            batches=batches,
            samples=samples,
            epoch_samples=seen,
            epoch_loss_sum=loss_sum,
            logs=list(logs),
            model=model.state_dict(),
            optimizer=opt.state_dict(),
            order_rng=epoch_rng,
            cpu_rng=cpu_rng,
            cuda_rng=cuda_rng,
            scaler=None if scaler is None else scaler.state_dict(),
            best_epoch=None if best is None else best[0],
            best_loss=None if best is None else best[1],
            best_batches=0 if best is None else best[2],
            best_model=None if best is None else best[3],
            world_size=ranks.world_size,
            other_ranks=other_ranks,
        )

    saved_at = time.monotonic()
    checked = False
    rng_devices = [target] if target.type == "cuda" else []
    with training_flags(model), torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        if resume is not None:
            torch.set_rng_state(resume.cpu_rng)
            if resume.cuda_rng is not None and target.type == "cuda":
                torch.cuda.set_rng_state(resume.cuda_rng, target)
        for epoch in range(first_epoch, epochs + 1):
            model.train()
            epoch_rng = generator.get_state()
            order = epoch_order(train_idx, generator)
            loss_sum = torch.zeros((), dtype=torch.float64, device=target)
            epoch_samples = 0
            if resume is not None and epoch == resume.epoch:
                loss_sum = resume.epoch_loss_sum.to(target)
                epoch_samples = resume.epoch_samples
            skipped = first_batch if epoch == first_epoch else 0  # done before the checkpoint
            batches_of_epoch = epoch_batches(
                x,
                order,
                bounds,
                first=skipped,
                augmentation=recipe.augmentation,
                seed=seed,
                epoch=epoch,
                workers=recipe.loader_workers,
                take=ranks.take,
            )
            # Closed however the epoch ends: a cancel stops the loader processes too.
            with contextlib.closing(batches_of_epoch) as reader:
                for group in _groups(len(bounds), recipe.accumulate_steps):
                    if group.start < skipped:
                        continue
                    # Samples of the global micro-batches (all ranks), NOTE [ Micro-batches
                    # and steps ]: each rank weighs its slice's loss by its global batch's share.
                    group_samples = sum(ranks.global_size(*bounds[i]) for i in group)
                    if clock is not None:
                        clock.start()
                    opt.zero_grad(set_to_none=True)
                    for i in group:
                        if should_stop is not None and should_stop():
                            raise JobCanceled(
                                f"training canceled after {steps} of {total_steps} steps"
                            )
                        start, stop = bounds[i]
                        idx = ranks.take(order[start:stop])  # (B,), this rank's slice
                        xb, yb = next(reader).to(target), y[idx].to(target)  # (B, ...), (B, ...)
                        with autocast(target, recipe.precision):
                            outputs = (forward or model)(xb)  # (B, num_classes) or (B, ...)
                        if not checked:
                            check_targets(outputs, y, loss)
                            checked = True
                        batch_loss = _train_loss(outputs, yb, loss, recipe.label_smoothing)
                        # NOTE [ Micro-batches and steps ]: the group's mean gradient.
                        scaled = (
                            batch_loss
                            if len(group) == 1
                            else batch_loss * (ranks.global_size(start, stop) / group_samples)
                        )
                        torch.autograd.backward(scaled if scaler is None else scaler.scale(scaled))
                        trained = ranks.global_size(start, stop)  # the global batch's, all ranks
                        loss_sum += batch_loss.detach().double() * trained
                        epoch_samples += trained
                        batches += 1
                    for param_group in opt.param_groups:
                        param_group["lr"] = schedule.at(steps)
                    if scaler is not None:
                        if recipe.clip_grad_norm is not None:
                            scaler.unscale_(opt)
                            nn.utils.clip_grad_norm_(params, recipe.clip_grad_norm)
                        scaler.step(opt)
                        scaler.update()
                    else:
                        if recipe.clip_grad_norm is not None:
                            nn.utils.clip_grad_norm_(params, recipe.clip_grad_norm)
                        opt.step()
                    if clock is not None:
                        clock.stop(group_samples // ranks.world_size)  # this rank's
                    steps += 1
                    if progress is not None:
                        progress(steps, total_steps)
                    if checkpointing is not None and _checkpoint_due(
                        checkpointing, steps, saved_at, ranks, target
                    ):
                        checkpointing.save(
                            state_at(epoch, group.stop, epoch_rng, loss_sum, epoch_samples)
                        )
                        saved_at = time.monotonic()
            samples += epoch_samples
            # One device sync per epoch; averaged over the ranks into a copy: a checkpoint keeps
            # this rank's own sum.
            train_loss = ranks.average(loss_sum.clone()).item() / epoch_samples
            if not math.isfinite(train_loss):
                raise TrainError(
                    f"the training loss became {train_loss} in epoch {epoch}; lower lr "
                    f"(now {lr}) or check the data for extreme values"
                )
            val = None
            if val_idx.numel() and ranks.rank == 0:
                val = evaluate_sums(
                    model, x_val, y_val, batch_size=batch_size, loss=loss, device=target
                ).metrics()
            log = EpochLog(
                epoch=epoch,
                train_loss=train_loss,
                val_loss=None if val is None else val.loss,
                val_accuracy=None if val is None else val.accuracy,
                lr=schedule.at(steps - 1),
                best=val is not None
                and all(e.val_loss is None or val.loss < e.val_loss for e in logs),
            )
            logs.append(log)
            if on_epoch is not None:
                on_epoch(log)
            if recipe.keep_best and val is not None and (best is None or val.loss < best[1]):
                kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
                best = (epoch, val.loss, batches, kept)
        if checkpointing is not None:
            zero = torch.zeros((), dtype=torch.float64)
            checkpointing.save(state_at(epochs + 1, 0, generator.get_state(), zero, 0))
    best_epoch = None
    if recipe.keep_best and best is not None:
        model.load_state_dict(best[3])
        best_epoch, batches = best[0], best[2]
    return TrainStats(
        epochs=logs,
        steps=steps,
        samples=samples,
        batches=batches,
        best_epoch=best_epoch,
        resumed_from_step=None if resume is None else resume.step,
    )


def train_with_params(
    params: TrainParams,
    model: nn.Module,
    x: Data,
    y: torch.Tensor,
    *,
    loss: Loss,
    device: torch.device,
    checkpointing: Checkpointing | None = None,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_epoch: Callable[[EpochLog], None] | None = None,
    forward: Forward | None = None,
    clock: StepClock | None = None,
    ranks: RankSlice | None = None,
) -> TrainStats:
    """:func:`train_model` as a train job's ``params`` ask, in one process or as one of its
    ranks (workers/training/ranks.py); ``loss``: the params' or the one the labels call for."""
    return train_model(
        model,
        x,
        y,
        epochs=params.epochs,
        batch_size=params.batch_size,
        optimizer=params.optimizer,
        lr=params.lr,
        momentum=params.momentum,
        weight_decay=params.weight_decay,
        loss=loss,
        validation_fraction=params.validation_fraction,
        seed=params.seed,
        device=device,
        recipe=Recipe.of(params),
        checkpointing=checkpointing,
        progress=progress,
        should_stop=should_stop,
        on_epoch=on_epoch,
        forward=forward,
        clock=clock,
        ranks=ranks,
    )
