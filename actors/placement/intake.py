"""Telemetry intake (placement core, pure): tells a node's heartbeat (the same report again, only newer) from a
report that says something new, without decoding the heartbeat whole.

Theory of operation. A node reports every second; most reports say what its last one said, but for their
sequence number and time of sending, which the telemetry actor writes first (`NodeResources` field order:
`node_id`, `seq`, `sent_at`, then everything else). The bytes from `,"started_at":` on are the report's
*content*. When a report's content is byte for byte the content of the node's last report that decoded in full,
the new report decodes to that report with its new `seq` and `sent_at`: only its first three fields are decoded
(`Heartbeat`, which allows no other field) and the rest is compared by a digest. Nothing is taken on the
sender's word: a forged or malformed report whose content differs in one byte, or whose first fields are not
exactly those three, is decoded in full, and refused there as before. The node's start time and TTL are content:
a restart, or a new TTL, is a new report.

Rules this module keeps:
- `heartbeat_of` answers a report only when decoding it in full would give exactly that report; when in any
  doubt it answers None (decode in full), never a refusal: refusing is the full decoder's job, with its messages.
- What it remembers of a node is bounded (a 16-byte digest beside the report the view already holds).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated

import msgspec

from messages.telemetry import NodeResources

#: Where a report's content begins: the field after `sent_at` in the telemetry actor's encoding.
CONTENT_START = b',"started_at":'
#: Keys that may appear only among a report's first fields: content that names one (at any depth) is never
#: taken as a heartbeat's (a duplicate key would make the whole report decode otherwise than its parts).
_HEARTBEAT_KEYS = (b'"node_id":', b'"seq":', b'"sent_at":')
_DIGEST_BYTES = 16


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A report's first fields, with the constraints `NodeResources` puts on them."""

    node_id: str
    seq: Annotated[int, msgspec.Meta(ge=0)]
    sent_at: float


_HEARTBEAT = msgspec.json.Decoder(Heartbeat)


@dataclass(frozen=True, slots=True)
class Known:
    """A node's last report that decoded in full, and the digest of its content (None: its bytes do not split
    into heartbeat and content, so no later report is taken as its heartbeat)."""

    resources: NodeResources
    content: bytes | None


def split(payload: bytes) -> tuple[Heartbeat, bytes] | None:
    """A report's heartbeat fields and the digest of its content, or None when its bytes do not split so: its
    first fields are not exactly `node_id`, `seq` and `sent_at`, valid as `NodeResources` has them, or its content
    names one of those keys."""
    cut = payload.find(CONTENT_START)
    if cut < 0:
        return None
    try:
        heartbeat = _HEARTBEAT.decode(payload[:cut] + b"}")
    except (msgspec.MsgspecError, RecursionError):
        return None
    content = payload[cut:]
    if any(key in content for key in _HEARTBEAT_KEYS):
        return None
    return heartbeat, hashlib.blake2b(content, digest_size=_DIGEST_BYTES).digest()


def remember(resources: NodeResources, payload: bytes) -> Known:
    """What to keep of a report that decoded in full (`resources`, from `payload`) to recognise its heartbeats."""
    parts = split(payload)
    if parts is None:
        return Known(resources, None)
    heartbeat, digest = parts
    if (heartbeat.node_id, heartbeat.seq, heartbeat.sent_at) != (resources.node_id, resources.seq, resources.sent_at):
        return Known(resources, None)  # the first fields are not the ones the report decodes to
    return Known(resources, digest)


def heartbeat_of(known: Known | None, key: str, payload: bytes) -> NodeResources | None:
    """The report `payload` (stored under `key`) decodes to when it is `known`'s again with only its `seq` and
    `sent_at` new; None: decode it in full."""
    if known is None or known.content is None:
        return None
    parts = split(payload)
    if parts is None:
        return None
    heartbeat, digest = parts
    if digest != known.content or heartbeat.node_id != key or known.resources.node_id != key:
        return None
    return msgspec.structs.replace(known.resources, seq=heartbeat.seq, sent_at=heartbeat.sent_at)


__all__ = ["CONTENT_START", "Heartbeat", "Known", "heartbeat_of", "remember", "split"]
