"""Datasets below the HTTP layer: registering a stored file (every upload path ends in
registration.py) and what a preprocessing spec makes of a dataset. Imports no router
(`lint-imports`)."""
