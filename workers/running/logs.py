"""A job's own log: what its process logs while it runs, kept with the job in Redis.

NOTE [ Job logs ]
While a job runs, a handler on the root logger of its (forked) process appends every record
at INFO or above from bnadapt's own loggers, and every WARNING or above from anywhere (Python
warnings included, through ``logging.captureWarnings``), to the job's log list
(``keys.job_logs``, the latest ``JOB_LOG_MAX_ENTRIES`` kept, each with a sequence number). A
failure's traceback is logged there by ``run_job``. Writes are best effort: a log line that
cannot reach Redis is dropped, never the job. The API serves the list, tenant-scoped, at
GET /v1/jobs/{id}/logs and follows it in GET /v1/jobs/{id}/events?logs=true. The parts of a
sharded adapt job (its shards, merge, evaluations and finish, each a process of its own,
perhaps on other machines) log to their parent job's list, each entry labelled with its
``part`` (``shard-0``, ``merge``...), so the job's log holds them all.

NOTE [ What a job's log shows its tenant ]
The tenant reads the job's log, so each entry holds what service/public_text.py allows and
nothing else: the record's message with hostnames, paths, URLs and addresses taken out
(``scrub_internals``), and, for a record that carries an exception, the exception's type and
the text a failed job's record would show (``error_message``: the store's, Redis' and the
system's own errors said in words) in place of the traceback, whose frames name the
service's files. A traceback logged as text is cut where it starts. The same record reaches
the worker's own handlers unchanged: the operator's log keeps the hostname, the paths and the
whole traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Final

from service.log_format import job_context
from service.public_text import scrub_internals
from service.records.sync import Records
from workers.running.saving import error_message

__all__ = ["job_logging", "public_message"]

MAX_MESSAGE_CHARS: Final = 16_000
_OWN_LOGGERS: Final = ("workers", "service", "api_schemas")
# Where Python's traceback text starts, when a message quotes one.
_TRACEBACK: Final = "Traceback (most recent call last)"


def public_message(record: logging.LogRecord) -> str:
    """``record`` as the job's tenant may read it (NOTE [ What a job's log shows its tenant ])."""
    message = record.getMessage().split(_TRACEBACK, 1)[0].rstrip()
    message = scrub_internals(message)
    if record.exc_info is not None and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        text = error_message(exc)
        if text not in message:  # a failure logged with its own text already says it
            said = f"{type(exc).__name__}: {text}"
            message = f"{message}: {said}" if message else said
    return message[:MAX_MESSAGE_CHARS]


class _JobLogHandler(logging.Handler):
    def __init__(self, records: Records, job_id: str, part: str | None) -> None:
        super().__init__(logging.INFO)
        self._records = records
        self._job_id = job_id
        self._part = part

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name.split(".", 1)[0] in _OWN_LOGGERS
        return record.levelno >= (logging.INFO if own else logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = public_message(record)  # never self.format: it adds the traceback
            at = datetime.fromtimestamp(record.created, UTC).isoformat()
            self._records.append_job_logs(
                self._job_id, [(at, record.levelname, record.name, message)], self._part
            )
        except Exception:  # noqa: BLE001 - a lost log line must never fail the job
            return


@contextmanager
def job_logging(records: Records, job_id: str, part: str | None = None) -> Iterator[None]:
    """Keeps what this process logs, while the block runs, in job ``job_id``'s log; ``part``
    labels the entries of one part of a sharded job."""
    root = logging.getLogger()
    handler = _JobLogHandler(records, job_id, part)
    previous_level = root.level
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    root.addHandler(handler)
    logging.captureWarnings(True)
    try:
        with job_context(job_id):  # JSON logs name the job (NOTE [ JSON logs ])
            yield
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        root.setLevel(previous_level)
