"""Tests: models, estimators, training, reports, sharding, in process."""
