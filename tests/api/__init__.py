"""Tests: the API over HTTP: the contract, bad input, jobs, uploads, the UI."""
