"""Decision records (placement shell): the complete inputs of large decisions, stored beside the journal.

A `placement_decided` event must stay small (one NATS message, under the journal's event limit), but replay
needs everything the decision saw, and a view of thousands of nodes is megabytes. Such a decision's
`DecisionInputs` is stored as one object of the JetStream object store `<PREFIX>_DECISIONS`, named by the
blake3 of its bytes; the event carries that digest (`DecisionRecordRef`). The same inputs give the same
name, so a retried store is stored once, and a reader verifies the digest before trusting a record.
Records live as long as the store's age limit (by default as long as the journal keeps events).
"""

from __future__ import annotations

import blake3
import nats.errors
import nats.js.errors
from nats.js.api import ObjectStoreConfig
from nats.js.object_store import ObjectStore

from messages.events import DecisionInputs, DecisionRecordRef
from messages.subjects import Subjects
from runtime.buckets import create_replicated
from runtime.bus import BadMessage, Bus, decode_checked, encode

#: How long records are kept, and the store's byte limit (oldest records go first).
DEFAULT_MAX_AGE_S = 7 * 86400.0
DEFAULT_MAX_BYTES = 1 << 30


class RecordUnavailable(Exception):
    """The record cannot be read (gone with its age limit, never stored, or not what its digest says)."""


def store_name(subjects: Subjects) -> str:
    """`MESH_DECISIONS` for the default prefix, beside `MESH_EVENTS`."""
    return subjects.events_stream.removesuffix("_EVENTS") + "_DECISIONS"


def encode_record(inputs: DecisionInputs) -> tuple[bytes, DecisionRecordRef]:
    data = encode(inputs)
    return data, DecisionRecordRef(blake3=blake3.blake3(data).hexdigest(), size_bytes=len(data))


async def open_store(
    bus: Bus, subjects: Subjects, *, max_age_s: float = DEFAULT_MAX_AGE_S, max_bytes: int = DEFAULT_MAX_BYTES
) -> ObjectStore:
    """The decisions object store, created if missing (race-safe, like the KV buckets)."""
    name = store_name(subjects)
    try:
        return await bus.js.object_store(name)
    except nats.js.errors.NotFoundError:
        pass

    async def create(replicas: int) -> ObjectStore:
        config = ObjectStoreConfig(
            bucket=name,
            description="mesh-actor: complete inputs of large placement decisions (by blake3)",
            ttl=max_age_s,
            max_bytes=max_bytes,
            replicas=replicas,
        )
        return await bus.js.create_object_store(name, config=config)

    return await create_replicated(bus, f"object store {name}", create, lambda: bus.js.object_store(name))


async def store(objects: ObjectStore, data: bytes, ref: DecisionRecordRef) -> None:
    await objects.put(ref.blake3, data)


async def fetch(bus: Bus, subjects: Subjects, ref: DecisionRecordRef) -> DecisionInputs:
    """The stored inputs named by `ref`, verified against its digest."""
    try:
        objects = await bus.js.object_store(store_name(subjects))
        result = await objects.get(ref.blake3)
    except nats.js.errors.NotFoundError as exc:
        raise RecordUnavailable(f"decision record {ref.blake3[:16]}… is not stored (expired or never written)") from exc
    except nats.errors.Error as exc:
        raise RecordUnavailable(f"cannot read decision record {ref.blake3[:16]}…: {exc!r}") from exc
    data = result.data or b""
    if blake3.blake3(data).hexdigest() != ref.blake3:
        raise RecordUnavailable(f"decision record {ref.blake3[:16]}… does not match its digest")
    try:
        return decode_checked(data, DecisionInputs, f"decision record {ref.blake3[:16]}…")
    except BadMessage as exc:
        raise RecordUnavailable(str(exc)) from exc
