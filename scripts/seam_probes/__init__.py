"""Change-cost probes: each makes one kind of change to a scratch copy of ``HEAD``, checks it
as the project checks any change (ruff, ``mypy --strict``, the import contracts), runs it at
work (check.py: the API in process over a real Redis-compatible server, a real RQ worker) and
counts the files git sees changed. Their rows are docs/architecture.md's change-cost table,
which tests/test_seam_probes.py holds to their output.

    python -m scripts.seam_probes [estimator|kind|resource ...]   # prints the table

- probe.py: a probe, its run in a scratch copy (scratch.py) and its row;
- edits.py: edits found by structure (NOTE [ Edits by structure ]);
- estimator.py, kind.py, resource.py: the changes;
- check.py: the changes at work.
"""

from __future__ import annotations

from typing import Final

from scripts.seam_probes import estimator, kind, resource
from scripts.seam_probes.probe import Probe

__all__ = ["PROBES", "TABLE_HEADER"]

PROBES: Final[dict[str, Probe]] = {
    probe.check: probe for probe in (estimator.PROBE, kind.PROBE, resource.PROBE)
}
TABLE_HEADER: Final = "| change | files | which | what the probe saw |\n|---|---|---|---|"
