"""Records of tenants, API keys, models, datasets and jobs, kept in Redis.

:class:`Records` is every record class over one client, for callers that use several
concerns; each class is usable alone, over a client of its own, like RQ's registries (their
root, ``RedisRecords``, is in base.py):

- :class:`~service.records.tenancy.api_keys.ApiKeys` (api_keys.py): tenants and API keys;
- :class:`~service.records.tenancy.import_sources.ImportSources` (import_sources.py): the S3
  prefixes each tenant may import datasets from;
- :class:`~service.records.stored.models.ModelRecords` (models.py) and
  :class:`~service.records.stored.datasets.DatasetRecords` (datasets.py): tenants' resources, in the
  layout of resources.py;
- :class:`~service.records.stored.store_refs.StoreRefs` (store_refs.py): which records use each
  store object;
- :class:`~service.records.job_life.jobs.JobRecords` (jobs.py): the job life cycle, through a
  compare-and-set of the status;
- :class:`~service.records.job_life.retries.JobAttempts` (retries.py): the retry policy (NOTE [
  Retry policy ], NOTE [ Job attempts ]);
- :class:`~service.records.job_life.logs.JobLogs` (logs.py),
  :class:`~service.records.job_life.signals.JobSignals` (signals.py: heartbeats, progress, cancel
  requests) and :class:`~service.records.job_life.idempotency.IdempotencyKeys` (idempotency.py);
- :class:`~service.records.stored.train_checkpoints.TrainCheckpoints` (train_checkpoints.py): a
  train job's latest training checkpoint (NOTE [ Train checkpoint records ]);
- :class:`~service.records.tenancy.quotas.TenantQuotas` (quotas.py): tenants' own quota values and
  what they use (NOTE [ Tenant quotas ]).

The records of a sharded job's children (shards.py) and of what RQ workers took from their
queues (dequeues.py) are apart: only the workers and the reaper use them.
"""

from __future__ import annotations

from api_schemas import DatasetPublic, ModelPublic
from api_schemas.jobs.public import JobLogEntry
from service.records import keys
from service.records.format import RESOURCE_FIELDS, owned_resource
from service.records.job_life.idempotency import IdempotencyKeys
from service.records.job_life.jobs import JobFilter, JobRecords
from service.records.job_life.logs import JOB_LOG_MAX_ENTRIES, JobLogs
from service.records.job_life.retries import JobAttempts
from service.records.job_life.signals import JobSignals
from service.records.stored.datasets import DatasetRecords
from service.records.stored.models import ModelRecords
from service.records.stored.store_refs import StoreRefs, release_sha_ref
from service.records.stored.train_checkpoints import TrainCheckpoints
from service.records.tenancy.api_keys import ApiKey, ApiKeys
from service.records.tenancy.import_sources import ImportSources
from service.records.tenancy.quotas import TenantQuotas

__all__ = [
    "JOB_LOG_MAX_ENTRIES",
    "ApiKey",
    "JobFilter",
    "JobLogEntry",
    "Records",
    "release_sha_ref",
]


class Records(
    ApiKeys,
    ModelRecords,
    DatasetRecords,
    StoreRefs,
    JobRecords,
    JobAttempts,
    JobLogs,
    JobSignals,
    IdempotencyKeys,
    TenantQuotas,
    ImportSources,
    TrainCheckpoints,
):
    """All record reads and writes, over one redis-py client (thread-safe, pooled): the
    methods of every class it combines, and the one read that spans two of them."""

    def get_model_and_dataset(
        self, tenant_id: str, model_id: str, dataset_id: str
    ) -> tuple[ModelPublic | None, DatasetPublic | None]:
        """Both in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.record("model", model_id), RESOURCE_FIELDS)
        pipe.hmget(keys.record("dataset", dataset_id), RESOURCE_FIELDS)
        model, dataset = pipe.execute()
        return owned_resource(tenant_id, model, ModelPublic), owned_resource(
            tenant_id, dataset, DatasetPublic
        )
