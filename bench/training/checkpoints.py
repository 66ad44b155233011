"""What a training checkpoint costs a train job (NOTE [ Training checkpoints ] in
workers/training/train_state.py): its time against a training step's, its bytes against the
weights', and what writing one every ``--every`` steps does to the whole training.

Each row trains the resnet architecture (``--depth``, ``--width``) on random 3x32x32 images
with one optimizer, twice in this process through ``train_model``, the loop a worker runs:
once without checkpoints (the baseline), once writing one every ``--every`` optimizer steps
(and at the end) through the same path a worker takes, ``state_bytes`` into a LocalStore's
``put_bytes`` (an atomic write of a file named by its digest) in a temporary folder.

Figures, each against the baseline of the same row in the same run:
- step_ms: the baseline's mean optimizer step (wall time of the training over its steps);
- save_ms: the mean time to write one checkpoint (serialize + hash + atomic write);
- save/step: save_ms / step_ms, what one checkpoint costs in steps;
- bytes/weights: a checkpoint's bytes over the weights' safetensors bytes (sgd keeps a momentum
  buffer, adamw two moments: about 2x and 3x, plus the RNG states);
- wall: training time with checkpoints / without (above 1: the overhead of --every).

torch runs on ``--threads`` threads (default 1). ``--quick`` runs a tiny model on few images,
a smoke run whose figures mean nothing.

Run from the repository root: ``python -m bench.training.checkpoints`` prints a markdown
table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.recording import Measured, add_record_options, write_figures
from service.store.local import LocalStore
from workers.models.architectures import build_model
from workers.running.saving import weights_bytes
from workers.training.train_state import TrainState, state_bytes
from workers.training.training import Checkpointing, Optimizer, TrainSettings, train_model


@dataclass(frozen=True)
class Row:
    optimizer: str
    steps: int
    step_ms: float
    save_ms: float
    saves: int
    checkpoint_bytes: int
    weights_bytes: int
    wall: float


class TimedSaves:
    """Writes each checkpoint as a worker does, timing it."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self.seconds: list[float] = []
        self.sizes: list[int] = []

    def __call__(self, state: TrainState) -> None:
        started = time.perf_counter()
        data = state_bytes(state)
        self.store.put_bytes(data)
        self.seconds.append(time.perf_counter() - started)
        self.sizes.append(len(data))


def measure(
    optimizer: Optimizer, images: int, depth: int, width: int, epochs: int, every: int
) -> Row:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(images, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (images,), generator=generator)
    settings = TrainSettings(
        epochs=epochs,
        batch_size=64,
        optimizer=optimizer,
        lr=0.01,
        momentum=0.9,
        weight_decay=0.0,
        loss="cross_entropy",
        validation_fraction=0.0,
        seed=0,
        device="cpu",
    )

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model("resnet", {"depth": depth, "width": width})

    model = fresh()
    started = time.perf_counter()
    stats = train_model(model, x, y, settings)
    baseline_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="bnadapt-ckpt-bench-") as folder:
        saves = TimedSaves(LocalStore(Path(folder)))
        started = time.perf_counter()
        train_model(fresh(), x, y, settings, checkpointing=Checkpointing(saves, every_steps=every))
        with_saves_s = time.perf_counter() - started
    return Row(
        optimizer=optimizer,
        steps=stats.steps,
        step_ms=1000 * baseline_s / stats.steps,
        save_ms=1000 * sum(saves.seconds) / len(saves.seconds),
        saves=len(saves.seconds),
        checkpoint_bytes=max(saves.sizes),
        weights_bytes=len(weights_bytes(model.state_dict())),
        wall=with_saves_s / baseline_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=8, help="optimizer steps between saves")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run; figures mean nothing")
    add_record_options(parser)
    args = parser.parse_args()
    if args.quick:
        args.depth, args.width, args.images, args.epochs, args.every = 2, 8, 128, 1, 1
    torch.set_num_threads(args.threads)
    print(
        f"resnet depth {args.depth} width {args.width}, {args.images} images 3x32x32, "
        f"batch 64, {args.epochs} epochs, a checkpoint every {args.every} steps, "
        f"{args.threads} thread(s), torch {torch.__version__}\n"
    )
    print(
        "| optimizer | steps | step_ms | save_ms | saves | save/step | checkpoint MB "
        "| bytes/weights | wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    per_save: dict[str, float] = {}
    for optimizer in ("sgd", "adamw"):
        row = measure(optimizer, args.images, args.depth, args.width, args.epochs, args.every)
        per_save[optimizer] = row.save_ms / row.step_ms
        print(
            f"| {row.optimizer} | {row.steps} | {row.step_ms:.1f} | {row.save_ms:.1f} | "
            f"{row.saves} | {row.save_ms / row.step_ms:.2f} | "
            f"{row.checkpoint_bytes / 1e6:.2f} | "
            f"{row.checkpoint_bytes / row.weights_bytes:.2f} | {row.wall:.3f} |"
        )
    figure = f"training checkpoint save / step time, a save every {args.every} steps: sgd; adamw"
    value = f"{per_save['sgd']:.2f}; {per_save['adamw']:.2f}"
    write_figures(
        "bench.training.checkpoints", args, [Measured("train-checkpoint", figure, value, "none")]
    )


if __name__ == "__main__":
    main()
