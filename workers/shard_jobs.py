"""The RQ entry points of a sharded job's children in releases before the folders.

RQ stores a job's function as a dotted path, so children enqueued by an older worker still
name this module; they run as if enqueued under workers.sharding.jobs."""

from workers.sharding.jobs import run_eval, run_finish, run_merge, run_shard

__all__ = ["run_eval", "run_finish", "run_merge", "run_shard"]
