"""Records of a sharded adapt job's children (its shard jobs and their merge job), in Redis.

Workers write them (workers/sharding/jobs.py; the design is NOTE [ Sharded adaptation ] in
workers/sharding/compute.py); the reaper reads them (service/upkeep/reaper.py) to tell a sharded
job that waits for free workers from one whose children died. Per parent job ``P``:

- ``keys.job_shards(P)``, a hash: per child (``shard-0`` ... ``shard-{K-1}``, ``merge``, and
  for a dataset with labels ``eval-0`` ... ``eval-{K-1}`` and ``finish``) its
  :class:`ChildState`; ``<child>.process``: host:pid of the process that claimed it;
  ``<child>.runs``: how many times it was claimed; ``dispatched``: set once every child is in the
  queue; ``merge.weights``: the sha256 of the
  merged weights while they wait in the store for the evaluation children (referenced by the
  merge's RQ id until the job ends).
- ``keys.job_shard_progress(P)``, a hash: each shard's own progress, summed into P's
  ``Progress`` at ``keys.job_progress(P)`` (what ``GET /v1/jobs/{id}`` shows).
- ``keys.job_child_result(P, child)``: what a child hands on (JSON), with a TTL.
- ``keys.job_heartbeat(<child's RQ id>)``: refreshed while the child runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from enum import StrEnum
from typing import Final

import redis
from pydantic import BaseModel, Field
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RQStatus

from api_schemas import Progress
from service.records import keys
from service.records.format import text
from service.records.stored.store_refs import release_sha_ref

__all__ = [
    "FINISH",
    "MERGE",
    "RESULT_TTL_S",
    "ChildState",
    "ShardRecords",
    "child_job_id",
    "describe_child",
    "eval_name",
    "is_shard",
    "shard_name",
]


MERGE: Final = "merge"
FINISH: Final = "finish"
_MERGED_WEIGHTS: Final = f"{MERGE}.weights"
_SHARD_PREFIX: Final = "shard-"
_EVAL_PREFIX: Final = "eval-"
DISPATCHED: Final = "dispatched"
# Children's results wait this long for the next child; one that has not run by then fails.
RESULT_TTL_S: Final = 7 * 24 * 3600
# RQ states in which a child that has not claimed itself yet will still run.
_WAITING_IN_RQ: Final = {
    RQStatus.CREATED,
    RQStatus.QUEUED,
    RQStatus.DEFERRED,
    # Its dependencies are done and RQ moves it to the queue; a worker whose move lost a race
    # with another's leaves it for RQ's next cleanup pass.
    RQStatus.READY_TO_ENQUEUE,
    RQStatus.RATE_LIMITED,
    RQStatus.SCHEDULED,
    RQStatus.STARTED,  # dequeued, about to claim; RQ fails it if its process dies
}

# KEYS[1]: the parent's job hash, KEYS[2]: its shards hash, KEYS[3]: the child's heartbeat.
# ARGV[1]: the child, ARGV[2]: the claiming process, ARGV[3]: heartbeat TTL in ms.
# Claims a queued child of a running parent; returns 'claimed', or why not.
_CLAIM_LUA: Final = """
local parent = redis.call('HGET', KEYS[1], 'status')
if parent ~= 'running' then return 'the job is ' .. (parent or 'gone') end
local state = redis.call('HGET', KEYS[2], ARGV[1])
if state ~= 'queued' then return ARGV[1] .. ' is ' .. (state or 'unknown') end
redis.call('HSET', KEYS[2], ARGV[1], 'running', ARGV[1] .. '.process', ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[1] .. '.runs', 1)
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
return 'claimed'
"""

# KEYS[1]: the parent's job hash, KEYS[2]: its shards hash, KEYS[3]: the object's references.
# ARGV[1]: the sha256, ARGV[2]: the merge's RQ id, ARGV[3]: the shards hash field.
# References the merged weights only while the parent runs (else the job's end, which releases
# them, may have passed already); returns 'held', or the parent's status.
_HOLD_LUA: Final = """
local parent = redis.call('HGET', KEYS[1], 'status')
if parent ~= 'running' then return parent or 'gone' end
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[1])
return 'held'
"""

# KEYS[1]: the parent's job hash, KEYS[2]: its shards hash, KEYS[3]: the child's heartbeat.
# ARGV[1]: the child. A running child of a running parent back to queued, for RQ to run again
# (NOTE [ Retried children ] in workers/sharding/jobs.py); returns 1, or 0 if not.
_REQUEUE_LUA: Final = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[2], ARGV[1]) ~= 'running' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], 'queued')
redis.call('DEL', KEYS[3])
return 1
"""

# KEYS[1]: the shards hash. ARGV: children. Marks those still queued canceled; returns them.
_CANCEL_QUEUED_LUA: Final = """
local canceled = {}
for _, child in ipairs(ARGV) do
  if redis.call('HGET', KEYS[1], child) == 'queued' then
    redis.call('HSET', KEYS[1], child, 'canceled')
    table.insert(canceled, child)
  end
end
return canceled
"""


class ChildState(StrEnum):
    """queued -> running -> done | failed | stopped; queued -> canceled."""

    QUEUED = "queued"  # in the RQ queue (the merge: deferred until every shard is done)
    RUNNING = "running"  # claimed by a process that keeps its heartbeat alive
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"  # was running; stopped because its parent was canceled or ended
    CANCELED = "canceled"  # never ran: its parent ended first


def shard_name(index: int) -> str:
    return f"{_SHARD_PREFIX}{index}"


def eval_name(index: int) -> str:
    return f"{_EVAL_PREFIX}{index}"


def is_shard(child: str) -> bool:
    return child.startswith(_SHARD_PREFIX)


def child_job_id(parent_id: str, child: str) -> str:
    """The child's RQ job id (ids allow ``[A-Za-z0-9_-]``)."""
    return f"{parent_id}-{child}"


def describe_child(child: str, shards: int) -> str:
    """``shard 2 of 4``, ``the merge of the 4 shards``, ``evaluation 2 of 4`` or ``the finish
    of the 4 shards``, for messages."""
    if child in (MERGE, FINISH):
        return f"the {child} of the {shards} shards"
    if child.startswith(_EVAL_PREFIX):
        return f"evaluation {int(child.removeprefix(_EVAL_PREFIX)) + 1} of {shards}"
    return f"shard {int(child.removeprefix(_SHARD_PREFIX)) + 1} of {shards}"


class _ShardProgress(BaseModel):
    done: int = Field(ge=0)
    total: int = Field(ge=0)
    samples_per_second: float = Field(ge=0.0)
    eta_seconds: float | None = None


class ShardRecords:
    """Reads and writes of the records above, over one redis-py client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._claim = client.register_script(_CLAIM_LUA)
        self._cancel_queued = client.register_script(_CANCEL_QUEUED_LUA)
        self._hold = client.register_script(_HOLD_LUA)
        self._requeue = client.register_script(_REQUEUE_LUA)

    def plan(
        self,
        parent_id: str,
        shard_batches: list[int],
        progress: Progress,
        after_merge: Sequence[str] = (),
    ) -> None:
        """Records every child (the shards, the merge and the children ``after_merge``) as
        queued, each shard's progress as none yet, and the parent's ``progress``; call before
        enqueueing the children."""
        shards = [shard_name(i) for i in range(len(shard_batches))]
        children = [*shards, MERGE, *after_merge]
        pipe = self.client.pipeline()
        pipe.delete(keys.job_shards(parent_id), keys.job_shard_progress(parent_id))
        pipe.hset(keys.job_shards(parent_id), mapping=dict.fromkeys(children, ChildState.QUEUED))
        pipe.hset(
            keys.job_shard_progress(parent_id),
            mapping={
                shard_name(i): _ShardProgress(
                    done=0, total=total, samples_per_second=0.0
                ).model_dump_json()
                for i, total in enumerate(shard_batches)
            },
        )
        pipe.set(keys.job_progress(parent_id), progress.model_dump_json())
        pipe.execute()

    def mark_dispatched(self, parent_id: str) -> None:
        """Every child is queued: from now on the reaper judges the parent by them."""
        self.client.hset(keys.job_shards(parent_id), DISPATCHED, "1")

    def children(self, parent_id: str) -> dict[str, ChildState] | None:
        """Each child's state, or None unless the job is sharded and fully dispatched."""
        raw = self.client.hgetall(keys.job_shards(parent_id))
        fields = {text(k): text(v) for k, v in raw.items()}
        if DISPATCHED not in fields:
            return None
        return {
            name: ChildState(value)
            for name, value in fields.items()
            if name != DISPATCHED and "." not in name
        }

    def processes(self, parent_id: str) -> dict[str, str]:
        """host:pid of the process that claimed each child, for those that ran."""
        raw = self.client.hgetall(keys.job_shards(parent_id))
        suffix = ".process"
        return {
            text(k).removesuffix(suffix): text(v)
            for k, v in raw.items()
            if text(k).endswith(suffix)
        }

    def runs(self, parent_id: str) -> dict[str, int]:
        """How many times each child was claimed (more than once: run again, NOTE [ Retried
        children ] in workers/sharding/jobs.py)."""
        raw = self.client.hgetall(keys.job_shards(parent_id))
        suffix = ".runs"
        return {
            text(k).removesuffix(suffix): int(text(v))
            for k, v in raw.items()
            if text(k).endswith(suffix)
        }

    def claim(self, parent_id: str, child: str, process: str, ttl_s: float) -> str | None:
        """Marks ``child`` running with a fresh heartbeat if it is queued and its parent
        running; None when claimed, else why not."""
        answer = text(
            self._claim(
                keys=[
                    keys.record("job", parent_id),
                    keys.job_shards(parent_id),
                    keys.job_heartbeat(child_job_id(parent_id, child)),
                ],
                args=[child, process, int(ttl_s * 1000)],
            )
        )
        return None if answer == "claimed" else answer

    def requeue(self, parent_id: str, child: str) -> bool:
        """Marks the running ``child`` of a running parent queued again, its heartbeat gone,
        so that its next run can claim it; False (nothing changed) otherwise."""
        return bool(
            self._requeue(
                keys=[
                    keys.record("job", parent_id),
                    keys.job_shards(parent_id),
                    keys.job_heartbeat(child_job_id(parent_id, child)),
                ],
                args=[child],
            )
        )

    def alive(self, parent_id: str, child: str) -> bool:
        return bool(self.client.exists(keys.job_heartbeat(child_job_id(parent_id, child))))

    def finish(
        self, parent_id: str, child: str, state: ChildState, result: str | None = None
    ) -> None:
        """Records how ``child`` ended, with the ``result`` (JSON) it hands on when it has
        one, both at once."""
        pipe = self.client.pipeline()
        if result is not None:
            pipe.set(keys.job_child_result(parent_id, child), result, ex=RESULT_TTL_S)
        pipe.hset(keys.job_shards(parent_id), child, state)
        pipe.execute()

    def hold_weights(self, parent_id: str, sha256: str) -> str | None:
        """Keeps the merged weights in the store (a reference of the merge's) until
        :meth:`release_weights`: the evaluation children may wait for workers for long. None
        when held; the parent's status when it no longer runs (nothing held then)."""
        answer = text(
            self._hold(
                keys=[
                    keys.record("job", parent_id),
                    keys.job_shards(parent_id),
                    keys.sha_refs(sha256),
                ],
                args=[sha256, child_job_id(parent_id, MERGE), _MERGED_WEIGHTS],
            )
        )
        return None if answer == "held" else answer

    def release_weights(self, parent_id: str) -> None:
        """Drops the merge's reference once the job ended (a registered model keeps its own)."""
        sha256 = self.client.hget(keys.job_shards(parent_id), _MERGED_WEIGHTS)
        if sha256 is None:
            return
        pipe = self.client.pipeline()
        release_sha_ref(pipe, text(sha256), child_job_id(parent_id, MERGE))
        pipe.hdel(keys.job_shards(parent_id), _MERGED_WEIGHTS)
        pipe.execute()

    def result(self, parent_id: str, child: str) -> str | None:
        value = self.client.get(keys.job_child_result(parent_id, child))
        return None if value is None else text(value)

    def delete_results(self, parent_id: str, children: Sequence[str]) -> None:
        if children:
            self.client.delete(*(keys.job_child_result(parent_id, c) for c in children))

    def publish_progress(self, parent_id: str, child: str, progress: Progress) -> None:
        """Records shard ``child``'s own ``progress`` and writes the parent's: done and total
        summed over all shards. Optimistic (WATCH): concurrent shards never overwrite each
        other's counts, so the parent's ``done`` never goes back."""
        key = keys.job_shard_progress(parent_id)
        mine = _ShardProgress(
            done=progress.done,
            total=progress.total,
            samples_per_second=progress.samples_per_second,
            eta_seconds=progress.eta_seconds,
        )

        def update(pipe: redis.client.Pipeline) -> None:
            raw = pipe.hgetall(key)
            shards = {text(k): _ShardProgress.model_validate_json(v) for k, v in raw.items()}
            shards[child] = mine
            pipe.multi()
            pipe.hset(key, child, mine.model_dump_json())
            pipe.set(keys.job_progress(parent_id), _summed(shards, progress).model_dump_json())

        self.client.transaction(update, key)

    def count_evaluated(self, parent_id: str, batches: int) -> None:
        """An evaluation child measured ``batches`` batches: the parent's progress (the
        merge began its "evaluate after" phase over all batches) counts them. Optimistic
        (WATCH), as :meth:`publish_progress`."""
        key = keys.job_progress(parent_id)

        def update(pipe: redis.client.Pipeline) -> None:
            raw = pipe.get(key)
            if raw is None:
                return
            progress = Progress.model_validate_json(raw)
            done = min(progress.done + batches, progress.total)
            pipe.multi()
            pipe.set(key, progress.model_copy(update={"done": done}).model_dump_json())

        self.client.transaction(update, key)

    def lost_from_queue(self, parent_id: str, children: list[str]) -> dict[str, str]:
        """Of the still queued ``children``, those RQ will never run (canceled, failed,
        deleted), with what RQ says of them."""
        jobs = Job.fetch_many(
            [child_job_id(parent_id, c) for c in children],
            connection=self.client,
            serializer="json",
        )
        lost = {}
        for child, job in zip(children, jobs, strict=True):
            status = None if job is None else job.get_status(refresh=False)
            if status not in _WAITING_IN_RQ:
                lost[child] = "gone" if status is None else str(status.value)
        if lost:  # a child may have claimed itself since it was read as queued
            now = self.children(parent_id) or {}
            lost = {c: s for c, s in lost.items() if now.get(c) is ChildState.QUEUED}
        return lost

    def discard(self, parent_id: str) -> list[str]:
        """Once the parent has ended: marks the children still queued canceled, takes them out
        of the RQ queue, deletes the children's results and releases the merged weights.
        Returns the canceled children; running ones stop by themselves (their parent is no
        longer running)."""
        raw = self.client.hgetall(keys.job_shards(parent_id))
        children = [text(k) for k in raw if text(k) != DISPATCHED and "." not in text(k)]
        if not children:
            return []
        canceled = [
            text(c) for c in self._cancel_queued(keys=[keys.job_shards(parent_id)], args=children)
        ]
        for child in canceled:
            with contextlib.suppress(NoSuchJobError, InvalidJobOperation):
                Job.fetch(
                    child_job_id(parent_id, child), connection=self.client, serializer="json"
                ).cancel()
        self.delete_results(parent_id, children)
        self.release_weights(parent_id)
        return canceled


def _summed(shards: dict[str, _ShardProgress], latest: Progress) -> Progress:
    """The parent's progress: all shards' batches; the rate of those still running; an ETA
    once every shard has one (the slowest shard's)."""
    unfinished = [s for s in shards.values() if s.done < s.total]
    etas = [s.eta_seconds for s in unfinished if s.eta_seconds is not None]
    return Progress(
        done=sum(s.done for s in shards.values()),
        total=sum(s.total for s in shards.values()),
        unit="batches",
        samples_per_second=sum(s.samples_per_second for s in unfinished),
        eta_seconds=max(etas, default=0.0) if len(etas) == len(unfinished) else None,
        phase=latest.phase,
        updated_at=latest.updated_at,
    )
