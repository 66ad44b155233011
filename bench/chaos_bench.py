"""Chaos at scale: how do jobs end when their process, their machine or Redis goes away?

The whole service (Redis-compatible server, API, one worker with one torch thread) runs
``--rounds`` train jobs one after another; each gets one real fault while it trains
(tests/e2e/chaos.py: ``job-kill``, ``machine-lost``, ``redis-outage`` of 3 s), and must end
succeeded with exactly one model. Reported per fault: rounds, outcomes, attempts used, and
the seconds from the fault to the terminal status (median, max). The heartbeat timeout is
the test stack's 4 s, so ``machine-lost`` shows the sweep's bound plus the retry's backoff
and rerun; as the rounds' jobs are the same, the seconds compare the faults with each other.

    .venv/bin/python bench/chaos_bench.py [--rounds 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.chaos import FAULTS, run_chaos
from tests.stack import running_stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_stack(Path(tmp), {"BNADAPT_WORKER_THREADS": "1"}) as stack,
    ):
        tally = run_chaos(stack, args.rounds, seed=args.seed)
    print(f"{args.rounds} rounds, seed {args.seed}")
    print("| fault | rounds | ended | s to end, median | s to end, max |")
    print("|---|---|---|---|---|")
    for fault in FAULTS:
        times = tally.seconds_to_end.get(fault, [])
        ended = ", ".join(
            f"{n} {outcome.split(': ')[1]}"
            for outcome, n in sorted(tally.outcomes.items())
            if outcome.startswith(f"{fault}:")
        )
        median = f"{statistics.median(times):.1f}" if times else "-"
        worst = f"{max(times):.1f}" if times else "-"
        print(f"| {fault} | {tally.rounds[fault]} | {ended} | {median} | {worst} |")
    print("attempts used:", dict(sorted(tally.attempts.items())))
    print("problems:", tally.problems or "none")


if __name__ == "__main__":
    main()
