"""Chaos, small N: rounds of real faults (harness/chaos.py) against one stack; every job
ends succeeded with exactly one model. ``CHAOS_ROUNDS`` sets N (3 by default: each fault once);
bench/service/chaos.py runs many more and reports timings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.chaos import run_chaos
from harness.chaos_load import KILL_KINDS, run_load_chaos
from harness.stack import running_stack

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def test_every_job_survives_its_fault(tmp_path: Path) -> None:
    rounds = int(os.environ.get("CHAOS_ROUNDS", "3"))
    with running_stack(tmp_path, {"BNADAPT_WORKER_THREADS": "1"}) as stack:
        tally = run_chaos(stack, rounds)
    assert tally.problems == []
    assert sum(tally.rounds.values()) == rounds


def test_jobs_streamed_in_survive_kills_of_every_process_kind(tmp_path: Path) -> None:
    """harness/chaos_load.py at small N: each kill kind once (``CHAOS_JOBS``, 24 by
    default, and ``CHAOS_KILLS``) and one Redis kill while jobs stream in with
    Idempotency-Keys; bench/service/chaos.py --jobs runs the full size."""
    jobs = int(os.environ.get("CHAOS_JOBS", "24"))
    kills = int(os.environ.get("CHAOS_KILLS", str(len(KILL_KINDS))))
    with running_stack(tmp_path, {"BNADAPT_WORKER_THREADS": "1"}, workers=2) as stack:
        tally = run_load_chaos(stack, jobs, kills, redis_kills=1)
    assert tally.lost == tally.duplicated == tally.stuck == []
    assert tally.model_problems == tally.problems == []
    assert tally.outcomes == {"succeeded": jobs}
    assert sum(tally.kills.values()) == kills + 1
