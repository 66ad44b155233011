"""The runners of the job-kind table (NOTE [ The job-kind table ] in api_schemas/jobs/kinds.py):
one module per kind, each with ``run(job, records, store, settings)``, called by
:func:`workers.running.job.run_job` once the job is marked running."""
