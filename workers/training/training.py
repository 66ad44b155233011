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
from dataclasses import dataclass, fields
from typing import Final, Literal, NamedTuple

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
    "TrainHooks",
    "TrainSettings",
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


@dataclass(frozen=True)
class TrainSettings:
    """What a run trains for, checked when built: ``epochs`` over the data, ``batch_size`` the
    micro-batch (NOTE [ Micro-batches and steps ]), ``validation_fraction`` of the samples held
    out, split and ordered by ``seed``; ``device`` takes the model and, batch by batch, the
    data."""

    epochs: int
    batch_size: int
    optimizer: Optimizer
    lr: float
    momentum: float
    weight_decay: float
    loss: Loss
    validation_fraction: float
    seed: int
    device: torch.device | str

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(
                f"epochs and batch_size must be >= 1, got {self.epochs} and {self.batch_size}"
            )
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must be in [0, 1), got {self.validation_fraction}"
            )
        if self.loss not in ("cross_entropy", "mse"):
            raise TrainError(f"unknown loss {self.loss!r}; use 'cross_entropy' or 'mse'")

    @classmethod
    def of(cls, params: TrainParams, *, loss: Loss, device: torch.device) -> TrainSettings:
        """A train job's settings (its params' fields of the same names); ``loss``: the
        params' or the one the labels call for."""
        named = {f.name: getattr(params, f.name) for f in fields(cls) if f.name in _FROM_PARAMS}
        return cls(**named, loss=loss, device=device)


# TrainSettings' fields that a train job's params hold under the same names.
_FROM_PARAMS: Final = frozenset(
    {"epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "validation_fraction"}
    | {"seed"}
)


@dataclass(frozen=True)
class TrainHooks:
    """What the caller hears and lends: ``progress(steps_done, total_steps)`` after each
    optimizer step; ``should_stop()`` before each micro-batch, which raises
    :class:`JobCanceled` when it answers True; ``on_epoch`` with each epoch's log once it is
    validated. ``forward`` runs the train steps' forward passes (default the model; a compiled
    model, workers/passes/steps.py); validation runs the model itself, in float32. ``clock``
    times each optimizer step, from reading its first batch to the update."""

    progress: Callable[[int, int], None] | None = None
    should_stop: Callable[[], bool] | None = None
    on_epoch: Callable[[EpochLog], None] | None = None
    forward: Forward | None = None
    clock: StepClock | None = None


def train_model(
    model: nn.Module,
    x: Data,
    y: torch.Tensor,
    settings: TrainSettings,
    *,
    recipe: Recipe | None = None,
    checkpointing: Checkpointing | None = None,
    hooks: TrainHooks | None = None,
    ranks: RankSlice | None = None,
) -> TrainStats:
    """Train ``model`` in place on ``x`` (N, ...) and ``y`` (N,) class labels or (N, ...)
    targets as ``settings`` and ``recipe`` ask; every module's training flag is restored at
    the end. ``checkpointing``: training checkpoints written through its ``save`` (NOTE [
    Training checkpoints ] in workers/training/train_state.py), and the one to resume from.

    ``ranks``: this process is one rank of a data-parallel job (workers/training/ranks.py):
    each micro-batch trains on its slice of the global micro-batch, ``hooks.forward`` is the
    DDP model, and only rank 0 validates. The epochs' train loss is averaged over the ranks.
    """
    loop = _TrainLoop(
        model, x, y, settings, recipe or Recipe(), checkpointing, hooks or TrainHooks(), ranks
    )
    if checkpointing is not None and checkpointing.resume is not None:
        loop.restore(checkpointing.resume)
    return loop.run()


class _Best(NamedTuple):
    """keep_best: the epoch whose weights are kept so far, and what a checkpoint says of it."""

    epoch: int
    loss: float
    batches: int  # micro-batches up to the end of that epoch
    model: dict[str, torch.Tensor]


@dataclass
class _Epoch:
    """One epoch under way: its order of the samples, drawn from the data-order generator as
    it was in ``order_rng``, and this rank's loss sum (float64, on the device) over the
    ``samples`` of the global micro-batches trained so far."""

    number: int
    order_rng: torch.Tensor
    order: torch.Tensor  # (N_train,) indices into x
    loss_sum: torch.Tensor
    samples: int


class _TrainLoop:
    """One :func:`train_model` run: what stays fixed (the split, the micro-batches, the
    schedule, the optimizer) built and checked once, and the counters a training checkpoint
    holds, which :meth:`restore` sets and each step advances. A step is a group of
    micro-batches (NOTE [ Micro-batches and steps ]); an epoch ends with its validation."""

    def __init__(
        self,
        model: nn.Module,
        x: Data,
        y: torch.Tensor,
        settings: TrainSettings,
        recipe: Recipe,
        checkpointing: Checkpointing | None,
        hooks: TrainHooks,
        ranks: RankSlice | None,
    ) -> None:
        self.model, self.x, self.y = model, x, y
        self.settings, self.recipe, self.hooks = settings, recipe, hooks
        self.checkpointing = checkpointing
        self.ranks = ranks or RankSlice()
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.train_idx, self.val_idx, self.bounds = _split(
            x, y, settings, recipe, self.ranks, self.generator
        )
        steps_per_epoch = -(-len(self.bounds) // recipe.accumulate_steps)
        self.total_steps = settings.epochs * steps_per_epoch
        self.schedule = Schedule(
            recipe.lr_schedule,
            settings.lr,
            self.total_steps,
            recipe.warmup_steps,
            steps_per_epoch,
            recipe.lr_step_epochs,
            recipe.lr_gamma,
        )
        self.target = torch.device(settings.device)
        if recipe.precision == "fp16" and self.target.type != "cuda":
            raise TrainError(
                f"precision fp16 runs on CUDA only, and this job runs on {self.target}"
            )
        model.to(self.target)
        self.opt = _make_optimizer(
            model, settings.optimizer, settings.lr, settings.momentum, settings.weight_decay
        )
        self.params = [p for group in self.opt.param_groups for p in group["params"]]
        self.scaler = torch.amp.GradScaler("cuda") if recipe.precision == "fp16" else None
        # (V, ...): a view of x, read as it is evaluated
        self.x_val, self.y_val = x[self.val_idx], y[self.val_idx]
        self.resume: TrainState | None = None
        self.logs: list[EpochLog] = []
        self.steps = self.batches = self.samples = 0
        self.first_epoch, self.first_batch = 1, 0
        self.best: _Best | None = None
        self.saved_at = 0.0
        self.checked = False  # the targets checked against the first outputs

    def restore(self, resume: TrainState) -> None:
        """Goes on from the training checkpoint ``resume``: weights, optimizer, scaler, the
        data order and the counters (the global RNGs are set when the run starts)."""
        # At epochs + 1 the checkpoint is the final one of this very job (an attempt lost
        # after training, while saving): nothing to redo, the weights are those.
        if resume.epoch > self.settings.epochs + 1:
            raise TrainError(
                f"the training checkpoint is past epoch {resume.epoch - 1} and the job asks "
                f"for {self.settings.epochs} epochs: nothing is left to train; ask for more "
                "epochs"
            )
        resume = resume.for_rank(self.ranks.rank, self.ranks.world_size)
        self.resume = resume
        self.model.load_state_dict(resume.model)
        self.opt.load_state_dict(resume.optimizer)
        if self.scaler is not None and resume.scaler is not None:
            self.scaler.load_state_dict(resume.scaler)
        self.generator.set_state(resume.order_rng)
        self.logs = list(resume.logs)
        self.steps, self.batches, self.samples = resume.step, resume.batches, resume.samples
        self.first_epoch, self.first_batch = resume.epoch, resume.batch
        # Only rank 0 validates, so only it keeps a best epoch (as in an uninterrupted run).
        if resume.best_epoch is not None and resume.best_model is not None and self.ranks.rank == 0:
            assert resume.best_loss is not None
            self.best = _Best(
                resume.best_epoch, resume.best_loss, resume.best_batches, resume.best_model
            )

    def run(self) -> TrainStats:
        """The epochs left, under the seed's global RNG (the caller's is left as it was), and
        the final checkpoint; keep_best's weights are loaded at the end."""
        epochs = self.settings.epochs
        self.saved_at = time.monotonic()
        rng_devices = [self.target] if self.target.type == "cuda" else []
        with training_flags(self.model), torch.random.fork_rng(devices=rng_devices):
            torch.manual_seed(self.settings.seed)
            if self.resume is not None:
                torch.set_rng_state(self.resume.cpu_rng)
                if self.resume.cuda_rng is not None and self.target.type == "cuda":
                    torch.cuda.set_rng_state(self.resume.cuda_rng, self.target)
            for number in range(self.first_epoch, epochs + 1):
                self._validate(self._epoch(number))
            if self.checkpointing is not None:
                zero = torch.zeros((), dtype=torch.float64)
                self.checkpointing.save(
                    self._snapshot(epochs + 1, 0, self.generator.get_state(), zero, 0)
                )
        best_epoch = None
        if self.recipe.keep_best and self.best is not None:
            self.model.load_state_dict(self.best.model)
            best_epoch, self.batches = self.best.epoch, self.best.batches
        return TrainStats(
            epochs=self.logs,
            steps=self.steps,
            samples=self.samples,
            batches=self.batches,
            best_epoch=best_epoch,
            resumed_from_step=None if self.resume is None else self.resume.step,
        )

    def _epoch(self, number: int) -> _Epoch:
        """Trains epoch ``number``'s steps, from the resumed micro-batch in the first one."""
        self.model.train()
        order_rng = self.generator.get_state()
        order = epoch_order(self.train_idx, self.generator)
        epoch = _Epoch(
            number, order_rng, order, torch.zeros((), dtype=torch.float64, device=self.target), 0
        )
        if self.resume is not None and number == self.resume.epoch:
            epoch.loss_sum = self.resume.epoch_loss_sum.to(self.target)
            epoch.samples = self.resume.epoch_samples
        skipped = self.first_batch if number == self.first_epoch else 0  # done before it
        batches_of_epoch = epoch_batches(
            self.x,
            order,
            self.bounds,
            first=skipped,
            augmentation=self.recipe.augmentation,
            seed=self.settings.seed,
            epoch=number,
            workers=self.recipe.loader_workers,
            take=self.ranks.take,
        )
        # Closed however the epoch ends: a cancel stops the loader processes too.
        with contextlib.closing(batches_of_epoch) as reader:
            for group in _groups(len(self.bounds), self.recipe.accumulate_steps):
                if group.start >= skipped:
                    self._step(epoch, group, reader)
        return epoch

    def _step(self, epoch: _Epoch, group: range, reader: Iterator[torch.Tensor]) -> None:
        """One optimizer step on the micro-batches ``group`` of the epoch, and the
        checkpoint after it when one is due."""
        # Samples of the global micro-batches (all ranks), NOTE [ Micro-batches and steps ]:
        # each rank weighs its slice's loss by its global batch's share.
        group_samples = sum(self.ranks.global_size(*self.bounds[i]) for i in group)
        clock = self.hooks.clock
        if clock is not None:
            clock.start()
        self.opt.zero_grad(set_to_none=True)
        for i in group:
            self._micro_batch(epoch, i, len(group), group_samples, next_batch=reader)
        self._update()
        if clock is not None:
            clock.stop(group_samples // self.ranks.world_size)  # this rank's
        self.steps += 1
        if self.hooks.progress is not None:
            self.hooks.progress(self.steps, self.total_steps)
        if self.checkpointing is not None and _checkpoint_due(
            self.checkpointing, self.steps, self.saved_at, self.ranks, self.target
        ):
            self.checkpointing.save(
                self._snapshot(
                    epoch.number, group.stop, epoch.order_rng, epoch.loss_sum, epoch.samples
                )
            )
            self.saved_at = time.monotonic()

    def _micro_batch(
        self,
        epoch: _Epoch,
        i: int,
        group_size: int,
        group_samples: int,
        next_batch: Iterator[torch.Tensor],
    ) -> None:
        """Forward and backward of micro-batch ``i`` of the epoch, its loss weighted by its
        global batch's share of the group's ``group_samples``."""
        if self.hooks.should_stop is not None and self.hooks.should_stop():
            raise JobCanceled(f"training canceled after {self.steps} of {self.total_steps} steps")
        start, stop = self.bounds[i]
        idx = self.ranks.take(epoch.order[start:stop])  # (B,), this rank's slice
        xb, yb = next(next_batch).to(self.target), self.y[idx].to(self.target)  # (B, ...) each
        with autocast(self.target, self.recipe.precision):
            outputs = (self.hooks.forward or self.model)(xb)  # (B, num_classes) or (B, ...)
        if not self.checked:
            check_targets(outputs, self.y, self.settings.loss)
            self.checked = True
        batch_loss = _train_loss(outputs, yb, self.settings.loss, self.recipe.label_smoothing)
        # NOTE [ Micro-batches and steps ]: the group's mean gradient.
        trained = self.ranks.global_size(start, stop)  # the global batch's, all ranks
        scaled = batch_loss if group_size == 1 else batch_loss * (trained / group_samples)
        torch.autograd.backward(scaled if self.scaler is None else self.scaler.scale(scaled))
        epoch.loss_sum += batch_loss.detach().double() * trained
        epoch.samples += trained
        self.batches += 1

    def _update(self) -> None:
        """The optimizer step at the schedule's rate, its gradients clipped as the recipe
        asks (unscaled first under fp16's scaler)."""
        for param_group in self.opt.param_groups:
            param_group["lr"] = self.schedule.at(self.steps)
        clip = self.recipe.clip_grad_norm
        if self.scaler is not None:
            if clip is not None:
                self.scaler.unscale_(self.opt)
                nn.utils.clip_grad_norm_(self.params, clip)
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            if clip is not None:
                nn.utils.clip_grad_norm_(self.params, clip)
            self.opt.step()

    def _validate(self, epoch: _Epoch) -> None:
        """The epoch's log: its train loss over all ranks, rank 0's validation; the best
        epoch's weights kept when the recipe asks."""
        self.samples += epoch.samples
        # One device sync per epoch; averaged over the ranks into a copy: a checkpoint keeps
        # this rank's own sum.
        train_loss = self.ranks.average(epoch.loss_sum.clone()).item() / epoch.samples
        if not math.isfinite(train_loss):
            raise TrainError(
                f"the training loss became {train_loss} in epoch {epoch.number}; lower lr "
                f"(now {self.settings.lr}) or check the data for extreme values"
            )
        val = None
        if self.val_idx.numel() and self.ranks.rank == 0:
            val = evaluate_sums(
                self.model,
                self.x_val,
                self.y_val,
                batch_size=self.settings.batch_size,
                loss=self.settings.loss,
                device=self.target,
            ).metrics()
        log = EpochLog(
            epoch=epoch.number,
            train_loss=train_loss,
            val_loss=None if val is None else val.loss,
            val_accuracy=None if val is None else val.accuracy,
            lr=self.schedule.at(self.steps - 1),
            best=val is not None
            and all(e.val_loss is None or val.loss < e.val_loss for e in self.logs),
        )
        self.logs.append(log)
        if self.hooks.on_epoch is not None:
            self.hooks.on_epoch(log)
        best = self.best
        if self.recipe.keep_best and val is not None and (best is None or val.loss < best.loss):
            kept = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.best = _Best(epoch.number, val.loss, self.batches, kept)

    def _snapshot(
        self, number: int, batch: int, order_rng: torch.Tensor, loss_sum: torch.Tensor, seen: int
    ) -> TrainState:
        """The training checkpoint before micro-batch ``batch`` of epoch ``number``, whose
        order was drawn from ``order_rng`` and whose ``seen`` samples sum to ``loss_sum``."""
        ranks, target = self.ranks, self.target
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
        best = self.best
        return TrainState(
            epoch=number,
            batch=batch,
            step=self.steps,
            batches=self.batches,
            samples=self.samples,
            epoch_samples=seen,
            epoch_loss_sum=loss_sum,
            logs=list(self.logs),
            model=self.model.state_dict(),
            optimizer=self.opt.state_dict(),
            order_rng=order_rng,
            cpu_rng=cpu_rng,
            cuda_rng=cuda_rng,
            scaler=None if self.scaler is None else self.scaler.state_dict(),
            best_epoch=None if best is None else best.epoch,
            best_loss=None if best is None else best.loss,
            best_batches=0 if best is None else best.batches,
            best_model=None if best is None else best.model,
            world_size=ranks.world_size,
            other_ranks=other_ranks,
        )


def _split(
    x: Data,
    y: torch.Tensor,
    settings: TrainSettings,
    recipe: Recipe,
    ranks: RankSlice,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """The (train, validation) indices of ``x`` drawn from ``generator``, and the [start,
    stop) of each micro-batch of an epoch; errors that say what to change when they leave
    too little to train on."""
    if x.shape[0] != y.shape[0]:
        raise DataError(f"x has {x.shape[0]} samples but y has {y.shape[0]}; give one each")
    train_idx, val_idx = split_indices(x.shape[0], settings.validation_fraction, generator)
    if train_idx.numel() < 2:
        raise TrainError(
            f"{x.shape[0]} samples with validation_fraction={settings.validation_fraction} "
            f"leave {train_idx.numel()} for training; BatchNorm needs at least 2: upload more "
            "data or lower validation_fraction"
        )
    if recipe.keep_best and not val_idx.numel():
        raise TrainError("keep_best needs a validation split; set validation_fraction above 0")
    bounds = ranks.keep(batch_bounds(train_idx.numel(), settings.batch_size))
    if not bounds:
        raise TrainError(
            f"{train_idx.numel()} training samples over {ranks.world_size} processes leave "
            "no rank 2 samples a step; upload more data or use fewer processes"
        )
    return train_idx, val_idx, bounds


def train_with_params(
    params: TrainParams,
    model: nn.Module,
    x: Data,
    y: torch.Tensor,
    *,
    loss: Loss,
    device: torch.device,
    checkpointing: Checkpointing | None = None,
    hooks: TrainHooks | None = None,
    ranks: RankSlice | None = None,
) -> TrainStats:
    """:func:`train_model` as a train job's ``params`` ask, in one process or as one of its
    ranks (workers/training/ranks.py); ``loss``: the params' or the one the labels call for."""
    return train_model(
        model,
        x,
        y,
        TrainSettings.of(params, loss=loss, device=device),
        recipe=Recipe.of(params),
        checkpointing=checkpointing,
        hooks=hooks,
        ranks=ranks,
    )
