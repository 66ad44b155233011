"""The operators' ``bnadapt`` commands that talk to Redis and the store directly: ``keys
create|list|revoke`` and ``store gc`` (``tenants``: service/local/cli/tenants.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from service.errors import BnadaptError
from service.local.cli.options import Commands, add_redis_url, seconds
from service.local.cli_client import print_value
from service.settings import get_settings

__all__ = ["declare_keys", "declare_store"]


def declare_keys(commands: Commands) -> None:
    keys = commands.add_parser("keys", help="API keys (talks to Redis directly)").add_subparsers(
        dest="keys", required=True
    )
    create = keys.add_parser("create", help="create an API key for a tenant")
    create.add_argument("--tenant", required=True, help="the tenant's name (made on first use)")
    add_redis_url(create)
    create.set_defaults(func=cmd_keys_create)
    listing = keys.add_parser("list", help="list the keys: id, tenant, creation (never secrets)")
    add_redis_url(listing)
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="delete a key: requests with it get 401")
    revoke.add_argument("key", help="the key's id (from `keys list`) or the whole key")
    add_redis_url(revoke)
    revoke.set_defaults(func=cmd_keys_revoke)


def cmd_keys_create(args: argparse.Namespace) -> int:
    from service.records.connection import redis_client
    from service.records.sync import Records

    url = args.redis_url or get_settings().redis_url
    key = Records(redis_client(url)).create_api_key(args.tenant)
    print(key.key)
    print(f"(tenant {key.tenant_id}; shown once, only its hash is stored)", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from service.records.connection import redis_client
    from service.records.sync import Records

    url = args.redis_url or get_settings().redis_url
    for key in Records(redis_client(url)).list_api_keys():
        print(f"{key['key_id']}  {key['tenant_id']}  {key['tenant']:16} {key['created_at']}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from service.records.connection import redis_client
    from service.records.sync import Records

    url = args.redis_url or get_settings().redis_url
    if not Records(redis_client(url)).revoke_api_key(args.key):
        raise BnadaptError(f"no API key {args.key!r}; list them with `bnadapt keys list`")
    print(f"revoked {args.key}", file=sys.stderr)
    return 0


def declare_store(commands: Commands) -> None:
    store = commands.add_parser("store", help="the artifact store").add_subparsers(
        dest="store", required=True
    )
    gc = store.add_parser(
        "gc", help="delete store objects nothing uses (also runs on its own, periodically)"
    )
    add_redis_url(gc)
    gc.add_argument("--store-dir", help="default: BNADAPT_STORE_DIR or <BNADAPT_DATA_DIR>/store")
    gc.add_argument(
        "--grace-s",
        type=seconds,
        help="keep objects written or last used within this many seconds (default: "
        "BNADAPT_STORE_GC_GRACE_S, an hour); less is safe only while no API or worker runs",
    )
    gc.set_defaults(func=cmd_store_gc)


def cmd_store_gc(args: argparse.Namespace) -> int:
    from service.records import keys
    from service.records.connection import redis_client
    from service.store import open_store
    from service.store.gc import collect_now

    settings = get_settings()
    if args.store_dir:
        settings = settings.model_copy(update={"store_dir": Path(args.store_dir)})
    store = open_store(settings)
    grace_s = settings.store_gc_grace_s if args.grace_s is None else args.grace_s
    client = redis_client(args.redis_url or settings.redis_url)
    done = collect_now(client, store, grace_s)
    if done is None:
        left_s = max(int(client.pttl(keys.STORE_GC_LOCK)), 0) / 1000
        print(
            f"another store collection is running (its lock ends within {left_s:.0f} s unless "
            "it renews it); try again then",
            file=sys.stderr,
        )
        return 1
    print_value(dataclasses.asdict(done))
    return 0
