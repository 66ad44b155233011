"""Probe: a new job kind that changes a model, ``zero_bn`` (BatchNorm running statistics reset):
its schema module, its runner module, and its row in the job-kind table (NOTE [ The job-kind
table ])."""

from __future__ import annotations

from scripts.seam_probes.edits import Definitions, SourceFile
from scripts.seam_probes.probe import Probe
from scripts.seam_probes.scratch import Scratch

__all__ = ["PROBE"]

SCHEMA = '''
"""Zero-BN jobs (a probe of the job-kind seam): BatchNorm running statistics reset."""

from typing import Literal

from pydantic import Field

{imports}


class ZeroBnParams(ModelJobParams):
    """The fields every model-changing kind has, and nothing of its own."""


class ZeroBnJobCreate(BaseJobCreate):
    """Asks for a zero-BN job."""

    kind: Literal["zero_bn"]
    params: ZeroBnParams = Field(default_factory=ZeroBnParams)
'''

RUNNER = '''
"""The ``zero_bn`` row's runner (a probe of the job-kind seam)."""

from torch import nn

{imports}


class ZeroBn(ModelChange):
    def run(self, task: ChangeTask) -> ChangeResult:
        for module in task.job.model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.reset_running_stats()
        changed = batchnorm_names(task.job.model)
        return ChangeResult(batches=0, samples=0, changed=changed, reset=True)


def change(payload: JobPayload) -> ModelChange:
    return ZeroBn()


def run(job: JobPayload, records: Records, store: Store, settings: Settings) -> dict[str, str]:
    return run_change(job, records, store, settings, ZeroBn())
'''

ROW = """{spec}(
    "reset BatchNorm running statistics (a probe)",
    ZeroBnJobCreate,
    ZeroBnParams,
    "{package}.zero_bn:run",
    registers_model=True,
    needs_labels=False,
)"""


def make(scratch: Scratch, found: Definitions) -> None:
    table = SourceFile(found.find("JOB_KINDS").path)
    schemas = table.path.parent
    scratch.write(
        schemas / "zero_bn.py",
        SCHEMA.format(imports=found.imports("BaseJobCreate", "ModelJobParams")),
        "new: its params and create request",
    )
    runners = found.find("run_change").path.parent
    imports = found.imports(
        "ChangeResult",
        "ChangeTask",
        "JobPayload",
        "ModelChange",
        "Records",
        "Settings",
        "Store",
        "batchnorm_names",
        "run_change",
    )
    scratch.write(
        runners / "zero_bn.py",
        RUNNER.format(imports=imports),
        "new: `run`, one call to `run_change`, and `change(payload)`, its `ModelChange`",
    )
    kinds = table.assignment("JOB_KINDS")
    row = ROW.format(spec=table.entry_constructor(kinds), package=found.package(runners))
    table.append_entry(kinds, '"zero_bn"', row)
    table.add_import(f"from {found.package(schemas)}.zero_bn import ZeroBnJobCreate, ZeroBnParams")
    scratch.note(table.path, "its row in `JOB_KINDS` and the row's import")


PROBE = Probe("a new job kind that changes a model", "kind", make)
