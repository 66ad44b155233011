"""The operators' ``bnadapt tenants`` commands: what each tenant may do, kept in Redis and
written there directly: import sources, quotas (NOTE [ Tenant quotas ] in
service/records/tenancy/quotas.py) and weights of the fair turns."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from service.errors import BnadaptError
from service.local.cli.options import Commands, add_redis_url
from service.records.tenancy.turns import MAX_WEIGHT
from service.settings import get_settings

if TYPE_CHECKING:
    from service.records.sync import Records

__all__ = ["declare_tenants"]

_SOURCE_HELP = "s3://BUCKET/PREFIX/ (a folder; s3://BUCKET/ for the whole bucket)"


def declare_tenants(commands: Commands) -> None:
    tenants = commands.add_parser(
        "tenants", help="what each tenant may do (talks to Redis directly)"
    ).add_subparsers(dest="tenants", required=True)
    _declare_allow_import(tenants)
    _declare_list_imports(tenants)
    _declare_revoke_import(tenants)
    _declare_set_quota(tenants)
    _declare_quotas(tenants)
    _declare_set_weight(tenants)
    _declare_weights(tenants)


def _tenant_command(tenants: Commands, name: str, summary: str) -> argparse.ArgumentParser:
    """A command on one tenant, named by its first argument."""
    command = tenants.add_parser(name, help=summary)
    command.add_argument("tenant", help="the tenant's name (as in `keys create`) or id")
    add_redis_url(command)
    return command


def _tenant_records(args: argparse.Namespace) -> tuple[Records, str]:
    """The records over ``--redis-url`` and the id of the tenant ``args.tenant`` names (its
    name, as given to `keys create --tenant`, or its id); ``BnadaptError`` if there is none."""
    from service.records import keys
    from service.records.connection import redis_client
    from service.records.format import text
    from service.records.sync import Records

    records = Records(redis_client(args.redis_url or get_settings().redis_url))
    found = records.client.get(keys.tenant_by_name(args.tenant))
    if found is not None:
        return records, text(found)
    if records.client.exists(keys.tenant(args.tenant)):
        return records, str(args.tenant)
    raise BnadaptError(
        f"no tenant named {args.tenant!r}; a tenant is made with its first key: "
        f"`bnadapt keys create --tenant {args.tenant}`"
    )


def _source_prefix(text: str) -> str:
    from service.records.tenancy.import_sources import normalize_prefix

    try:
        bucket, prefix = normalize_prefix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return f"s3://{bucket}/{prefix}"


def _declare_allow_import(tenants: Commands) -> None:
    allow = _tenant_command(
        tenants, "allow-import", "let the tenant import datasets from everything under an S3 prefix"
    )
    allow.add_argument("prefix", type=_source_prefix, help=_SOURCE_HELP)
    allow.set_defaults(func=cmd_tenants_allow_import)


def cmd_tenants_allow_import(args: argparse.Namespace) -> int:
    from service.records.tenancy.import_sources import normalize_prefix

    records, tenant_id = _tenant_records(args)
    store_url = get_settings().store_url
    if store_url is not None and store_url.startswith("s3://"):
        store_bucket, store_prefix = normalize_prefix(store_url)
        bucket, prefix = normalize_prefix(args.prefix)
        if bucket == store_bucket and prefix.startswith(store_prefix):
            raise BnadaptError(
                f"{args.prefix} is inside the store ({store_url}), which is never a source: "
                "every tenant's datasets and weights are there"
            )
    try:
        source = records.allow_import(tenant_id, args.prefix)
    except ValueError as exc:
        raise BnadaptError(str(exc)) from exc
    print(f"tenant {args.tenant} may import from {source}", file=sys.stderr)
    return 0


def _declare_list_imports(tenants: Commands) -> None:
    _tenant_command(
        tenants, "list-imports", "the S3 prefixes the tenant may import from"
    ).set_defaults(func=cmd_tenants_list_imports)


def cmd_tenants_list_imports(args: argparse.Namespace) -> int:
    records, tenant_id = _tenant_records(args)
    for source in records.import_sources(tenant_id):
        print(source)
    return 0


def _declare_revoke_import(tenants: Commands) -> None:
    revoke = _tenant_command(tenants, "revoke-import", "take back an S3 prefix from the tenant")
    revoke.add_argument("prefix", type=_source_prefix, help=_SOURCE_HELP)
    revoke.set_defaults(func=cmd_tenants_revoke_import)


def cmd_tenants_revoke_import(args: argparse.Namespace) -> int:
    records, tenant_id = _tenant_records(args)
    if not records.revoke_import(tenant_id, args.prefix):
        raise BnadaptError(
            f"tenant {args.tenant} has no import source {args.prefix}; list them with "
            f"`bnadapt tenants list-imports {args.tenant}`"
        )
    print(f"tenant {args.tenant} may no longer import from {args.prefix}", file=sys.stderr)
    return 0


def _declare_set_quota(tenants: Commands) -> None:
    set_quota = _tenant_command(
        tenants, "set-quota", "give a tenant its own value of a quota (0: no limit)"
    )
    set_quota.add_argument(
        "name",
        help="max_active_jobs, max_stored_bytes, max_open_uploads, max_streams, rate_per_s or "
        "rate_burst",
    )
    set_quota.add_argument("value", help="a number (0: no limit), or 'default': the setting's")
    set_quota.set_defaults(func=cmd_tenants_set_quota)


def cmd_tenants_set_quota(args: argparse.Namespace) -> int:
    from service.records.tenancy.quotas import parse_quota_value

    try:
        value = parse_quota_value(args.name, args.value)
    except ValueError as exc:
        raise BnadaptError(str(exc)) from None
    records, tenant_id = _tenant_records(args)
    records.set_quota(tenant_id, args.name, value)
    shown = "the setting's value" if value is None else f"{value:g}"
    print(f"tenant {tenant_id}: {args.name} is {shown}", file=sys.stderr)
    return 0


def _declare_quotas(tenants: Commands) -> None:
    _tenant_command(tenants, "quotas", "a tenant's quotas in effect, and its use").set_defaults(
        func=cmd_tenants_quotas
    )


def cmd_tenants_quotas(args: argparse.Namespace) -> int:
    from service.records.tenancy.quotas import QUOTAS

    records, tenant_id = _tenant_records(args)
    own = records.quota_overrides(tenant_id)
    effective = records.effective_quotas(tenant_id, get_settings())
    used = records.quota_usage(tenant_id)
    print(f"{'quota':18} {'value':>14} {'in use':>14}  from")
    for name, quota in QUOTAS.items():
        value = "no limit" if effective[name] == 0 else f"{effective[name]:g}"
        origin = "tenant" if name in own else quota.setting
        in_use = f"{used[name]:g}" if name in used else "-"
        print(f"{name:18} {value:>14} {in_use:>14}  {origin}")
    return 0


def _declare_set_weight(tenants: Commands) -> None:
    weight = _tenant_command(
        tenants,
        "set-weight",
        "how many turns the tenant's queued jobs get for each one of a tenant of weight 1 "
        "(default 1; docs/service.md, Fair turns)",
    )
    weight.add_argument("weight", type=float, help=f"in (0, {MAX_WEIGHT:g}]; 1 resets it")
    weight.set_defaults(func=cmd_tenants_set_weight)


def cmd_tenants_set_weight(args: argparse.Namespace) -> int:
    from service.records import keys
    from service.records.connection import redis_client
    from service.records.format import text
    from service.records.tenancy.turns import Turns

    client = redis_client(args.redis_url or get_settings().redis_url)
    tenant_id = client.get(keys.tenant_by_name(args.tenant))
    if tenant_id is None:
        raise BnadaptError(
            f"no tenant named {args.tenant!r}; a tenant is made with its first key "
            "(`bnadapt keys create --tenant NAME`), and `bnadapt keys list` shows them"
        )
    try:
        Turns(client).set_weight(text(tenant_id), args.weight)
    except ValueError as exc:
        raise BnadaptError(str(exc)) from exc
    print(f"tenant {args.tenant} ({text(tenant_id)}): weight {args.weight:g}", file=sys.stderr)
    return 0


def _declare_weights(tenants: Commands) -> None:
    weights = tenants.add_parser("weights", help="the tenants whose weight is not 1")
    add_redis_url(weights)
    weights.set_defaults(func=cmd_tenants_weights)


def cmd_tenants_weights(args: argparse.Namespace) -> int:
    from service.records import keys
    from service.records.connection import redis_client
    from service.records.format import text
    from service.records.tenancy.turns import Turns

    client = redis_client(args.redis_url or get_settings().redis_url)
    for tenant_id, weight in sorted(Turns(client).weights().items()):
        name = client.hget(keys.tenant(tenant_id), "name")
        print(f"{tenant_id}  {'' if name is None else text(name):16} {weight:g}")
    return 0
