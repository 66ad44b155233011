"""What a tenant may read of the service's internals: nothing (issue 27, point 9).

A job's error, a report, an API error and readiness reach tenants; hostnames, file paths,
bucket names, endpoints and the raw text of library exceptions stay in the server's log.
:func:`scrub_internals` takes them out of a message written for a tenant that quotes another
message (an exception's text); :func:`opaque_name` names a machine or process without its
hostname, the same name every time for the same input, so that an operator can still match
a report's ``worker`` to a log line (which names both).
"""

from __future__ import annotations

import hashlib
import re
import socket
from typing import Final

__all__ = ["opaque_name", "scrub_internals", "worker_label"]

# s3://bucket/key, http://host:port/path, redis://...: scheme and all.
_URL: Final = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"()<>]*[^\s'\"()<>:.,;]")
# An absolute path: a slash that starts a word (not `a/b`, not `1/8`) and what follows it.
_PATH: Final = re.compile(r"(?<![\w./~-])(?:~)?/[\w.@%+=,-]+(?:/[\w.@%+=,:-]*)*")
# IPv4 addresses, localhost and bracketed IPv6, with a port if any.
_HOST: Final = re.compile(
    r"\b(?:\d{1,3}(?:\.\d{1,3}){3}|localhost)(?::\d{1,5})?\b|\[[0-9a-fA-F:]+\](?::\d{1,5})?"
)


def opaque_name(name: str) -> str:
    """A short stable name for ``name`` (a hostname, an RQ worker name) that does not show it."""
    return "w-" + hashlib.sha256(name.encode()).hexdigest()[:10]


def worker_label(pid: int) -> str:
    """This machine's process ``pid`` as jobs and reports show it: ``w-<hash of host>:<pid>``."""
    return f"{opaque_name(socket.gethostname())}:{pid}"


def scrub_internals(text: str) -> str:
    """``text`` with URLs, absolute paths, addresses and this machine's hostname replaced by
    ``<url>``, ``<path>``, ``<host>``."""
    text = _URL.sub("<url>", text)
    text = _PATH.sub("<path>", text)
    text = _HOST.sub("<host>", text)
    hostname = socket.gethostname()
    if len(hostname) >= 3:
        text = text.replace(hostname, "<host>")
    elif hostname:  # a short name (`vm`) only where it stands alone, not inside other words
        text = re.sub(rf"(?<![\w-]){re.escape(hostname)}(?![\w-])", "<host>", text)
    return text
