"""What a job's own failure says: the error a failed job's record shows, with the failures a
user can act on (out of memory, a timeout) said in words, not in an allocator's.

NOTE [ Retry policy ] in service/records/job_life/retries.py: an exception in a job is the job's own
failure, never retried. Running out of memory is one too, however it shows: an exception
(``MemoryError``, ``torch.OutOfMemoryError``, CPU allocation failures that torch raises as
``RuntimeError``) here, or the kernel's out-of-memory killer, which the RQ worker tells apart
from other deaths (workers/running/capacity.py). So is running past the job's timeout: RQ
raises ``JobTimeoutException`` in the job's process, or kills it a minute later if it does not
stop.
"""

from __future__ import annotations

from typing import Final

import torch
from rq.timeouts import JobTimeoutException

from workers.running.saving import error_message

__all__ = ["failure_message", "is_out_of_memory", "out_of_memory_message", "timeout_message"]

# What torch's and the C library's allocators say when an allocation fails.
_ALLOCATION_FAILED: Final = (
    "can't allocate memory",
    "not enough memory",
    "out of memory",
    "cannot allocate memory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(phrase in text for phrase in _ALLOCATION_FAILED)


def out_of_memory_message(detail: str) -> str:
    return (
        f"the job ran out of memory ({detail}); it is not retried, since another run would "
        "run out the same way: use a smaller batch_size, or a smaller resize or center_crop "
        "for image data, or run it on workers with more memory"
    )


def timeout_message(timeout_s: int | None) -> str:
    limit = f"{timeout_s} s" if timeout_s is not None else "the service's default"
    return (
        f"the job timed out: it ran past its timeout of {limit} and was stopped; it is not "
        "retried. Ask for a longer timeout_s (up to the service's cap, "
        "BNADAPT_JOB_TIMEOUT_MAX_S), or a shorter job (fewer epochs, steps or batches)"
    )


def failure_message(exc: BaseException, timeout_s: int | None) -> str:
    """The error a job that raised ``exc`` is failed with."""
    if isinstance(exc, JobTimeoutException):
        return timeout_message(timeout_s)
    if is_out_of_memory(exc):
        detail = str(exc).strip() or type(exc).__name__
        return out_of_memory_message(detail[:300])
    return error_message(exc)
