"""Loader processes share their job's memory (NOTE [ Loader processes' memory ] in
workers/passes/process_memory.py): in a job's process held to 256 MiB, a batch of 120 MiB
fits the process itself, but not a share of 2 loader processes (a third each); smaller
batches run through the loaders, and the process has its whole budget back after them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.stack import REPO
from service.settings import MIB

# In a process of its own, as RQ's forked job process. The data is held before the cap (as a
# worker's own memory is), so only what the batches take counts.
_CODE = """
import json
import torch
from workers.passes.process_memory import memory_left
from workers.passes.train_batches import epoch_batches
from workers.running.capacity import hold_job_to
from workers.running.failures import is_out_of_memory

big = torch.zeros(2, 30 * 2**20)  # 2 rows of 120 MiB
small = torch.zeros(8, 2 * 2**20)  # 8 rows of 8 MiB
hold_job_to({cap}, "cpu")
before = memory_left()

def rows(x, workers):
    bounds = [(i, i + 1) for i in range(len(x))]
    try:
        return [b.shape[0] for b in epoch_batches(x, torch.arange(len(x)), bounds, workers=workers)]
    except RuntimeError as exc:
        return "out of memory" if is_out_of_memory(exc) else repr(exc)

found = {{
    "big, 2 loaders": rows(big, 2),
    "big, no loader": rows(big, 0),
    "small, 2 loaders": rows(small, 2),
    "left before": before,
    "left after": memory_left(),
}}
print(json.dumps(found))
"""


@pytest.mark.slow  # fills a loader process's memory to its share
def test_loader_processes_share_their_jobs_memory() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CODE.format(cap=256 * MIB)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
        check=True,
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["big, 2 loaders"] == "out of memory", found
    assert found["big, no loader"] == [1, 1], found
    assert found["small, 2 loaders"] == [1] * 8, found
    # The soft limit the loaders lowered is back: within what the batches left allocated.
    assert found["left after"] > found["left before"] - 64 * MIB, found
