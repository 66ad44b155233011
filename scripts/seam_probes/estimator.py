"""Probe: a new estimator, ``ema_half`` (the train-mode loop at momentum 0.5): its module beside
the others, and its row in the estimator table (NOTE [ The estimator table ])."""

from __future__ import annotations

from scripts.seam_probes.edits import Definitions, SourceFile
from scripts.seam_probes.probe import Probe
from scripts.seam_probes.scratch import Scratch

__all__ = ["PROBE"]

MODULE = '''
"""The ``ema_half`` estimator (a probe of the estimator seam): ``ema`` at momentum 0.5."""

{imports}


def run(task: EstimatorTask) -> AdaptStats:
    selected = resolve_batchnorm(task.model, task.layers)
    momenta = [bn.momentum for bn in selected]
    try:
        for bn in selected:
            bn.momentum = 0.5
        return run_ema(task)
    finally:
        for bn, momentum in zip(selected, momenta, strict=True):
            bn.momentum = momentum
'''

ROW = """{spec}(
    "the train-mode loop at momentum 0.5 (a probe)",
    "{package}.ema_half:run",
    resets=False,
    sharding=None,
    sequential_reason="each batch updates the statistics the next batch starts from",
)"""


def make(scratch: Scratch, found: Definitions) -> None:
    folder = found.find("EstimatorTask").path.parent
    imports = found.imports("AdaptStats", "EstimatorTask", "resolve_batchnorm", "run_ema")
    scratch.write(folder / "ema_half.py", MODULE.format(imports=imports), "new: its `run(task)`")
    table = SourceFile(found.find("ESTIMATORS").path)
    rows = table.assignment("ESTIMATORS")
    spec = table.entry_constructor(rows)
    table.append_entry(rows, '"ema_half"', ROW.format(spec=spec, package=found.package(folder)))
    scratch.note(table.path, "its row in `ESTIMATORS`")


PROBE = Probe("a new estimator", "estimator", make)
