"""Cost of the ``precise`` and ``cumulative`` estimators against a bare forward pass.

The model: the service's ``resnet`` architecture (``width`` 32, ``depth`` 4, 10 classes); the
data: ``--batches`` batches of ``--batch`` RGB images of 32x32, the last one short. One
measurement is a whole pass over the data:

- ``bare``: ``model.train()`` and ``model(x)`` under ``torch.no_grad()`` per batch, the plain
  loop a user writes (BatchNorm in train mode updates its running statistics);
- ``precise``: ``precise_batchnorm`` over all BatchNorm layers (collect, then apply);
- ``cumulative``: ``adapt_batchnorm(estimator="cumulative")`` over the same layers.

The three run alternately in one process, in a rotating order, after a warm-up pass each; the
result per estimator is the median over repetitions of its time divided by the bare pass of
the same repetition. Target <= 1.05.

Run from the repository root: ``python -m bench.adaptation.estimators`` prints a markdown table;
``--quick`` is a smoke run whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from bench.recording import Measured, add_record_options, met, spread, threads_text, write_figures
from workers.estimators.base import select_batchnorm
from workers.estimators.moving_averages import adapt_batchnorm
from workers.estimators.precise import precise_batchnorm
from workers.models.architectures import build_model

TARGET = 1.05
SEED = 0


def bare_pass(model: nn.Module, data: list[torch.Tensor]) -> None:
    model.train()
    with torch.no_grad():
        for x in data:  # (B, 3, 32, 32)
            model(x)
    model.eval()


def timed(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    add_record_options(parser)
    args = parser.parse_args()
    if args.quick:
        args.batches, args.batch, args.repeats = 3, 8, 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(SEED)
    model = build_model("resnet", {"width": 32, "depth": 4}).to(device).eval()
    layers = select_batchnorm(model, ["*"], [])
    gen = torch.Generator().manual_seed(SEED)
    sizes = [args.batch] * (args.batches - 1) + [args.batch // 2 + 1]  # the last one short
    data = [(torch.rand(n, 3, 32, 32, generator=gen) * 2 + 0.3).to(device) for n in sizes]

    def precise() -> None:
        precise_batchnorm(model, data, layers=layers)

    def cumulative() -> None:
        adapt_batchnorm(model, data, estimator="cumulative", layers=layers, reset=True)

    runs: dict[str, Callable[[], None]] = {
        "bare": lambda: bare_pass(model, data),
        "precise": precise,
        "cumulative": cumulative,
    }
    names = list(runs)
    for name in names:  # warm-up
        timed(runs[name], device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            times[name].append(timed(runs[name], device))

    bare = times["bare"]
    print(
        f"resnet width 32 depth 4, {args.batches} batches of {args.batch} x 3x32x32 (last "
        f"{sizes[-1]}), device {device}, {args.threads} threads, torch {torch.__version__}, "
        f"{args.repeats} repetitions\n"
    )
    print("| pass | median s | median ratio to bare | min ratio | max ratio | target |")
    print("|---|---|---|---|---|---|")
    print(f"| bare no-grad train-mode forward | {statistics.median(bare):.3f} | 1 | | | |")
    medians: dict[str, float] = {}
    spreads: dict[str, str] = {}
    for name in ("precise", "cumulative"):
        ratios = [t / b for t, b in zip(times[name], bare, strict=True)]
        medians[name] = statistics.median(ratios)
        spreads[name] = spread(medians[name], min(ratios), max(ratios))
        print(
            f"| {name} | {statistics.median(times[name]):.3f} | "
            f"{statistics.median(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} | "
            f"<= {TARGET} |"
        )
    threads = threads_text(args.threads)
    figure = f"`precise` / `cumulative` pass / bare no-grad train-mode forward, {threads}"
    value = f"{spreads['precise']} / {spreads['cumulative']}"
    target = met(f"<= {TARGET}", max(medians.values()) <= TARGET)
    write_figures(
        "bench.adaptation.estimators", args, [Measured("estimator-passes", figure, value, target)]
    )


if __name__ == "__main__":
    main()
