"""Tests: the store, the records, the local operations and deployment files."""
