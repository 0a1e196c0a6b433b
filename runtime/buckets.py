"""The JetStream KV buckets of a mesh, defined once: every actor and command opens them through here.

Creating a bucket is idempotent and race-safe: if another process created it first (with the same
definition), the existing one is used. Buckets are never deleted or recreated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from messages.subjects import Subjects
from runtime.bus import BadMessage, Bus, decode_checked

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BucketSpec:
    description: str
    history: int = 1
    marker_ttl_s: float | None = None  # per-key TTLs are allowed; expiry leaves a delete marker this long


NODES = BucketSpec("mesh-actor: last telemetry of each live node (per-key TTL)", marker_ttl_s=60.0)
RESERVATIONS = BucketSpec("mesh-actor: memory held per node (compare-and-set ledgers)")
REGISTRY = BucketSpec("mesh-actor: signed model registry entries")
INSTANCES = BucketSpec("mesh-actor: llama-server instances (per-key TTL)", marker_ttl_s=60.0)
FRONTDOORS = BucketSpec("mesh-actor: each front door's models and queues (per-key TTL)", marker_ttl_s=60.0)
L3 = BucketSpec("mesh-actor: each live node's L3 inventory (per-key TTL)", marker_ttl_s=60.0)


async def open_bucket(bus: Bus, name: str, spec: BucketSpec) -> KeyValue:
    try:
        return await bus.js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await bus.js.create_key_value(
            bucket=name, history=spec.history, description=spec.description, limit_marker_ttl=spec.marker_ttl_s
        )
    except nats.js.errors.BadRequestError:
        return await bus.js.key_value(name)  # created by another node at the same moment


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


async def read_all(bus: Bus, name: str, value_type: type[T]) -> tuple[list[tuple[str, T]], list[str]]:
    """Every live `(key, value)` of a bucket decoded as `value_type`, and a warning per undecodable value.

    A missing bucket is empty. Expired keys (delete markers: empty values) and keys that vanish between
    listing and reading are skipped.
    """
    try:
        kv = await bus.js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        return [], []
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return [], []
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


async def watch(kv: KeyValue, ready: asyncio.Event) -> AsyncIterator[KeyValue.Entry]:
    """Every entry of `kv`, its current values first (then `ready` is set), then each change as it happens.
    The watcher is stopped when the caller stops iterating (or is cancelled)."""
    watcher = await kv.watchall()
    try:
        async for entry in watcher:
            if entry is None:  # the initial values are all in
                ready.set()
                continue
            yield entry
    finally:
        with contextlib.suppress(nats.errors.Error):
            await watcher.stop()  # type: ignore[no-untyped-call]


def removed(entry: KeyValue.Entry) -> bool:
    """A deleted or purged key, or one whose TTL expired (a delete marker reads back empty)."""
    return not entry.value or entry.operation in ("DEL", "PURGE")


def decode_keyed(entry: KeyValue.Entry, value_type: type[T], key_of: Callable[[T], str], what: str) -> T:
    """The entry's value as `value_type`, which must name the key it is stored under (a value copied under
    another key is refused: `BadMessage`)."""
    value = decode_checked(entry.value or b"", value_type, f"{what} {entry.key}")
    if key_of(value) != entry.key:
        raise BadMessage(f"{what} under key {entry.key}", f"claims to be {key_of(value)!r}")
    return value
