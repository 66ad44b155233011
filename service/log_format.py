"""How the service's processes write their logs: text (the default) or one JSON object per
line (``BNADAPT_LOG_FORMAT=json``), for log collectors.

NOTE [ JSON logs ]
With ``BNADAPT_LOG_FORMAT=json`` every process of the service (the API under uvicorn,
``bnadapt worker``'s supervisor, its RQ worker and inspector, and each job's process, forked
from the RQ worker) writes each log record to stderr as one line holding one JSON object:
``timestamp`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``process`` (``api``,
``supervisor``, ``worker``, ``inspector``), ``job_id`` where one is known (in a job's process,
from ``job_context``; elsewhere where a record names one through ``extra={"job_id": ...}``)
and ``exception`` (the traceback) when there is one. uvicorn's and RQ's loggers go through the
same handler. In text mode, the lines stay as they were.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Final, Literal

__all__ = ["JsonFormatter", "LogFormat", "configure_logging", "job_context"]

LogFormat = Literal["text", "json"]

_JOB_ID: ContextVar[str | None] = ContextVar("bnadapt_job_id", default=None)
# Loggers that libraries give handlers of their own: theirs are replaced, so that their
# records reach the root's handler (and its format) instead.
_LIBRARY_LOGGERS: Final = ("uvicorn", "uvicorn.error", "uvicorn.access", "rq.worker", "rq.job")


@contextmanager
def job_context(job_id: str) -> Iterator[None]:
    """Records logged in this block name ``job_id`` (JSON logs' ``job_id``)."""
    token = _JOB_ID.set(job_id)
    try:
        yield
    finally:
        _JOB_ID.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (NOTE [ JSON logs ])."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": self._process,
        }
        job_id = getattr(record, "job_id", None) or _JOB_ID.get()
        if job_id is not None:
            entry["job_id"] = str(job_id)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            entry["exception"] = self.formatStack(record.stack_info)
        # default=str: a message argument that JSON cannot hold is written as its text.
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(process: str, log_format: LogFormat, level: int = logging.INFO) -> None:
    """Logging of one process of the service: ``process`` names it (``api``, ``worker``, ...).
    Text: ``<time> <process> <message>`` lines, as ``logging.basicConfig`` writes them; JSON:
    NOTE [ JSON logs ]. Replaces the root's handlers (and uvicorn's and RQ's own)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process))
        for name in _LIBRARY_LOGGERS:
            library = logging.getLogger(name)
            for old in list(library.handlers):
                library.removeHandler(old)
            library.propagate = True
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
