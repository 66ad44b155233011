"""Chaos at scale: how do jobs end when their process, their machine or Redis goes away?

The whole service (Redis-compatible server, API, one worker with one torch thread) runs
``--rounds`` train jobs one after another; each gets one real fault while it trains
(harness/chaos.py: ``job-kill``, ``machine-lost``, ``redis-outage`` of 3 s), and must end
succeeded with exactly one model. Reported per fault: rounds, outcomes, attempts used, and
the seconds from the fault to the terminal status (median, max). The heartbeat timeout is
the test stack's 4 s, so ``machine-lost`` shows the sweep's bound plus the retry's backoff
and rerun; as the rounds' jobs are the same, the seconds compare the faults with each other.

    .venv/bin/python -m bench.service.chaos [--rounds 30] [--seed 0]

``--jobs N`` runs the load instead (harness/chaos_load.py): N jobs submitted with
Idempotency-Keys over two workers while ``--kills`` kills spread over every process kind
(job processes at random moments and in the fork window, RQ workers, supervisors, whole
worker trees, the API) and ``--redis-kills`` Redis kills happen; reported: kills by kind,
outcomes, lost / duplicated / stuck, retries, and the seconds from each kill to the end of
the attempt it interrupted and to the job's terminal status.

    .venv/bin/python -m bench.service.chaos --jobs 1000 --kills 54 --redis-kills 3 [--sharded]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import traceback
from pathlib import Path

from bench.recording import Measured, add_record_options, met, write_figures
from harness.chaos import FAULTS, run_chaos
from harness.chaos_load import KILL_KINDS, run_load_chaos
from harness.stack import running_stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=0, help="run the load instead")
    parser.add_argument("--kills", type=int, default=54)
    parser.add_argument("--redis-kills", type=int, default=3)
    parser.add_argument("--window", type=int, default=6)
    parser.add_argument("--sharded", action="store_true", help="sharded adapt jobs among them")
    add_record_options(parser)
    args = parser.parse_args()
    if args.jobs:
        load(args)
        return
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


def _spread(times: list[float]) -> str:
    if not times:
        return "- | - | -"
    return f"{len(times)} | {statistics.median(times):.1f} | {max(times):.1f}"


def load(args: argparse.Namespace) -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_stack(Path(tmp), {"BNADAPT_WORKER_THREADS": "1"}, workers=2) as stack,
    ):
        try:
            tally = run_load_chaos(
                stack,
                args.jobs,
                args.kills,
                args.redis_kills,
                seed=args.seed,
                window=args.window,
                sharded=args.sharded,
            )
        except BaseException:
            traceback.print_exc()
            raise
    print(f"{tally.jobs} jobs, seed {args.seed}, {tally.wall_s:.0f} s")
    print("kills:", {k: tally.kills[k] for k in (*KILL_KINDS, "redis")})
    print("outcomes:", dict(tally.outcomes))
    print(f"lost {len(tally.lost)}, duplicated {len(tally.duplicated)}, stuck {len(tally.stuck)}")
    print(f"models not exactly one: {len(tally.model_problems)}")
    print(
        f"interrupted jobs {tally.interrupted_jobs}, retries {tally.retries}, "
        f"answered keys re-sent {tally.resent_same_key}, "
        f"sharded jobs' children run again {tally.child_reruns}"
    )
    print(
        "| kill | attempts ended | s kill -> attempt end, median | max | "
        "jobs | s kill -> terminal, median | max |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in (*KILL_KINDS, "redis"):
        ends = tally.seconds_to_attempt_end.get(kind, [])
        terminal = tally.seconds_to_terminal.get(kind, [])
        print(f"| {kind} | {_spread(ends)} | {_spread(terminal)} |")
    print(
        "redis: s kill -> server answering again (each):",
        ", ".join(f"{s:.1f}" for s in tally.redis_outage_s) or "-",
        "| s server back -> attempt end, n | median | max:",
        _spread(tally.seconds_after_redis_back),
    )
    for name in ("lost", "duplicated", "stuck", "model_problems", "problems"):
        items = getattr(tally, name)
        if items:
            print(f"{name}:", *items[:50], sep="\n  ")
    kills = sum(tally.kills[kind] for kind in KILL_KINDS)
    figure = (
        f"chaos: {tally.jobs:,} jobs, {kills} kills of every process kind, "
        f"{tally.kills['redis']} Redis kills"
    )
    lost, duplicated, stuck = len(tally.lost), len(tally.duplicated), len(tally.stuck)
    value = (
        f"{tally.outcomes['succeeded']:,} of {tally.jobs:,} succeeded, {lost} lost, "
        f"{duplicated} duplicated, {stuck} stuck"
    )
    target = met("none lost, duplicated or stuck", lost + duplicated + stuck == 0)
    write_figures("bench.service.chaos", args, [Measured("chaos-full-size", figure, value, target)])


if __name__ == "__main__":
    main()
