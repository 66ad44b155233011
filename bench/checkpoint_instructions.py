"""Instructions per eager train step, bnadapt's checkpoint wrapper against torch's, counted by
valgrind's callgrind: a measure of the wrapper's own cost that a neighbour's load cannot move.

    python bench/checkpoint_instructions.py                  # 1 thread, batch 4, 3 rounds
    python bench/checkpoint_instructions.py --threads 2 --batch 32

Runs itself under ``valgrind --tool=callgrind`` (needs valgrind, its headers and a C compiler,
for a 3-line library that issues callgrind's client requests). In one process, after 2 warm-up
steps of each, it zeroes the counters before each train step and dumps them after, so each
step's count is exact and the import of torch counts nowhere; the variants alternate. The
wrapper's cost per call does not depend on the batch, so a small batch measures it as well and
runs far faster (callgrind runs ~50x slower than native); the ratio at the bench's batch needs
``--batch 32``. With 2 threads, run with ``OMP_WAIT_POLICY=PASSIVE`` (set here) so that
OpenMP's spinning at its barriers, which depends on scheduling, stays out of the counts.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONTROL_C = """#include <valgrind/callgrind.h>
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""
VARIANTS = ("torch", "bnadapt")


def steps_under_callgrind(args: argparse.Namespace, control: Path) -> None:
    """The child's part: train steps of each variant, each between a zero and a dump."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from _resnet import ResNet
    from checkpoint_bench import SEED, make_batch, make_variant, train_step

    torch.set_num_threads(args.threads)
    lib = ctypes.CDLL(str(control))
    torch.manual_seed(SEED)
    model = ResNet()
    x, y = make_batch(args.batch, torch.device("cpu"))
    steps = {v: train_step(make_variant(model, v), x, y) for v in VARIANTS}
    for step in steps.values():
        step()
        step()
    for round_ in range(args.rounds):
        for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
            lib.cg_zero()
            steps[variant]()
            lib.cg_dump(f"{variant}.{round_}".encode())


def counts(out_base: Path) -> dict[str, list[int]]:
    """Instructions of each dumped step, by variant, in round order."""
    found: dict[str, dict[int, int]] = {v: {} for v in VARIANTS}
    for path in out_base.parent.glob(out_base.name + ".*"):
        text = path.read_text()
        name = re.search(r"Client Request: (\w+)\.(\d+)", text)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if name and total:
            found[name.group(1)][int(name.group(2))] = int(total.group(1))
    return {v: [by_round[r] for r in sorted(by_round)] for v, by_round in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", type=Path, help="internal: the control library; run steps")
    args = parser.parse_args()
    if args.child is not None:
        steps_under_callgrind(args, args.child)
        return
    with tempfile.TemporaryDirectory(prefix="cg_") as work:
        source, control = Path(work) / "control.c", Path(work) / "control.so"
        source.write_text(CONTROL_C)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(control), str(source)], check=True)
        out = Path(work) / "callgrind.out"
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_WAIT_POLICY="PASSIVE")
        child = [__file__, "--threads", str(args.threads), "--batch", str(args.batch)]
        child += ["--rounds", str(args.rounds), "--child", str(control)]
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, *child],
            env=env,
            check=True,
            stderr=subprocess.DEVNULL,
        )
        found = counts(out)
    ours, theirs = found["bnadapt"], found["torch"]
    differences = [a - b for a, b in zip(ours, theirs, strict=True)]
    print(
        f"threads {args.threads}, batch {args.batch}, {len(differences)} rounds; instructions "
        f"per train step: bnadapt {statistics.median(ours):,.0f}, torch "
        f"{statistics.median(theirs):,.0f}; bnadapt - torch per round "
        f"{[f'{d:+,}' for d in differences]}, median {statistics.median(differences):+,.0f} "
        f"({statistics.median(ours) / statistics.median(theirs):.5f}x)"
    )


if __name__ == "__main__":
    main()
