"""What the tests read of a job's processes: the processes under one, and (service/sockets.py)
the TCP sockets they hold."""

from __future__ import annotations

import contextlib
from pathlib import Path

from service.sockets import TcpSocket, sockets_of

__all__ = ["TcpSocket", "descendants", "sockets_of"]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it, now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return sorted(found)
