"""`mesh-actor keys`: tenants' API keys for the front doors (issue 20), kept in the keys bucket.

`keys issue --tenant NAME [--models a,b] [--priority P] [--weight W] [--rpm N] [--tpm N] [--max-concurrent N]
[--expires 30d|2027-01-01T00:00:00Z]` makes a key (`mk_<key_id>_<secret>`, 256 random bits) and prints it once:
only its SHA-256 is stored (`messages.tenants.TenantKey`). `keys ls [--tenant NAME]` lists the keys (never a secret
nor a hash: the key id names one); `keys revoke --tenant NAME` revokes every key of a tenant, `--key-id ID` one
key; `keys rotate --tenant NAME` issues a key with the settings of the tenant's newest key, then revokes the old
ones, and prints the new key. Every front door follows the bucket, so an issued or revoked key takes effect on
every node as soon as its watch delivers the change.

Writing keys is an admin's right (`runtime.roles`): `--data-dir D` of a node uses its embedded server's admin
credentials; a node's or a client's credentials are refused by nats-server.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import secrets
import sys
import time
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors

from actors.frontdoor.keys import format_key, secret_digest
from messages.subjects import Subjects
from messages.tenants import KEY_ID_PATTERN, TenantKey
from runtime import buckets
from runtime.bus import BusError, encode
from runtime.cli.common import EXIT_OK, EXIT_USAGE, CliError, add_client_options, connect, emit_json, prefix

_DURATION: Final = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: The record's fields a key keeps when it is rotated (what `issue` sets).
_SETTINGS: Final = (
    "models", "priority", "weight", "rpm", "tpm", "max_concurrent", "expires_at", "cache_group", "nats_users",
)  # fmt: skip
_TIMEOUT_S: Final = 10.0


def register(sub: argparse._SubParsersAction[Any]) -> None:
    keys = sub.add_parser("keys", help="tenants' API keys for the front doors: issue, ls, revoke, rotate")
    verbs = keys.add_subparsers(dest="verb", required=True, metavar="VERB")

    issue = verbs.add_parser("issue", help="issue a key for a tenant and print it (once: only its hash is kept)")
    issue.add_argument("--tenant", required=True, help="who holds the key (letters, digits, . _ -)")
    issue.add_argument("--models", help="the catalog models it may see and use, comma-separated (default: all)")
    issue.add_argument("--priority", type=int, default=0, help="its class in a model's queue, 0-9 (higher first)")
    issue.add_argument("--weight", type=float, default=1.0, help="its tenant's share within its class (default 1)")
    issue.add_argument("--rpm", type=int, help="requests per minute")
    issue.add_argument("--tpm", type=int, help="tokens (prompt + generated) per minute")
    issue.add_argument("--max-concurrent", type=int, help="requests at once")
    issue.add_argument(
        "--client-user",
        action="append",
        default=[],
        metavar="USER",
        help="a `client` NATS user (creds issue --role client) whose mesh.generate requests are this key's "
        "(repeatable); a client user bound to no key generates nothing",
    )
    issue.add_argument(
        "--cache-group",
        default="",
        help="the keys of one group (of any tenant) reuse each other's prompt states; default: its tenant's keys only",
    )
    issue.add_argument("--expires", metavar="WHEN", help="a duration from now (90m, 12h, 30d, 2w) or an ISO time")
    add_client_options(issue)
    issue.set_defaults(func=cmd_issue)

    ls = verbs.add_parser("ls", help="the keys (ids, tenants, scopes, limits; never a secret)")
    ls.add_argument("--tenant", help="only this tenant's keys")
    add_client_options(ls)
    ls.set_defaults(func=cmd_ls)

    revoke = verbs.add_parser("revoke", help="revoke every key of a tenant, or one key")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--tenant", help="revoke every key of this tenant")
    which.add_argument("--key-id", help="revoke this key")
    add_client_options(revoke)
    revoke.set_defaults(func=cmd_revoke)

    rotate = verbs.add_parser("rotate", help="a new key with the tenant's newest key's settings; the old ones go")
    rotate.add_argument("--tenant", required=True)
    rotate.add_argument("--expires", metavar="WHEN", help="the new key's expiry (default: the newest key's)")
    add_client_options(rotate)
    rotate.set_defaults(func=cmd_rotate)


def parse_expiry(text: str, now: float) -> float:
    """`text` as a unix time: a duration from `now` (`90m`, `12h`, `30d`, `2w`, `3600s`) or an ISO 8601 time
    (UTC when it names no zone). It must lie in the future."""
    match = _DURATION.match(text.strip())
    if match:
        at = now + float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        try:
            when = dt.datetime.fromisoformat(text.strip())
        except ValueError as exc:
            raise CliError(
                f"--expires {text!r}: give a duration (90m, 12h, 30d, 2w) or an ISO time", EXIT_USAGE
            ) from exc
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        at = when.timestamp()
    if at <= now:
        raise CliError(f"--expires {text!r} is not in the future", EXIT_USAGE)
    return at


def _record(fields: dict[str, Any]) -> TenantKey:
    """A key record, validated as every front door will decode it."""
    try:
        return msgspec.convert(fields, TenantKey)
    except msgspec.ValidationError as exc:
        raise CliError(f"not a valid key: {exc}", EXIT_USAGE) from exc


def new_key(settings: dict[str, Any], tenant: str, now: float) -> tuple[str, TenantKey]:
    """A fresh key of `tenant` with `settings` (the record's optional fields): what to show once, what to store."""
    key_id, secret = secrets.token_hex(8), secrets.token_hex(32)
    record = _record(
        {"key_id": key_id, "tenant": tenant, "secret_sha256": secret_digest(secret), "created_at": now, **settings}
    )
    return format_key(key_id, secret), record


def _public(key: TenantKey) -> dict[str, Any]:
    """What `ls` shows of a key: everything but its hash."""
    shown = msgspec.to_builtins(key)
    del shown["secret_sha256"]
    return dict(shown)


def _when(at: float | None) -> str:
    if at is None:
        return "never"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _tenant_keys(args: argparse.Namespace, tenant: str | None) -> tuple[list[TenantKey], list[str]]:
    bus = await connect(args, "keys")
    try:
        records, warnings = await buckets.read_all(bus, Subjects(prefix(args)).keys_bucket, TenantKey)
    except (BusError, nats.errors.Error) as exc:
        raise CliError(f"cannot read the keys: {exc or type(exc).__name__}") from exc
    finally:
        await bus.close()
    keys = [key for stored, key in records if stored == key.key_id and (tenant is None or key.tenant == tenant)]
    warnings += [f"key {stored} claims to be {key.key_id}: ignored" for stored, key in records if stored != key.key_id]
    return keys, warnings


async def _write(args: argparse.Namespace, put: list[TenantKey], delete: list[str]) -> None:
    """Stores the keys of `put` (each a new key id), then deletes the keys of `delete`."""
    bus = await connect(args, "keys")
    try:
        kv = await buckets.keys(bus, Subjects(prefix(args)))
        for record in put:
            await kv.create(record.key_id, encode(record))
        for key_id in delete:
            await kv.delete(key_id)
    except (BusError, nats.errors.Error) as exc:  # a refusal of nats-server: not an admin's credentials
        what = str(exc) or type(exc).__name__
        raise CliError(f"cannot write the keys ({what}): writing keys needs an admin's credentials") from exc
    finally:
        await bus.close()


def _issued(args: argparse.Namespace, key: str, record: TenantKey, revoked: list[str] | None = None) -> int:
    if args.json:
        out: dict[str, Any] = {"key": key, "key_id": record.key_id, "tenant": record.tenant,
                               "models": list(record.models), "expires_at": record.expires_at}  # fmt: skip
        if revoked is not None:
            out["revoked"] = revoked
        emit_json(out)
        return EXIT_OK
    print(key)
    gone = f"; revoked {', '.join(revoked)}" if revoked else ""
    print(f"key {record.key_id} of tenant {record.tenant}: shown this once, keep it{gone}", file=sys.stderr)
    return EXIT_OK


async def cmd_issue(args: argparse.Namespace) -> int:
    now = time.time()
    settings: dict[str, Any] = {
        "models": tuple(m.strip() for m in args.models.split(",") if m.strip()) if args.models else (),
        "priority": args.priority,
        "weight": args.weight,
        "rpm": args.rpm,
        "tpm": args.tpm,
        "max_concurrent": args.max_concurrent,
        "expires_at": parse_expiry(args.expires, now) if args.expires else None,
        "cache_group": args.cache_group,
        "nats_users": tuple(args.client_user),
    }
    key, record = new_key(settings, args.tenant, now)
    await _write(args, [record], [])
    return _issued(args, key, record)


async def cmd_ls(args: argparse.Namespace) -> int:
    keys, warnings = await _tenant_keys(args, args.tenant)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    keys.sort(key=lambda k: (k.tenant, k.created_at, k.key_id))
    if args.json:
        emit_json([_public(k) for k in keys])
        return EXIT_OK
    if not keys:
        print("no keys" + (f" of tenant {args.tenant}" if args.tenant else ""))
        return EXIT_OK
    print(f"{'KEY ID':<16}  {'TENANT':<16}  {'MODELS':<24}  PRI  WEIGHT  {'RPM':>6}  {'TPM':>8}  {'CONC':>4}  EXPIRES")
    for k in keys:
        print(
            f"{k.key_id:<16}  {k.tenant:<16}  {','.join(k.models) or '*':<24}  {k.priority:>3}  {k.weight:>6g}  "
            f"{k.rpm or '-':>6}  {k.tpm or '-':>8}  {k.max_concurrent or '-':>4}  {_when(k.expires_at)}"
        )
    return EXIT_OK


async def cmd_revoke(args: argparse.Namespace) -> int:
    if args.key_id is not None:
        if not re.match(KEY_ID_PATTERN, args.key_id):
            raise CliError(f"--key-id {args.key_id!r}: a key id is 16 lowercase hex digits", EXIT_USAGE)
        doomed = [args.key_id]
        if not await _exists(args, args.key_id):
            raise CliError(f"no key {args.key_id}")
    else:
        keys, _ = await _tenant_keys(args, args.tenant)
        doomed = sorted(k.key_id for k in keys)
        if not doomed:
            raise CliError(f"tenant {args.tenant!r} has no keys")
    await _write(args, [], doomed)
    if args.json:
        emit_json({"revoked": doomed})
    else:
        print(f"revoked {len(doomed)} key(s): {', '.join(doomed)}")
    return EXIT_OK


async def _exists(args: argparse.Namespace, key_id: str) -> bool:
    """Whether the bucket holds a record (valid or not) under `key_id`."""
    bus = await connect(args, "keys")
    try:
        kv = await buckets.keys(bus, Subjects(prefix(args)))
        try:
            entry = await kv.get(key_id)
        except nats.js.errors.KeyNotFoundError:
            return False
        return bool(entry.value)
    except (BusError, nats.errors.Error) as exc:
        raise CliError(f"cannot read the keys: {exc or type(exc).__name__}") from exc
    finally:
        await bus.close()


async def cmd_rotate(args: argparse.Namespace) -> int:
    keys, _ = await _tenant_keys(args, args.tenant)
    if not keys:
        raise CliError(f"tenant {args.tenant!r} has no key to rotate: issue one")
    newest = max(keys, key=lambda k: (k.created_at, k.key_id))
    now = time.time()
    settings = {name: getattr(newest, name) for name in _SETTINGS}
    if args.expires:
        settings["expires_at"] = parse_expiry(args.expires, now)
    elif newest.expires_at is not None and newest.expires_at <= now:
        raise CliError(f"the newest key of {args.tenant!r} expired at {_when(newest.expires_at)}: give --expires")
    key, record = new_key(settings, args.tenant, now)
    revoked = sorted(k.key_id for k in keys)
    await _write(args, [record], revoked)  # the new key is stored before the old ones go: no moment without one
    return _issued(args, key, record, revoked)
