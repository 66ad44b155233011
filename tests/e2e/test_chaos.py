"""Chaos, small N: rounds of real faults (tests/e2e/chaos.py) against one stack; every job ends
succeeded with exactly one model. ``CHAOS_ROUNDS`` sets N (3 by default: each fault once);
bench/chaos_bench.py runs many more and reports timings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.chaos import run_chaos
from tests.stack import running_stack

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def test_every_job_survives_its_fault(tmp_path: Path) -> None:
    rounds = int(os.environ.get("CHAOS_ROUNDS", "3"))
    with running_stack(tmp_path, {"BNADAPT_WORKER_THREADS": "1"}) as stack:
        tally = run_chaos(stack, rounds)
    assert tally.problems == []
    assert sum(tally.rounds.values()) == rounds
