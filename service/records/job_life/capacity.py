"""The memory the workers offer a job: each live worker publishes its own for every queue it
serves, with an expiry it keeps pushing forward; the API reads the smallest a live worker of
the job's queue published (NOTE [ Activation estimate ] in service/jobs/submission.py)."""

from __future__ import annotations

import time
from typing import cast

from service.records import keys
from service.records.base import RedisRecords
from service.records.format import text

__all__ = ["WorkerMemory"]


class WorkerMemory(RedisRecords):
    """Each live worker's memory per queue (``keys.worker_memory``)."""

    def publish(self, queues: list[str], worker: str, memory_bytes: int, ttl_s: float) -> None:
        """``worker`` offers ``memory_bytes`` to the jobs of ``queues`` for the next ``ttl_s``
        seconds; entries of workers that stopped publishing are dropped on the way."""
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for queue in queues:
            pipe.hset(keys.worker_memory(queue), worker, f"{memory_bytes} {now + ttl_s}")
        pipe.execute()
        for queue in queues:
            stale = [name for name, _ in self._entries(queue, now, expired=True)]
            if stale:
                self.client.hdel(keys.worker_memory(queue), *stale)

    def withdraw(self, queues: list[str], worker: str) -> None:
        for queue in queues:
            self.client.hdel(keys.worker_memory(queue), worker)

    def smallest(self, queue: str) -> int | None:
        """The least memory a live worker of ``queue`` published; None when none has."""
        offered = [memory for _, memory in self._entries(queue, time.time(), expired=False)]
        return min(offered, default=None)

    def _entries(self, queue: str, now: float, expired: bool) -> list[tuple[str, int]]:
        raw = cast("dict[bytes, bytes]", self.client.hgetall(keys.worker_memory(queue)))
        found = []
        for name, value in raw.items():
            memory, _, until = text(value).partition(" ")
            try:
                alive = float(until) > now
                amount = int(memory)
            except ValueError:
                alive, amount = False, 0
            if alive != expired:
                found.append((text(name), amount))
        return found
