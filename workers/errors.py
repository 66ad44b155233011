"""Errors the worker functions raise when a job cannot be done as asked.

Each message says what was wrong, the values involved and what to do; the job runner records
it as the job's error. Internal invariants use ``assert``, and arguments that the API schemas
already rule out (a batch size of 0) raise ``ValueError``.

Tree::

    WorkerError
    ├── ArchitectureError   unknown architecture, bad kwargs
    ├── PolicyError         a checkpoint policy that names nothing or no known type
    ├── DataError           data that does not fit the model or the loss
    ├── AdaptError          a BatchNorm adaptation that cannot run (no layers, no data)
    ├── TrainError          training that cannot run or diverged
    ├── JobCanceled         should_stop() answered True; not a failure
    └── JobInterrupted      a part of the job was killed from outside (a rank of a train job
                            in several processes): retried, as a killed job process is
"""

from __future__ import annotations

__all__ = [
    "AdaptError",
    "ArchitectureError",
    "DataError",
    "JobCanceled",
    "JobInterrupted",
    "PolicyError",
    "TrainError",
    "WorkerError",
]


class WorkerError(Exception):
    """Root of the errors raised by the worker functions."""


class ArchitectureError(WorkerError):
    """An architecture name or its kwargs are not valid."""


class PolicyError(WorkerError):
    """A checkpoint policy cannot be applied to the model."""


class DataError(WorkerError):
    """A data set does not fit the model or the loss."""


class AdaptError(WorkerError):
    """A BatchNorm adaptation cannot run."""


class TrainError(WorkerError):
    """Training cannot run, or stopped because the loss diverged."""


class JobCanceled(WorkerError):  # noqa: N818 - a request honoured, not an error condition
    """The job was asked to stop; raised between batches or steps, so state is consistent
    per batch but the job's result must be discarded."""


class JobInterrupted(WorkerError):  # noqa: N818 - an interruption, not the job's own failure
    """A process the job ran on was killed from outside (a rank of a train job run in
    several processes: workers/training/ranks.py); the attempt ends as an interruption, retried
    (NOTE [ Job attempts ] in service/records/job_life/retries.py)."""
