#!/usr/bin/env bash
# Probe: a new model-changing job kind ("zero_bn": BatchNorm statistics reset), added to a
# scratch worktree of HEAD; prints the diff stat, then checks lint, types and the import
# contracts, that the OpenAPI document (which the web UI reads its kinds from) lists it, and
# that a job of it is accepted by the API and run by a real RQ worker, in process.
source "$(dirname "$0")/common.sh"

cat > api_schemas/jobs/zero_bn.py <<'EOF'
"""Zero-BN jobs (a probe of the job-kind seam): BatchNorm running statistics reset."""

from typing import Literal

from pydantic import Field

from api_schemas.common import RequestModel, ResourceId
from api_schemas.datasets import Preprocessing
from api_schemas.jobs import params as shared
from api_schemas.models import Seed


class ZeroBnParams(RequestModel):
    """The fields every model-changing kind has, and nothing of its own."""

    seed: Seed = 0
    device: shared.Device = "auto"
    batch_size: shared.BatchSize = 64
    preprocessing: Preprocessing | None = None
    checkpoint: shared.CheckpointPolicy = Field(default_factory=shared.CheckpointPolicy)
    compile: bool = False
    compile_backend: shared.CompileBackend = "inductor"


class ZeroBnJobCreate(RequestModel):
    """Asks for a zero-BN job."""

    kind: Literal["zero_bn"]
    model_id: ResourceId
    dataset_id: ResourceId
    params: ZeroBnParams = Field(default_factory=ZeroBnParams)
    max_attempts: shared.MaxAttempts = shared.DEFAULT_MAX_ATTEMPTS
    tags: shared.JobTags = Field(default_factory=dict)
    priority: shared.JobPriority = 0
EOF
python3 - <<'EOF'
p = "api_schemas/jobs/kinds.py"
s = open(p).read()
s = s.replace(
    "from api_schemas.jobs.train import TrainJobCreate, TrainParams\n",
    "from api_schemas.jobs.train import TrainJobCreate, TrainParams\n"
    "from api_schemas.jobs.zero_bn import ZeroBnJobCreate, ZeroBnParams\n",
)
row = '''    "zero_bn": JobKindSpec(
        "reset BatchNorm running statistics (a probe)",
        ZeroBnJobCreate,
        ZeroBnParams,
        "workers.kinds.zero_bn:run",
        registers_model=True,
        needs_labels=False,
    ),
}
'''
i = s.index("\n}\n", s.index("JOB_KINDS: Final"))
s = s[: i + 1] + row + s[i + 3 :]
open(p, "w").write(s)
EOF
cat > workers/kinds/zero_bn.py <<'EOF'
"""The ``zero_bn`` row's runner (a probe of the job-kind seam)."""

from torch import nn

from api_schemas import JobPayload
from service.records.sync import Records
from service.settings import Settings
from service.store.base import Store
from workers.kinds.changing import run_change
from workers.running.compute import ChangeResult, ChangeTask, ModelChange, batchnorm_names


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
EOF
verify kind
