"""Jobs below the HTTP layer: submission (the fit checks, the payload, the single write of
record and queue entry), the Idempotency-Key policy and the queue a job waits in. The routes in
service/api/routes/jobs.py parse and answer; they decide nothing here. Imports nothing of
service/api/ nor the web framework (`lint-imports`): it raises the refusals of service/errors.py,
which service/api/problems.py answers."""
