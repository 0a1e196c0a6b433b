"""Decision records (placement shell): the complete inputs of large decisions, stored beside the journal.

A `placement_decided` event must stay small (one NATS message, under the journal's event limit), but replay
needs everything the decision saw, and a view of thousands of nodes is megabytes. Such a decision's
`DecisionInputs` is stored as one object of the JetStream object store `<PREFIX>_DECISIONS`, named by the
blake3 of its bytes; the event carries that digest (`DecisionRecordRef`). The same inputs give the same
name, so a retried store is stored once, and a reader verifies the digest before trusting a record.
Records live as long as the store's age limit (by default as long as the journal keeps events).

A record is read with direct gets (`runtime/direct_get.py`), never a consumer: its object's description (the
last message on `$O.<store>.M.<name>`), then its chunks (`$O.<store>.C.<nuid>`). A client's account has no
consumer API, so reading through one made a client's `mesh-actor replay` skip every large decision.
"""

from __future__ import annotations

import base64
from typing import Annotated

import blake3
import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import ObjectStoreConfig
from nats.js.object_store import ObjectStore

from messages.events import DecisionInputs, DecisionRecordRef
from messages.subjects import Subjects
from runtime.buckets import create_replicated
from runtime.bus import BadMessage, Bus, decode_checked, encode
from runtime.direct_get import DirectGetFailed, read_stored

#: How long records are kept, and the store's byte limit (oldest records go first).
DEFAULT_MAX_AGE_S = 7 * 86400.0
DEFAULT_MAX_BYTES = 1 << 30
#: The largest record a reader accepts (checked against the object's description before a chunk is read).
MAX_RECORD_BYTES = 256 << 20


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


class _ObjectInfo(msgspec.Struct, frozen=True):
    """What a reader needs of an object's description (nats's `ObjectInfo`; other fields ignored)."""

    nuid: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9]+$")]
    size: Annotated[int, msgspec.Meta(ge=0)] = 0
    deleted: bool = False


def _stream(subjects: Subjects) -> str:
    return f"OBJ_{store_name(subjects)}"


async def fetch(bus: Bus, subjects: Subjects, ref: DecisionRecordRef) -> DecisionInputs:
    """The stored inputs named by `ref`, verified against its digest (read with direct gets: a client can)."""
    name = store_name(subjects)
    label = f"decision record {ref.blake3[:16]}…"
    meta = f"$O.{name}.M.{base64.urlsafe_b64encode(ref.blake3.encode()).decode()}"
    try:
        described = [m async for m in read_stored(bus, _stream(subjects), meta)]
        if not described:
            raise RecordUnavailable(f"{label} is not stored (expired or never written)")
        info = msgspec.json.decode(described[-1].data, type=_ObjectInfo)
        if info.deleted:
            raise RecordUnavailable(f"{label} was deleted")
        if info.size != ref.size_bytes or info.size > MAX_RECORD_BYTES:
            raise RecordUnavailable(f"{label} holds {info.size} bytes, not the {ref.size_bytes} its event names")
        data = bytearray()
        async for chunk in read_stored(bus, _stream(subjects), f"$O.{name}.C.{info.nuid}"):
            data += chunk.data
            if len(data) > info.size:
                raise RecordUnavailable(f"{label} is longer than its description says")
    except (DirectGetFailed, nats.errors.Error) as exc:
        raise RecordUnavailable(f"cannot read {label}: {exc}") from exc
    except msgspec.DecodeError as exc:  # not JSON, or not the schema
        raise RecordUnavailable(f"{label} has no readable description: {exc}") from exc
    if blake3.blake3(data).hexdigest() != ref.blake3:
        raise RecordUnavailable(f"{label} does not match its digest")
    try:
        return decode_checked(bytes(data), DecisionInputs, label)
    except BadMessage as exc:
        raise RecordUnavailable(str(exc)) from exc
