"""Fault injection, for tests only: hooks that hold a worker's process still at the moment a
reliability test must kill it (tests/e2e/chaos/test_reliability.py).

Only tests set the ``BNADAPT_FAULT_*`` variables, in the environment of the stack they start;
unset, as in every deployment, each hook reads one variable and returns. Each value is
``<what>:<text>``: the fault applies only to an RQ job whose id holds ``<text>`` (empty: to
every job), so that a test can aim at one child of a sharded job.

- ``BNADAPT_FAULT_START_DELAY_S`` = ``<seconds>:<text>`` (:data:`FAULT_START_DELAY_ENV`): the
  job's process sleeps that long between RQ's fork and marking the job running, or a sharded
  job's child's between the fork and claiming itself. Read by :func:`delay_start`, called by
  ``run_job`` (workers/running/job.py) and ``run_child`` (workers/sharding/child.py).
- ``BNADAPT_FAULT_DEQUEUE_STOP`` = ``<moment>:<text>`` (:data:`FAULT_DEQUEUE_STOP_ENV`): the RQ
  worker stops itself (SIGSTOP) with the job it took from its queue, at ``taken`` (before it
  records that it holds it), ``held`` (after) or ``execution`` (once RQ recorded the
  execution, before the fork). Read by :func:`stop_at`, called by the RQ worker
  (workers/processes/rq_worker.py) at each of those moments (NOTE [ Dequeued and lost ] in
  service/upkeep/reaper.py).
- ``BNADAPT_FAULT_RANK_ALLOCATE`` = ``<bytes>:<text>`` (:data:`FAULT_RANK_ALLOCATE_ENV`): each
  rank of a train job in several processes allocates that many bytes before it loads the job
  and holds them while it trains, as a rank whose model or batch needs more than its share of
  the job's memory would (NOTE [ A job's memory among its processes ] in
  workers/training/ranks.py). ``<text>`` is matched against the job's id (a rank runs no RQ
  job). Read by :func:`rank_allocation`, called by ``run_rank``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Final, Literal

from rq import get_current_job

__all__ = [
    "FAULT_DEQUEUE_STOP_ENV",
    "FAULT_RANK_ALLOCATE_ENV",
    "FAULT_START_DELAY_ENV",
    "DequeueMoment",
    "delay_start",
    "rank_allocation",
    "stop_at",
]

FAULT_START_DELAY_ENV: Final = "BNADAPT_FAULT_START_DELAY_S"
FAULT_DEQUEUE_STOP_ENV: Final = "BNADAPT_FAULT_DEQUEUE_STOP"
FAULT_RANK_ALLOCATE_ENV: Final = "BNADAPT_FAULT_RANK_ALLOCATE"
DequeueMoment = Literal["taken", "held", "execution"]

log = logging.getLogger(__name__)


def delay_start() -> None:
    """In a job's (or a child's) process, right after RQ's fork: the fork window, widened."""
    delay, _, only = os.environ.get(FAULT_START_DELAY_ENV, "").partition(":")
    current = get_current_job()
    if delay and only in (current.id if current is not None else ""):
        time.sleep(float(delay))


def stop_at(moment: DequeueMoment, rq_id: str) -> None:
    """In the RQ worker, at ``moment`` of taking the RQ job ``rq_id`` from its queue."""
    fault, _, only = os.environ.get(FAULT_DEQUEUE_STOP_ENV, "").partition(":")
    if fault == moment and only in rq_id:
        log.warning("fault injection: stopping at %s with %s", moment, rq_id)
        os.kill(os.getpid(), signal.SIGSTOP)


def rank_allocation(job_id: str) -> bytearray | None:
    """In a rank of the job ``job_id``: the bytes the fault asks it to hold, allocated (an
    allocation past the rank's limit raises ``MemoryError`` here, as the job's own would)."""
    size, _, only = os.environ.get(FAULT_RANK_ALLOCATE_ENV, "").partition(":")
    if not size or only not in job_id:
        return None
    log.warning("fault injection: a rank of %s allocates %s bytes", job_id, size)
    return bytearray(int(size))
