"""Datasets below the HTTP layer: registering a stored file (every upload path ends in
registration.py) and what a preprocessing spec makes of a dataset. Imports nothing
of service/api/ nor the web framework (`lint-imports`): it raises the refusals of
service/errors.py, which service/api/problems.py answers."""
