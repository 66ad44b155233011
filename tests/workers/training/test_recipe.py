"""The trainer's recipe and resumable training, against a hand-written plain-torch loop.

Each reference loop below is written out from the definitions in docs/training.md (the split
and each epoch's order from one generator seeded with the seed, the learning rate of step t,
the group's mean gradient), with torch's own functions for what torch defines (label
smoothing, clipping, its schedulers). Where the loop takes the same operations in the same
order the results are compared with ``torch.equal``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own convention

from api_schemas.jobs.train import Augmentation
from tests.workers.training.test_training import (
    SETTINGS,
    assert_same_state,
    digits,
    digits_cnn,
    nbt,
)
from workers.errors import TrainError
from workers.passes.augmentation import augment, batch_generator
from workers.training.schedules import Schedule
from workers.training.train_state import TrainState, load_state, state_bytes
from workers.training.training import (
    Checkpointing,
    Recipe,
    TrainHooks,
    TrainSettings,
    batch_bounds,
    epoch_order,
    split_indices,
    train_model,
)

__all__ = ["digits"]  # the fixture, imported for its name

LR = 0.05


def reference_loop(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr_at: Callable[[int], float],
    accumulate: int = 1,
    label_smoothing: float = 0.0,
    clip: float | None = None,
    validation_fraction: float = 0.2,
    seed: int = 7,
) -> None:
    """Plain SGD (momentum 0.9, weight decay 1e-4) as docs/training.md defines a train job."""
    generator = torch.Generator().manual_seed(seed)
    n_val = max(1, int(len(x) * validation_fraction)) if validation_fraction else 0
    perm = torch.randperm(len(x), generator=generator)
    train_idx = perm[n_val:]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    bounds = batch_bounds(train_idx.numel(), batch_size)
    step = 0
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for _ in range(epochs):
            model.train()
            order = train_idx[torch.randperm(train_idx.numel(), generator=generator)]
            for first in range(0, len(bounds), accumulate):
                group = bounds[first : first + accumulate]
                group_samples = sum(stop - start for start, stop in group)
                opt.zero_grad(set_to_none=True)
                for start, stop in group:
                    idx = order[start:stop]
                    out = model(x[idx])
                    loss = F.cross_entropy(out, y[idx], label_smoothing=label_smoothing)
                    if len(group) > 1:
                        loss = loss * ((stop - start) / group_samples)
                    loss.backward()
                for param_group in opt.param_groups:
                    param_group["lr"] = lr_at(step)
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
                opt.step()
                step += 1


def warm(t: int, w: int) -> float:
    return (t + 1) / (w + 1)


# 240 training samples in batches of 32: 8 batches (7 of 32, one of 16) an epoch.
STEPS_PER_EPOCH = 8
TOTAL = 3 * STEPS_PER_EPOCH
W = 5


def cosine_lr(t: int) -> float:
    if t < W:
        return LR * warm(t, W)
    return LR * 0.5 * (1 + math.cos(math.pi * (t - W) / (TOTAL - W)))


def step_lr(t: int) -> float:
    if t < W:
        return LR * warm(t, W)
    return LR * 0.5 ** (t // STEPS_PER_EPOCH)


def one_cycle_lr(t: int) -> float:
    low, end = LR / 25, LR / 25 / 1e4
    if t < W:
        return low + (LR - low) * t / W
    fall = TOTAL - 1 - W
    return end + (LR - end) * 0.5 * (1 + math.cos(math.pi * (t - W) / fall))


SCHEDULES: dict[str, tuple[Callable[[int], float], dict[str, Any]]] = {
    "constant": (lambda t: LR * warm(t, W) if t < W else LR, {}),
    "cosine": (cosine_lr, {}),
    "step": (step_lr, {"lr_step_epochs": 1, "lr_gamma": 0.5}),
    "one_cycle": (one_cycle_lr, {}),
}


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_each_schedule_with_warm_up_is_the_hand_written_loop(
    digits: tuple[torch.Tensor, torch.Tensor], kind: str
) -> None:
    x, y = digits
    lr_at, options = SCHEDULES[kind]
    schedule = Schedule(
        kind,  # type: ignore[arg-type]
        LR,
        TOTAL,
        W,
        STEPS_PER_EPOCH,
        options.get("lr_step_epochs", 1),
        options.get("lr_gamma", 0.1),
    )
    for t in range(TOTAL):
        assert schedule.at(t) == pytest.approx(lr_at(t), rel=1e-12, abs=1e-15), t
    reference, trained = digits_cnn(), digits_cnn()
    reference_loop(reference, x, y, epochs=3, batch_size=32, lr_at=lr_at)
    recipe = Recipe(lr_schedule=kind, warmup_steps=W, **options)  # type: ignore[arg-type]
    stats = train_model(trained, x, y, TrainSettings(**(SETTINGS | {"epochs": 3})), recipe=recipe)
    assert stats.steps == TOTAL
    for key, value in reference.state_dict().items():
        # The rates agree to the last bits, not always bitwise: the weights to float tolerance.
        assert torch.allclose(trained.state_dict()[key], value, rtol=1e-5, atol=1e-6), key
    assert nbt(trained) == [TOTAL, TOTAL]


def test_schedules_without_warm_up_are_torchs_own() -> None:
    """Cosine, step and one_cycle's rise against torch.optim.lr_scheduler on the same steps."""
    param = nn.Parameter(torch.zeros(1))
    for kind, make in [
        ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=TOTAL)),
        ("step", lambda o: torch.optim.lr_scheduler.StepLR(o, STEPS_PER_EPOCH * 2, 0.5)),
    ]:
        opt = torch.optim.SGD([param], lr=LR)
        torch_schedule = make(opt)
        ours = Schedule(kind, LR, TOTAL, 0, STEPS_PER_EPOCH, 2, 0.5)  # type: ignore[arg-type]
        for t in range(TOTAL):
            assert ours.at(t) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9), (kind, t)
            opt.step()
            torch_schedule.step()


def test_accumulation_is_the_hand_written_loop_bitwise(
    digits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = digits
    reference, trained = digits_cnn(), digits_cnn()
    reference_loop(reference, x, y, epochs=2, batch_size=32, lr_at=lambda t: LR, accumulate=3)
    stats = train_model(trained, x, y, TrainSettings(**SETTINGS), recipe=Recipe(accumulate_steps=3))
    assert_same_state(reference, trained)
    # 8 micro-batches an epoch in groups of 3, 3, 2: 3 optimizer steps, 8 statistics updates.
    assert (stats.steps, stats.batches) == (6, 16)
    assert nbt(trained) == [16, 16]


def test_accumulated_micro_batches_step_like_their_whole_batch() -> None:
    """Without BatchNorm, 4 micro-batches of 8 take the step one batch of 32 takes (the mean
    gradient over the same samples), to float tolerance."""
    torch.manual_seed(1)
    x, y = torch.randn(256, 10), torch.randint(0, 3, (256,))
    whole = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    accumulated = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    accumulated.load_state_dict(whole.state_dict())
    settings = SETTINGS | {"validation_fraction": 0.0, "epochs": 2}
    train_model(whole, x, y, TrainSettings(**(settings | {"batch_size": 32})))
    stats = train_model(
        accumulated,
        x,
        y,
        TrainSettings(**(settings | {"batch_size": 8})),
        recipe=Recipe(accumulate_steps=4),
    )
    assert stats.steps == 16
    for key, value in whole.state_dict().items():
        assert torch.allclose(accumulated.state_dict()[key], value, rtol=1e-4, atol=1e-6), key


def test_label_smoothing_and_clipping_are_torchs_own(
    digits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = digits
    reference, trained, unclipped = digits_cnn(), digits_cnn(), digits_cnn()
    reference_loop(
        reference, x, y, epochs=2, batch_size=32, lr_at=lambda t: LR, label_smoothing=0.1, clip=0.5
    )
    recipe = Recipe(label_smoothing=0.1, clip_grad_norm=0.5)
    train_model(trained, x, y, TrainSettings(**SETTINGS), recipe=recipe)
    assert_same_state(reference, trained)
    # The gradients were above 0.5: clipping changed the run (the test can fail).
    train_model(unclipped, x, y, TrainSettings(**SETTINGS), recipe=Recipe(label_smoothing=0.1))
    assert not torch.equal(
        unclipped.state_dict()["head.weight"], trained.state_dict()["head.weight"]
    )


def test_keep_best_returns_the_best_epochs_weights(
    digits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = digits
    every, best = digits_cnn(), digits_cnn()
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    settings = SETTINGS | {"epochs": 4, "lr": 0.5}  # lr high enough for a worse later epoch

    def snapshot(log: Any) -> None:
        snapshots[log.epoch] = {k: v.clone() for k, v in every.state_dict().items()}

    last = train_model(every, x, y, TrainSettings(**settings), hooks=TrainHooks(on_epoch=snapshot))
    stats = train_model(best, x, y, TrainSettings(**settings), recipe=Recipe(keep_best=True))
    losses = [log.val_loss for log in last.epochs]
    assert stats.epochs == last.epochs
    assert stats.best_epoch == 1 + losses.index(min(losses))  # type: ignore[type-var]
    for key, value in snapshots[stats.best_epoch].items():
        assert torch.equal(best.state_dict()[key], value), key
    assert stats.batches == 8 * stats.best_epoch == nbt(best)[0]


def test_bf16_autocast_runs_on_the_cpu_and_fp16_is_refused(
    digits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = digits
    fp32, bf16 = digits_cnn(), digits_cnn()
    train_model(fp32, x, y, TrainSettings(**SETTINGS))
    stats = train_model(bf16, x, y, TrainSettings(**SETTINGS), recipe=Recipe(precision="bf16"))
    assert all(math.isfinite(log.train_loss) for log in stats.epochs)
    assert not torch.equal(fp32.state_dict()["head.weight"], bf16.state_dict()["head.weight"])
    assert bf16.state_dict()["head.weight"].dtype == torch.float32  # autocast: weights stay
    with pytest.raises(TrainError, match="fp16 runs on CUDA only"):
        train_model(digits_cnn(), x, y, TrainSettings(**SETTINGS), recipe=Recipe(precision="fp16"))


class Saved:
    """Each checkpoint written to a file as it is handed over, as a worker writes it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.paths: list[Path] = []
        self.steps: list[int] = []

    def __call__(self, state: TrainState) -> None:
        path = self.folder / f"{len(self.paths)}.safetensors"
        path.write_bytes(state_bytes(state))
        self.paths.append(path)
        self.steps.append(state.step)


RESUMED_RECIPES = {
    "sgd": ({}, Recipe()),
    "adamw-everything": (
        {"optimizer": "adamw", "lr": 0.01},
        Recipe(
            lr_schedule="cosine",
            warmup_steps=2,
            accumulate_steps=2,
            label_smoothing=0.1,
            clip_grad_norm=1.0,
            keep_best=True,
        ),
    ),
    "bf16": ({}, Recipe(precision="bf16")),
    "augmented-in-loader-processes": (
        {},
        Recipe(
            augmentation=Augmentation(random_resized_crop=True, horizontal_flip=True),
            loader_workers=2,
        ),
    ),
}


@pytest.mark.parametrize("name", list(RESUMED_RECIPES))
def test_resuming_from_any_checkpoint_is_bitwise_the_uninterrupted_run(
    digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path, name: str
) -> None:
    x, y = digits
    overrides, recipe = RESUMED_RECIPES[name]
    settings = SETTINGS | {"epochs": 3} | overrides
    saved = Saved(tmp_path)
    whole = digits_cnn()
    stats = train_model(
        whole, x, y, TrainSettings(**settings), recipe=recipe, checkpointing=Checkpointing(saved, 3)
    )
    # Every 3 steps, and once at the end.
    assert saved.steps == [*range(3, stats.steps + 1, 3), stats.steps]
    for path in saved.paths[:-1]:
        state = load_state(path)
        resumed = digits_cnn()
        resumed_stats = train_model(
            resumed,
            x,
            y,
            TrainSettings(**settings),
            recipe=recipe,
            checkpointing=Checkpointing(lambda s: None, resume=load_state(path)),
        )
        assert_same_state(whole, resumed)
        assert resumed_stats.epochs == stats.epochs
        assert (resumed_stats.steps, resumed_stats.batches, resumed_stats.samples) == (
            stats.steps,
            stats.batches,
            stats.samples,
        )
        assert resumed_stats.best_epoch == stats.best_epoch
        assert resumed_stats.resumed_from_step == state.step


def test_more_epochs_from_the_final_checkpoint(
    digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    """A constant schedule: 2 epochs, then 2 more from the final checkpoint, is bitwise the
    4-epoch run (resume_from)."""
    x, y = digits
    saved = Saved(tmp_path)
    first = digits_cnn()
    train_model(first, x, y, TrainSettings(**SETTINGS), checkpointing=Checkpointing(saved))
    [path] = saved.paths
    final = load_state(path)
    assert (final.epoch, final.batch, final.step) == (3, 0, 16)
    continued, whole = digits_cnn(), digits_cnn()
    resume = Checkpointing(lambda s: None, resume=load_state(path))
    stats = train_model(
        continued, x, y, TrainSettings(**(SETTINGS | {"epochs": 4})), checkpointing=resume
    )
    whole_stats = train_model(whole, x, y, TrainSettings(**(SETTINGS | {"epochs": 4})))
    assert_same_state(whole, continued)
    assert stats.epochs == whole_stats.epochs
    # An attempt lost after its final checkpoint: the next one ends where it ended.
    again = digits_cnn()
    again_stats = train_model(again, x, y, TrainSettings(**SETTINGS), checkpointing=resume)
    assert_same_state(first, again)
    assert again_stats.steps == 16 and len(again_stats.epochs) == 2
    with pytest.raises(TrainError, match="nothing is left to train; ask for more epochs"):
        train_model(
            digits_cnn(), x, y, TrainSettings(**(SETTINGS | {"epochs": 1})), checkpointing=resume
        )


def test_a_checkpoint_is_safetensors_and_json_only(
    digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    x, y = digits
    saved: list[TrainState] = []
    train_model(
        digits_cnn(),
        x,
        y,
        TrainSettings(**(SETTINGS | {"optimizer": "adamw"})),
        checkpointing=Checkpointing(saved.append, 5),
    )
    path = tmp_path / "c.safetensors"
    path.write_bytes(state_bytes(saved[0]))
    with safetensors.safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        meta = f.metadata()
    assert {"rng.cpu", "rng.order", "epoch_loss_sum"} <= names
    assert any(n.startswith("optimizer.0.exp_avg") for n in names)
    assert any(n.startswith("model.") for n in names)
    assert set(meta) == {"bnadapt.train_state"}
    # Not a train job's checkpoint: a weights file.
    other = tmp_path / "weights.safetensors"
    other.write_bytes(safetensors.torch.save({"w": torch.zeros(2)}))
    with pytest.raises(TrainError, match="not a checkpoint a train job wrote"):
        load_state(other)


def test_the_epoch_order_is_one_function_of_the_generator() -> None:
    generator = torch.Generator().manual_seed(3)
    train, _ = split_indices(50, 0.2, generator)
    state = generator.get_state()
    first = epoch_order(train, generator)
    generator.set_state(state)
    assert torch.equal(epoch_order(train, generator), first)
    assert sorted(first.tolist()) == sorted(train.tolist())


AUGMENTED = Augmentation(random_resized_crop=True, horizontal_flip=True, crop_scale=[0.3, 1.0])


def test_loader_processes_give_the_same_training_bitwise(
    digits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = digits
    own, loaded, plain = digits_cnn(), digits_cnn(), digits_cnn()
    own_stats = train_model(
        own, x, y, TrainSettings(**SETTINGS), recipe=Recipe(augmentation=AUGMENTED)
    )
    loaded_stats = train_model(
        loaded,
        x,
        y,
        TrainSettings(**SETTINGS),
        recipe=Recipe(augmentation=AUGMENTED, loader_workers=2),
    )
    assert_same_state(own, loaded)
    assert own_stats == loaded_stats
    # The augmentation changed the run (the comparison above could fail).
    train_model(plain, x, y, TrainSettings(**SETTINGS))
    assert not torch.equal(plain.state_dict()["head.weight"], own.state_dict()["head.weight"])


def test_augmentation_draws_are_the_batches_own() -> None:
    torch.manual_seed(0)
    batch = torch.rand(16, 3, 12, 10)  # (B, C, H, W)
    first = augment(batch, AUGMENTED, batch_generator(1, 2, 3))
    assert first.shape == batch.shape
    assert torch.equal(first, augment(batch, AUGMENTED, batch_generator(1, 2, 3)))
    assert not torch.equal(first, augment(batch, AUGMENTED, batch_generator(1, 2, 4)))
    # Flips alone: each sample as it is or mirrored, about half of them mirrored.
    flips = Augmentation(horizontal_flip=True)
    flipped = augment(batch, flips, batch_generator(0, 1, 0))
    mirrored = [bool(torch.equal(f, b.flip(-1))) for f, b in zip(flipped, batch, strict=True)]
    same = [bool(torch.equal(f, b)) for f, b in zip(flipped, batch, strict=True)]
    assert all(m != s for m, s in zip(mirrored, same, strict=True))
    assert 0 < sum(mirrored) < 16
    # A crop of the whole sample at ratio 1 is the sample (bilinear resize to its own size).
    whole = Augmentation(random_resized_crop=True, crop_scale=[1.0, 1.0], crop_ratio=[1.0, 1.0])
    square = torch.rand(4, 3, 8, 8)
    assert torch.equal(augment(square, whole, batch_generator(0, 1, 0)), square)
