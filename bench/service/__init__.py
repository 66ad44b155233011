"""The service around the computation: per-job overhead and API throughput, a noisy neighbour
between two tenants, and chaos (kills and outages) under load."""
