"""The kernel's TCP socket table: which sockets a set of processes holds and where they listen
(Linux: /proc/net/tcp, /proc/net/tcp6 and /proc/<pid>/fd; elsewhere nothing is found). The
API reads its own listening sockets from it (``/metrics``: NOTE [ Cheap scrapes ] in
service/api/metrics.py); tests read a job's processes' from it."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["TcpSocket", "sockets_of"]

_LISTEN: Final = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp writes a state


@dataclass(frozen=True)
class TcpSocket:
    pid: int
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    listening: bool

    @property
    def loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return self.address.is_loopback or (mapped is not None and mapped.is_loopback)

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.address}:{self.port}{' LISTEN' if self.listening else ''}"


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    # Each 32-bit word in the host's byte order (x86's and ARM's little-endian), as the
    # kernel prints it.
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    with contextlib.suppress(OSError):  # the process ended meanwhile, or no /proc
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # closed since it was listed
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def sockets_of(pids: list[int]) -> list[TcpSocket]:
    """The TCP sockets (IPv4 and IPv6) that the processes ``pids`` hold, now."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found: list[TcpSocket] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):  # no IPv6 in this kernel, or no /proc
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                inode = int(fields[9])
                if inode not in owner:
                    continue
                address, port = fields[1].split(":")
                found.append(
                    TcpSocket(owner[inode], _address(address), int(port, 16), fields[3] == _LISTEN)
                )
    return found
