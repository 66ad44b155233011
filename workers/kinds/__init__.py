"""The runners of the job-kind table (NOTE [ The job-kind table ] in api_schemas/jobs/kinds.py):
one module per kind, each with ``run(job, records, store, settings)``, called by
:func:`workers.running.job.run_job` once the job is marked running.

A kind that changes a model also has ``change(payload)``, its
:class:`~workers.running.compute.ModelChange`, which its runner passes to the shared
computation (workers/kinds/changing.py). The kinds sit above job running and sharding: the
adapt runner queues a sharded job's children, and nothing below imports a kind.
"""
