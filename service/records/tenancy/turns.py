"""Fair turns between tenants: which queued job a worker takes next (NOTE [ Fair turns ]).

NOTE [ Fair turns ]
Each device queue ``B`` (NOTE [ Queues by device ] in service/settings.py) is split into one RQ
queue per tenant and priority, ``B:<tenant id>:<priority>`` (:func:`turn_queue_name`): a job's
RQ entry, its retries and a sharded job's children wait there, and RQ's ``origin`` names it,
so everything that follows a job by its origin (the reaper, NOTE [ Dequeued and lost ],
cancellation) works on it unchanged. Whoever enqueues there first registers the queue
(:func:`announce`): the tenant joins ``B``'s turns (a sorted set of tenants scored by the
virtual time of their next turn) and the queue joins the tenant's queues of ``B`` (scored by
priority); it also rings ``B``'s bell, which idle workers wait on.

A worker takes its next job with one script (:meth:`Turns.take`): over its device queues in
order (its device class first, then ``auto``), first what an earlier release left in ``B``
itself, then the tenant with the earliest turn that has a job waiting, from that tenant's
highest-priority queue that has one (first in, first out within it). That is start-time fair
queueing: a tenant's turn is at ``max(its tag, B's clock)``; taking a job sets the clock to
that turn and the tenant's tag to the turn plus ``1 / weight`` (weights: ``bnadapt tenants
set-weight``, default 1). So a tenant that had nothing queued comes back at the clock (no
credit saved up while idle), and behind another tenant's hundred jobs its one job starts
within one job slot: at most one job of each other tenant whose turn comes first is taken
before it. With weights 2 and 1, two jobs are taken for every one. Priorities order a tenant's
own jobs only; they never move a tenant's turn.

Tenants stay registered once they queued a job: jobs reach their queues also through RQ
itself (a sharded job's children once their dependencies end, RQ's own retries), without
passing :func:`announce`. A take tries the registered tenants' queues in the order of their
turns until one has a job: one LPOP per (tenant, priority) queue tried, in one script.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, cast

import redis
from rq import Queue

from service.records import keys
from service.records.format import text

__all__ = [
    "BELL_TOKENS_MAX",
    "DEFAULT_WEIGHT",
    "MAX_WEIGHT",
    "Turns",
    "announce",
    "turn_queue",
    "turn_queue_name",
]

DEFAULT_WEIGHT: Final = 1.0
MAX_WEIGHT: Final = 1000.0
# A bell holds at most this many rings: enough to wake every idle worker of a deployment.
BELL_TOKENS_MAX: Final = 256

# KEYS: none (a deployment's own server, never a cluster). ARGV[1]: the weights hash,
# ARGV[2...]: the turns prefix (keys.turns) of each device queue, then its RQ queue name,
# in the order served. Returns {queue name, RQ id} of the job taken, or nil.
_TAKE_LUA: Final = """
local weights = ARGV[1]
for i = 2, #ARGV, 2 do
  local prefix, base = ARGV[i], ARGV[i + 1]
  local id = redis.call('LPOP', 'rq:queue:' .. base)
  if id then return {base, id} end
  local tenants = prefix .. ':tenants'
  local clock = tonumber(redis.call('GET', prefix .. ':clock') or '0')
  local ranked = redis.call('ZRANGE', tenants, 0, -1, 'WITHSCORES')
  for j = 1, #ranked, 2 do
    local tenant = ranked[j]
    local own = redis.call('ZRANGE', prefix .. ':queues:' .. tenant, 0, -1, 'REV')
    for _, name in ipairs(own) do
      id = redis.call('LPOP', 'rq:queue:' .. name)
      if id then
        local turn = math.max(tonumber(ranked[j + 1]), clock)
        local weight = tonumber(redis.call('HGET', weights, tenant) or '1') or 1
        redis.call('SET', prefix .. ':clock', string.format('%.17g', turn))
        redis.call('ZADD', tenants, string.format('%.17g', turn + 1 / weight), tenant)
        return {name, id}
      end
    end
  end
end
return nil
"""


def turn_queue_name(base: str, tenant: str, priority: int) -> str:
    """The RQ queue of ``tenant``'s jobs of ``priority`` waiting in device queue ``base``."""
    return f"{base}:{tenant}:{priority}"


def turn_queue(client: redis.Redis, base: str, tenant: str, priority: int) -> Queue:
    return Queue(turn_queue_name(base, tenant, priority), connection=client, serializer="json")


def announce(
    pipe: redis.Redis | redis.client.Pipeline, base: str, tenant: str, priority: int
) -> None:
    """Registers ``tenant``'s queue of ``priority`` in ``base``'s turns and rings ``base``'s
    bell: call with (or in the same MULTI as) every enqueue there."""
    prefix = keys.turns(base)
    pipe.zadd(f"{prefix}:tenants", {tenant: 0}, nx=True)
    pipe.zadd(
        f"{prefix}:queues:{tenant}", {turn_queue_name(base, tenant, priority): priority}, nx=True
    )
    pipe.lpush(f"{prefix}:bell", "1")
    pipe.ltrim(f"{prefix}:bell", 0, BELL_TOKENS_MAX - 1)


class Turns:
    """The turns of device queues, over one redis-py client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._take = client.register_script(_TAKE_LUA)

    def take(self, bases: Sequence[str]) -> tuple[str, str] | None:
        """Pops the next job's RQ id from ``bases`` (in order): (its queue's name, the id),
        or None when none waits."""
        args: list[str] = [keys.TURN_WEIGHTS]
        for base in bases:
            args += [keys.turns(base), base]
        taken = cast("list[bytes] | None", self._take(args=args))
        if not taken:
            return None
        return text(taken[0]), text(taken[1])

    def wait(self, bases: Sequence[str], timeout_s: float) -> None:
        """Returns when a job was queued in one of ``bases`` (or a moment after), or after
        ``timeout_s``."""
        self.client.blpop([f"{keys.turns(base)}:bell" for base in bases], timeout=timeout_s)

    def queue_names(self, base: str) -> list[str]:
        """Every tenant queue registered in ``base``'s turns."""
        prefix = keys.turns(base)
        tenants = cast("list[bytes]", self.client.zrange(f"{prefix}:tenants", 0, -1))
        pipe = self.client.pipeline(transaction=False)
        for tenant in tenants:
            pipe.zrange(f"{prefix}:queues:{text(tenant)}", 0, -1)
        return [text(name) for names in pipe.execute() for name in names]

    def set_weight(self, tenant: str, weight: float) -> None:
        """``tenant`` takes ``weight`` turns for every one of a tenant of weight 1."""
        if not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"a tenant's weight is in (0, {MAX_WEIGHT:g}]; got {weight:g}")
        if weight == DEFAULT_WEIGHT:
            self.client.hdel(keys.TURN_WEIGHTS, tenant)
        else:
            self.client.hset(keys.TURN_WEIGHTS, tenant, repr(weight))

    def weights(self) -> dict[str, float]:
        """The tenants whose weight is not the default."""
        raw = cast("dict[bytes, bytes]", self.client.hgetall(keys.TURN_WEIGHTS))
        return {text(k): float(text(v)) for k, v in raw.items()}
