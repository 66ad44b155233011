"""Adaptation itself: the estimators' passes, their quality on shifted digits, the benchmark of
record on photos, and zoo models adapted in a job."""
