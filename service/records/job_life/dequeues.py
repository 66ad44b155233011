"""Which RQ worker holds an RQ job it took from its queue, so that a sweep tells a job a live
worker is about to start from one its lost worker never will (NOTE [ Dequeued and lost ] in
service/upkeep/reaper.py).

Per RQ worker process ``W`` and RQ job ``J``:

- ``keys.rq_worker_holds(W)``: the RQ id W took and runs, or "" between jobs; a thread of W
  refreshes it with the heartbeat TTL, so it is gone a TTL after W dies.
- ``keys.rq_job_holder(J)``: W, from the moment W took J until W is done with it.
- ``keys.rq_job_unheld_since(J)``: when a sweep first found J taken from its queue with no
  holder (W died, or Redis was lost, between RQ's pop and the write of the holder).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, cast

import redis
from rq.job import Job

from service.records import keys
from service.records.format import text

__all__ = ["HOLDER_TTL_S", "DequeueHolds", "Taken"]

# A holder outlives any dequeue window; it only bounds what a worker killed mid-job leaves.
HOLDER_TTL_S: Final = 24 * 3600

_HOLDS_PREFIX, _HOLDS_SUFFIX = keys.rq_worker_holds("\n").split("\n")

# KEYS: none (a deployment's own server, never a cluster). ARGV[1]: the RQ id, ARGV[2]: its RQ
# job key, ARGV[3]: its queue's intermediate list, ARGV[4]: its queue's started registry,
# ARGV[5]: its queue, ARGV[6]: its holder key, ARGV[7]: its unheld-since key, ARGV[8], ARGV[9]:
# the holds key around a worker's name, ARGV[10]: the grace in ms, ARGV[11]: "judge" or
# "requeue", ARGV[12]: "1" to judge a job RQ marked started too. Returns "waiting", "held",
# or "lost:<why>"; with "requeue", a lost job is put back at the front of its queue (a started
# one only with an RQ retry left, which it uses: else "spent:<why>") and "requeued:<why>" is
# returned.
_JUDGE_LUA: Final = """
local rq_id = ARGV[1]
local job_key, intermediate, wip, queue = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local holder_key, unheld_key = ARGV[6], ARGV[7]
local status = redis.call('HGET', job_key, 'status')
if status ~= 'queued' and not (ARGV[12] == '1' and status == 'started') then
  return 'waiting'
end
local function executions()
  local found = {}
  for _, member in ipairs(redis.call('ZRANGE', wip, 0, -1)) do
    if string.sub(member, 1, #rq_id + 1) == rq_id .. ':' then table.insert(found, member) end
  end
  return found
end
local why
local holder = redis.call('GET', holder_key)
if holder then
  local holds = redis.call('GET', ARGV[8] .. holder .. ARGV[9])
  if holds == rq_id then return 'held' end
  if holds then why = 'its worker went on without it' else why = 'its worker is gone' end
else
  -- Out of its queue (a worker of one queue moves it onto the intermediate list, one of
  -- several pops it) but not started: taken.
  if status == 'queued' and redis.call('LPOS', queue, rq_id) then return 'waiting' end
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  redis.call('SET', unheld_key, now_ms, 'NX', 'EX', 86400)
  if now_ms - tonumber(redis.call('GET', unheld_key)) < tonumber(ARGV[10]) then
    return 'held'
  end
  why = 'no worker took it on'
end
if ARGV[11] ~= 'requeue' then return 'lost:' .. why end
if status == 'started' then
  local left = tonumber(redis.call('HGET', job_key, 'retries_left') or '0') or 0
  if left < 1 then return 'spent:' .. why end
  redis.call('HSET', job_key, 'retries_left', left - 1, 'status', 'queued')
end
redis.call('DEL', holder_key, unheld_key)
redis.call('LREM', intermediate, 0, rq_id)
for _, member in ipairs(executions()) do redis.call('ZREM', wip, member) end
redis.call('LPUSH', queue, rq_id)
return 'requeued:' .. why
"""


class Taken(StrEnum):
    """What became of an RQ job a worker may have taken from its queue."""

    WAITING = "waiting"  # in its queue, or not judged here (RQ's own state says)
    HELD = "held"  # a live worker holds it, or one may write that it does any moment
    LOST = "lost"  # taken by a worker that will never start it
    REQUEUED = "requeued"  # lost, and now back at the front of its queue
    SPENT = "spent"  # lost after RQ started it, with no RQ retry left


class DequeueHolds:
    """The records above, over one redis-py client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._judge = client.register_script(_JUDGE_LUA)

    def hold(self, worker: str, rq_id: str, ttl_s: float) -> None:
        """``worker`` took ``rq_id`` from its queue: call before anything else of the job."""
        pipe = self.client.pipeline()
        pipe.set(keys.rq_job_holder(rq_id), worker, ex=HOLDER_TTL_S)
        pipe.set(keys.rq_worker_holds(worker), rq_id, px=int(ttl_s * 1000))
        pipe.execute()

    def beat(self, worker: str, rq_id: str | None, ttl_s: float) -> None:
        """``worker`` lives and holds ``rq_id`` (None: no job)."""
        self.client.set(keys.rq_worker_holds(worker), rq_id or "", px=int(ttl_s * 1000))

    def release(self, worker: str, rq_id: str, ttl_s: float) -> None:
        """``worker`` is done with ``rq_id``: call once RQ recorded how its run ended."""
        pipe = self.client.pipeline()
        pipe.delete(keys.rq_job_holder(rq_id), keys.rq_job_unheld_since(rq_id))
        pipe.set(keys.rq_worker_holds(worker), "", px=int(ttl_s * 1000))
        pipe.execute()

    def judge(
        self,
        rq_id: str,
        origin: str,
        grace_s: float,
        *,
        requeue: bool = False,
        started: bool = False,
    ) -> tuple[Taken, str]:
        """Whether RQ job ``rq_id`` of queue ``origin``, queued by RQ's status (or started,
        with ``started``), was taken from its queue by a worker that will never start it, and
        why. A job taken with no holder (out of its queue) counts as lost once sweeps have seen
        it so for ``grace_s``. With ``requeue``, a lost job goes back to the front of its queue
        in the same step (NOTE [ Dequeued and lost ] in service/upkeep/reaper.py)."""
        queue_key = f"rq:queue:{origin}"
        answer = text(
            self._judge(
                args=[
                    rq_id,
                    Job.key_for(rq_id),
                    f"{queue_key}:intermediate",
                    f"rq:wip:{origin}",
                    queue_key,
                    keys.rq_job_holder(rq_id),
                    keys.rq_job_unheld_since(rq_id),
                    _HOLDS_PREFIX,
                    _HOLDS_SUFFIX,
                    int(grace_s * 1000),
                    "requeue" if requeue else "judge",
                    "1" if started else "0",
                ]
            )
        )
        state, _, why = answer.partition(":")
        return Taken(state), why

    def forget(self, rq_id: str, origin: str) -> None:
        """Drops what a lost run of ``rq_id`` left in RQ's intermediate list and started
        registry, and its holder: RQ's own cleanups would otherwise fail it later, long after
        the job moved on."""
        wip = f"rq:wip:{origin}"
        members = cast("list[bytes]", self.client.zrange(wip, 0, -1))
        stale = [m for m in members if text(m).startswith(f"{rq_id}:")]
        pipe = self.client.pipeline()
        pipe.lrem(f"rq:queue:{origin}:intermediate", 0, rq_id)
        if stale:
            pipe.zrem(wip, *stale)
        pipe.delete(keys.rq_job_holder(rq_id), keys.rq_job_unheld_since(rq_id))
        pipe.execute()
