"""Tests: the whole service as separate processes: jobs, failures, retries, chaos, S3."""
