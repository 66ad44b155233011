"""Prints docs/architecture.md's change-cost table from the probes' runs (all of them, or the
ones named): ``python -m scripts.seam_probes [estimator|kind|resource ...]``."""

from __future__ import annotations

import argparse
import sys

from scripts.seam_probes import PROBES, TABLE_HEADER
from scripts.seam_probes.probe import measure


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.seam_probes", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="PROBE", help=f"of {', '.join(PROBES)}")
    names = parser.parse_args().names or list(PROBES)
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        parser.error(f"no probe {', '.join(unknown)}; the probes are {', '.join(PROBES)}")
    rows = []
    for name in names:
        print(f"probing: {PROBES[name].change}", file=sys.stderr, flush=True)
        rows.append(measure(PROBES[name]).markdown())
    print(TABLE_HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
