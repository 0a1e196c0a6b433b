"""The JetStream KV buckets of a mesh, defined once: every actor and command opens them through here.

Creating a bucket is idempotent and race-safe: if another process created it first (with the same
definition), the existing one is used. Buckets are never deleted or recreated.

In a NATS cluster, buckets and streams are created with `min(3, servers)` replicas (`create_replicated`);
on a standalone server, with one, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy, StorageType
from nats.js.kv import KV_MARKER_REASON, KV_OP, KeyValue

from messages.subjects import Subjects
from runtime.bus import BadMessage, Bus, decode_checked
from runtime.logging import get_logger

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BucketSpec:
    description: str
    history: int = 1
    marker_ttl_s: float | None = None  # per-key TTLs are allowed; expiry leaves a delete marker this long
    memory: bool = False  # kept in the servers' memory, not on disk: fast, and lost when every server restarts


NODES = BucketSpec("mesh-actor: last telemetry of each live node (per-key TTL)", marker_ttl_s=60.0)
RESERVATIONS = BucketSpec("mesh-actor: memory held per node (compare-and-set ledgers)")
REGISTRY = BucketSpec("mesh-actor: signed model registry entries")
INSTANCES = BucketSpec("mesh-actor: llama-server instances (per-key TTL)", marker_ttl_s=60.0)
FRONTDOORS = BucketSpec("mesh-actor: each front door's models and queues (per-key TTL)", marker_ttl_s=60.0)
L3 = BucketSpec("mesh-actor: each live node's L3 inventory (per-key TTL)", marker_ttl_s=60.0)
#: Per-key limits (`runtime.key_limits.KeyState`, by key id), rewritten by compare-and-set on every request of
#: a limited key: in memory, and each record lives (its own TTL) only until it reads the same as no record.
LIMITS = BucketSpec("mesh-actor: tenants' keys' shared limit counters (per-key TTL)", memory=True)
#: Tenants' API keys (`messages.tenants.TenantKey` by key id: a hash, never a secret), written by an admin only.
KEYS = BucketSpec("mesh-actor: tenants' API keys (hashes, scopes, limits), by key id")


MAX_REPLICAS = 3
#: The header giving one message of a bucket its own time to live (nats-server 2.11+): records that say a node,
#: an instance or a front door is alive expire with it.
TTL_HEADER = "Nats-TTL"
# JetStream's answers when it cannot place that many replicas. "Replicas > 1 not supported in non-clustered
# mode" is final. "No suitable peers for placement" and "insufficient resources" are also what a cluster
# says in its first seconds, before its meta group knows every server (seen: a 3-node cluster refusing R3
# at start-up), so those are retried with the same replicas for a while before fewer are created.
_NOT_CLUSTERED = 10074
#: nats-server 2.11+ expiry markers say why in a header of their own (nats-py's watcher reads them so).
_MARKER_OPERATIONS = {"MaxAge": "PURGE", "Purge": "PURGE", "Remove": "DEL"}
_NOT_PLACED_YET = (10005, 10023)
_NAME_IN_USE = 10058  # created by another node at the same moment, with other replicas
PLACEMENT_PATIENCE_S = 20.0
_RETRY_S = 0.25


def next_replicas(replicas: int, err_code: int | None, patient: bool) -> int | None:
    """What to try after JetStream refused to create something with `replicas`: the same again (`patient`:
    still within `PLACEMENT_PATIENCE_S` of the first try), fewer, or None (a refusal replicas cannot cure)."""
    if replicas <= 1:
        return None
    if err_code == _NOT_CLUSTERED:
        return replicas - 1
    if err_code in _NOT_PLACED_YET:
        return replicas if patient else replicas - 1
    return None


def cluster_size(bus: Bus) -> int:
    """How many servers the NATS cluster the bus is on has, as far as the client knows: 1 on a standalone
    server; in a cluster, the servers of its pool (the one it connected to and the peers' client URLs that
    the servers announce in their INFO, `connect_urls`)."""
    if not bus.nc._server_info.get("cluster"):  # nats-py keeps the first INFO there; no public accessor
        return 1
    return max(1, len({url.netloc for url in bus.nc.servers}))


# When each bus's patience with a young cluster ends (see `create_replicated`): shared by every creation on it, so
# a cluster with a peer down at the first start pays the wait once, not once per bucket.
_PATIENT_UNTIL: weakref.WeakKeyDictionary[Bus, float] = weakref.WeakKeyDictionary()


async def create_replicated(
    bus: Bus,
    what: str,
    create: Callable[[int], Awaitable[T]],
    existing: Callable[[], Awaitable[T]],
    *,
    patience_s: float = PLACEMENT_PATIENCE_S,
) -> T:
    """`create(replicas)` with `min(3, cluster_size)` replicas, fewer when JetStream says it cannot place
    that many (a peer is down, or a server announces several URLs; see `next_replicas`); `existing()` when
    another node created it first. A warning says when fewer than 3. The patience (`patience_s` from the
    bus's first creation) is shared by every creation on the bus."""
    servers = cluster_size(bus)
    loop = asyncio.get_running_loop()
    patient_until = _PATIENT_UNTIL.setdefault(bus, loop.time() + patience_s)
    result, replicas = await _create_placed(min(MAX_REPLICAS, servers), create, existing, patient_until)
    if servers > 1 and replicas < MAX_REPLICAS:
        get_logger(component="buckets").warning(
            "not_replicated",
            what=what,
            replicas=replicas,
            servers=servers,
            hint="a cluster of at least 3 servers keeps 3 copies; this one survives fewer failures",
        )
    return result


async def _create_placed(
    replicas: int,
    create: Callable[[int], Awaitable[T]],
    existing: Callable[[], Awaitable[T]],
    patient_until: float,
) -> tuple[T, int]:
    """`create` from `replicas` down, as `next_replicas` says; the result and the replicas it has."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await create(replicas), replicas
        except nats.js.errors.APIError as exc:
            if exc.err_code == _NAME_IN_USE:
                return await existing(), replicas
            retry = next_replicas(replicas, exc.err_code, loop.time() < patient_until)
            if retry is None:
                raise
            if retry == replicas:
                await asyncio.sleep(_RETRY_S)
            replicas = retry


async def open_bucket(bus: Bus, name: str, spec: BucketSpec) -> KeyValue:
    try:
        return await bus.js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        pass

    async def create(replicas: int) -> KeyValue:
        return await bus.js.create_key_value(
            bucket=name,
            history=spec.history,
            description=spec.description,
            limit_marker_ttl=spec.marker_ttl_s,
            replicas=replicas,
            storage=StorageType.MEMORY if spec.memory else None,
        )

    return await create_replicated(bus, f"bucket {name}", create, lambda: bus.js.key_value(name))


async def nodes(bus: Bus, subjects: Subjects) -> KeyValue:
    return await open_bucket(bus, subjects.nodes_bucket, NODES)


async def reservations(bus: Bus, subjects: Subjects) -> KeyValue:
    return await open_bucket(bus, subjects.reservations_bucket, RESERVATIONS)


async def registry(bus: Bus, subjects: Subjects) -> KeyValue:
    return await open_bucket(bus, subjects.registry_bucket, REGISTRY)


async def instances(bus: Bus, subjects: Subjects) -> KeyValue:
    return await open_bucket(bus, subjects.instances_bucket, INSTANCES)


async def frontdoors(bus: Bus, subjects: Subjects) -> KeyValue:
    return await open_bucket(bus, subjects.frontdoors_bucket, FRONTDOORS)


async def l3(bus: Bus, subjects: Subjects) -> KeyValue:
    return await open_bucket(bus, subjects.l3_bucket, L3)


async def keys(bus: Bus, subjects: Subjects) -> KeyValue:
    return await open_bucket(bus, subjects.keys_bucket, KEYS)


async def limits(bus: Bus, subjects: Subjects) -> KeyValue:
    return await open_bucket(bus, subjects.limits_bucket, LIMITS)


async def read_all(bus: Bus, name: str, value_type: type[T]) -> tuple[list[tuple[str, T]], list[str]]:
    """Every live `(key, value)` of a bucket decoded as `value_type`, and a warning per undecodable value.

    A missing bucket is empty. Expired keys (delete markers: empty values) and keys that vanish between
    listing and reading are skipped. The keys come from the stream's own subject list (one snapshot), not from
    nats-py's `keys()`, whose watcher ends at the first message the server sent with nothing pending: a key
    rewritten while it lists (an instance record refreshed) can be left out.
    """
    try:
        kv = await bus.js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        return [], []
    prefix = f"$KV.{name}."
    info = await bus.js.stream_info(f"KV_{name}", subjects_filter=f"{prefix}>")
    keys = [subject[len(prefix) :] for subject in (info.state.subjects or {}) if subject.startswith(prefix)]
    values: list[tuple[str, T]] = []
    warnings: list[str] = []
    for key in sorted(keys):
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        if not entry.value:
            continue
        try:
            values.append((key, decode_checked(entry.value, value_type, f"{name} key {key}")))
        except BadMessage as exc:
            warnings.append(str(exc))
    return values, warnings


async def watch(kv: KeyValue, ready: asyncio.Event | None, *, key: str | None = None) -> AsyncIterator[KeyValue.Entry]:
    """Every entry of `kv` (or only `key`'s), its current values first (then `ready` is set), then each change
    as it happens. The watcher is stopped when the caller stops iterating (or is cancelled)."""
    watcher = await (kv.watch(key) if key is not None else kv.watchall())
    try:
        async for entry in watcher:
            if entry is None:  # the initial values are all in
                if ready is not None:
                    ready.set()
                continue
            yield entry
    finally:
        with contextlib.suppress(nats.errors.Error):
            await watcher.stop()  # type: ignore[no-untyped-call]


@dataclass(frozen=True, slots=True)
class Change:
    """One message of a bucket as `follow` hands it on: the key, its value (empty when removed), the stream
    sequence that stored it (the entry's revision), and whether it removed the key (deleted, purged or expired)."""

    key: str
    value: bytes
    revision: int
    removed: bool


async def follow(kv: KeyValue, ready: asyncio.Event | None, take: Callable[[Change], None]) -> None:
    """Every key of `kv` as `watch` gives it (its current values first, then `ready` is set, then each change),
    handed to `take` from the client's delivery of the message: no queue, task or entry object between (the KV
    watcher's callback, entry and queues were about a tenth of the placement actor's busy time at 3,000 reports a
    second). `take` must
    not block; what it raises ends the follow, raised here. nats-py's ordered consumer keeps the order and
    recreates the consumer after a gap, as `watch`'s does. Runs until cancelled."""
    prefix, cut = kv._pre, len(kv._pre)  # the bucket's subjects and stream, as nats-py's own watcher names them
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    delivered = 0

    async def deliver(msg: Msg) -> None:
        nonlocal delivered
        if failed.done():
            return
        try:
            tokens = Msg.Metadata._get_metadata_fields(msg.reply)  # as nats-py's ordered consumer reads them
            headers = msg.headers or {}
            operation = headers.get(KV_OP) or _MARKER_OPERATIONS.get(headers.get(KV_MARKER_REASON, ""))
            value = msg.data or b""
            take(Change(msg.subject[cut:], value, int(tokens[5]), _removes(value, operation)))
            delivered += 1
            if ready is not None and not ready.is_set() and int(tokens[8]) == 0:
                ready.set()  # the last of the current values (what was pending when it was sent)
        except Exception as exc:  # raised in `follow`'s own task, not lost in the client's
            failed.set_exception(exc)

    sub = await kv._js.subscribe(
        prefix + ">", stream=kv._stream, cb=deliver, ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, inactive_threshold=5 * 60,
    )  # fmt: skip
    try:
        info = await sub.consumer_info()
        if ready is not None and info.num_pending == 0 and delivered == 0:
            ready.set()  # an empty bucket
        await failed
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


async def watch_records(
    kv: KeyValue,
    ready: asyncio.Event | None,
    value_type: type[T],
    key_of: Callable[[T], str],
    what: str,
    *,
    put: Callable[[T], None],
    spoil: Callable[[str], None],
    remove: Callable[[str], None],
    log: Any,
) -> None:
    """Keeps a table of `kv`'s records as `watch` delivers them: `put` each that decodes (and names its own key),
    `spoil` one that does not (logged: `bad_record`), `remove` a deleted one."""
    async for entry in watch(kv, ready):
        if removed(entry):
            remove(entry.key)
            continue
        try:
            record = decode_keyed(entry, value_type, key_of, what)
        except BadMessage as exc:
            log.warning("bad_record", what=what, key=entry.key, error=str(exc))
            spoil(entry.key)
        else:
            put(record)


def removed(entry: KeyValue.Entry) -> bool:
    """A deleted or purged key, or one whose TTL expired (a delete marker reads back empty)."""
    return _removes(entry.value, entry.operation)


def _removes(value: bytes | None, operation: str | None) -> bool:
    """What `removed` and `follow` call a removal: an empty value, or a delete or purge operation."""
    return not value or operation in ("DEL", "PURGE")


def decode_keyed(entry: KeyValue.Entry, value_type: type[T], key_of: Callable[[T], str], what: str) -> T:
    """The entry's value as `value_type`, which must name the key it is stored under (a value copied under
    another key is refused: `BadMessage`)."""
    return decode_value(entry.key, entry.value or b"", value_type, key_of, what)


def decode_value(key: str, payload: bytes, value_type: type[T], key_of: Callable[[T], str], what: str) -> T:
    """`payload`, stored under `key`, as `value_type`, which must name that key (`decode_keyed`)."""
    value = decode_checked(payload, value_type, f"{what} {key}")
    if key_of(value) != key:
        raise BadMessage(f"{what} under key {key}", f"claims to be {key_of(value)!r}")
    return value
