"""What a worker's machine offers a job, and how a job's process that died is judged.

The RQ worker publishes the memory a job may use (NOTE [ Activation estimate ] in
service/jobs/submission.py): ``BNADAPT_WORKER_MEMORY_BYTES`` when set, else the machine's
memory (the cgroup's limit when lower), or the GPU's for a CUDA worker, read in a child
process since the worker itself must never touch CUDA (it forks its jobs). With the setting,
each job's process on a worker started with ``--device cpu`` is held to it (``RLIMIT_DATA``):
a job that needs more gets an allocation failure, its own failure, instead of the kernel's
out-of-memory killer.

A job's memory is the job's, however many processes it has (NOTE [ A job's memory among its
processes ] in workers/training/ranks.py): a process that starts others (a train job's ranks,
a pass's loader processes) divides what it has left under its limit among them
(``memory_left`` in workers/passes/process_memory.py), and each holds itself to its share
(``hold_process_to``; NOTE [ Loader processes' memory ] there). The
control groups that could hold them together are not used: a worker cannot count on creating
a cgroup v2 with the memory controller (the machine these tests run on delegates only
``hugetlb`` to its v2 hierarchy), while ``RLIMIT_DATA`` holds everywhere Linux runs. What a
process holds when it starts (the interpreter and torch, imported) is not counted.

A job's process that dies without raising is an interruption, retried (NOTE [ Retry policy ]
in service/records/job_life/retries.py), unless :func:`killed_for_its_own_reasons` finds it killed
for memory (the cgroup counted an out-of-memory kill meanwhile) or for its timeout (RQ kills a
job a minute past it when its timeout exception did not stop it).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from workers.passes.process_memory import vm_data
from workers.running.failures import out_of_memory_message, timeout_message

__all__ = [
    "PUBLISH_INTERVAL_S",
    "PUBLISH_TTL_S",
    "hold_job_to",
    "killed_for_its_own_reasons",
    "machine_memory",
    "offered_memory",
    "oom_kills",
]

PUBLISH_INTERVAL_S: Final = 5.0
PUBLISH_TTL_S: Final = 20.0
_CGROUP: Final = Path("/sys/fs/cgroup")
_GPU_QUERY_TIMEOUT_S: Final = 120


def machine_memory() -> int | None:
    """The machine's physical memory, or its cgroup's limit when lower (a container)."""
    found: list[int] = []
    with contextlib.suppress(ValueError, OSError):
        found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for limit in (_CGROUP / "memory.max", _CGROUP / "memory" / "memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            found.append(int(limit.read_text().strip()))  # "max": no limit, skipped
    return min(found, default=None)


def _gpu_memory(device: str) -> int | None:
    index = device.partition(":")[2] or "0"
    if not index.isdigit():
        return None
    code = f"import torch; print(torch.cuda.get_device_properties({index}).total_memory)"
    try:
        done = subprocess.run(  # noqa: S603 - our interpreter, a fixed command, a digit
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=_GPU_QUERY_TIMEOUT_S,
            check=True,
        )
        return int(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def offered_memory(setting: int | None, device: str) -> int | None:
    """The memory this worker offers a job: the setting, else its device's."""
    if setting is not None:
        return setting
    if device.startswith("cuda"):
        return _gpu_memory(device)
    return machine_memory()


def hold_job_to(setting: int | None, device: str) -> None:
    """In a job's process: with ``BNADAPT_WORKER_MEMORY_BYTES`` set, a CPU job may allocate
    that much beyond what the process held when it started (the worker's own torch, forked
    with it); past it, allocations fail and the job fails as out of memory."""
    if setting is None or not device.startswith("cpu"):
        return
    held = vm_data()
    if held is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (held + setting, held + setting))


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer ended in this cgroup (v2)."""
    with contextlib.suppress(OSError, ValueError):
        for line in (_CGROUP / "memory.events").read_text().splitlines():
            name, _, count = line.partition(" ")
            if name == "oom_kill":
                return int(count)
    return None


def killed_for_its_own_reasons(
    status: int,
    started_at: datetime | None,
    timeout_s: float | None,
    oom_kills_before: int | None,
) -> str | None:
    """The error of a job whose process died with wait ``status``, when it was its own
    failure (memory, timeout); None for an interruption, which is retried."""
    if not os.WIFSIGNALED(status) or os.WTERMSIG(status) != signal.SIGKILL:
        return None
    if started_at is not None and timeout_s is not None and timeout_s > 0:
        ran = (datetime.now(UTC) - started_at.astimezone(UTC)).total_seconds()
        if ran > timeout_s:
            return timeout_message(int(timeout_s))
    after = oom_kills()
    if oom_kills_before is not None and after is not None and after > oom_kills_before:
        return out_of_memory_message("its process was killed by the kernel's out-of-memory killer")
    return None
