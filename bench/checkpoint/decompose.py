"""Where the checkpoint wrapper's fixed cost per call goes, on the launch-bound train step.

The step is bench/checkpoint/wrapper.py's ``launch`` measurement: the train step of its small
ResNet, every block behind both checkpoints (``Switched``), on 2 images of 8x8, where every
operator is so small that the step is bound by the per-call cost of Python and dispatch, as an
eager CUDA step of a small model is bound by the CPU that launches its kernels. Three variants of
bnadapt's per-call bookkeeping run against torch's checkpoint, each in the same paired way:

- ``full``: bnadapt.checkpoint as it is.
- ``reads only``: the records and the recomputation's entry replaced by bare reads of the same
  modules (the tree walk, and each module's flag, ``_parameters`` and ``_buffers``), nothing
  recorded, compared or swapped: what reading every module once in each pass costs, the floor
  of any wrapper that keeps the guarantee by looking at the modules (NOTE [ The cost of a
  call ] in bnadapt/checkpoint.py). Not exact, of course: timing only.
- ``no bookkeeping``: records and recomputation context do nothing: the wrapper module, its
  checkpoint call and its contexts only.

The variants take turns in rounds, so that the machine's state of the moment falls on all of
them. Run from the repository root: ``python -m bench.checkpoint.decompose`` prints a markdown
table (``--pairs N`` per variant and round, ``--rounds R``, ``--threads T``).

``--against FILE`` instead times this checkout's bnadapt/checkpoint.py against another copy of
it (say ``git show REV:bnadapt/checkpoint.py > /tmp/old.py``) on the same step, every block
behind both wrappers: the before-and-after of a change, in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from bench.checkpoint._resnet import ResNet
from bench.checkpoint.wrapper import (
    LAUNCH_BATCH,
    LAUNCH_IMAGE_SIZE,
    SEED,
    PairedTiming,
    make_batch,
    switched_steps,
    time_paired,
)
from bnadapt import checkpoint as ours


def _read_tree(root: nn.Module) -> None:
    """Each module of ``root``'s tree read as the records read it, nothing kept."""
    seen: set[nn.Module | None] = {None, root}
    found = [root]
    for module in found:
        children = module._modules
        if children:
            for child in children.values():
                if child not in seen:
                    seen.add(child)
                    found.append(child)  # type: ignore[arg-type]
        _ = (module._parameters, module.training, module._buffers)


def _reads_only_capture(state: Any, root: nn.Module) -> None:
    _read_tree(root)


def _reads_only_enter(state: Any) -> None:
    _read_tree(state._root)


def _nothing(*_args: Any) -> None:
    return None


VARIANTS: dict[str, dict[str, Callable[..., None]]] = {
    "full": {},
    "reads only": {
        "capture": _reads_only_capture,
        "__enter__": _reads_only_enter,
        "__exit__": _nothing,
    },
    "no bookkeeping": {"capture": _nothing, "__enter__": _nothing, "__exit__": _nothing},
}


@contextlib.contextmanager
def bookkeeping(variant: str) -> Iterator[None]:
    """bnadapt's per-call state with the methods of ``variant`` in place, for the duration."""
    cls = ours._CallState
    replaced = VARIANTS[variant]
    saved = {name: cls.__dict__[name] for name in replaced}
    for name, method in replaced.items():
        setattr(cls, name, method)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(cls, name, method)


def against(path: str, pairs: int, rounds: int) -> None:
    """This checkout's wrapper against the one in ``path``, launch-bound step, paired."""
    spec = importlib.util.spec_from_file_location("other_checkpoint", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--against {path}: not a Python file")
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    device = torch.device("cpu")
    x, y = make_batch(LAUNCH_BATCH, device, LAUNCH_IMAGE_SIZE)
    steps = switched_steps(ResNet(), x, y, theirs=other.checkpoint_wrapper)
    blocks = len(ResNet().blocks)
    print(f"| round | this checkout / {path} (quartiles) | 95 % interval | per block call |")
    print("|---|---|---|---|")
    for round_ in range(rounds):
        timing = time_paired(steps["bnadapt"], steps["torch"], pairs, 20, device)
        low, median, high = timing.ratio_quartiles()
        interval = timing.median_interval()
        differences = [m - b for m, b in zip(timing.measured_s, timing.baseline_s, strict=True)]
        per_call = statistics.median(differences) / blocks * 1e6
        print(
            f"| {round_ + 1} | **{median:.4f}** ({low:.3f}-{high:.3f}) "
            f"| {interval[0]:.4f}-{interval[1]:.4f} | {per_call:+.1f} us |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=400, help="pairs per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--against", metavar="FILE", help="another bnadapt/checkpoint.py")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    if args.against:
        against(args.against, args.pairs, args.rounds)
        return
    device = torch.device("cpu")
    x, y = make_batch(LAUNCH_BATCH, device, LAUNCH_IMAGE_SIZE)
    model = ResNet()
    blocks = len(model.blocks)
    steps = switched_steps(model, x, y)
    timings: dict[str, list[PairedTiming]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            with bookkeeping(variant):
                timings[variant].append(
                    time_paired(steps["bnadapt"], steps["torch"], args.pairs, 20, device)
                )
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); launch-bound train step "
        f"({LAUNCH_BATCH} images of {LAUNCH_IMAGE_SIZE}x{LAUNCH_IMAGE_SIZE}, {blocks} "
        f"checkpointed blocks); {args.rounds} rounds of {args.pairs} pairs per variant\n"
    )
    print("| bookkeeping | ratio to torch's checkpoint (quartiles) | per block call |")
    print("|---|---|---|")
    for variant, runs in timings.items():
        ratios = [m / b for t in runs for m, b in zip(t.measured_s, t.baseline_s, strict=True)]
        differences = [m - b for t in runs for m, b in zip(t.measured_s, t.baseline_s, strict=True)]
        low, median, high = statistics.quantiles(ratios, n=4, method="inclusive")
        per_call = statistics.median(differences) / blocks * 1e6
        print(f"| {variant} | **{median:.3f}** ({low:.3f}-{high:.3f}) | {per_call:.1f} us |")


if __name__ == "__main__":
    main()
