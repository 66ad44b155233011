"""The RQ entry point of releases before the folders: ``workers.jobs.run_job``.

RQ stores a job's function as a dotted path, so a job enqueued by an older API still names
this module; it runs as if enqueued under the new path. New jobs name
``workers.running.job.run_job`` (the job-kind table in api_schemas/jobs/kinds.py)."""

from workers.running.job import run_job

__all__ = ["run_job"]
