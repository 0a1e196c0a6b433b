"""KV handoff: a saved slot state streamed from one node's handoff actor to another's, with credits.

Subjects (receiver `<node>`): `mesh.handoff.<node>.open` (req/reply, `HandoffOpen` → `HandoffOpened`), then
under the session subject `mesh.handoff.<node>.<session>` the sender publishes `.data` (raw chunks, metadata
in the `Handoff-*` headers below), requests `.commit` (`HandoffCommit` → `HandoffResult`) and may publish
`.abort` (`HandoffAbort`). The receiver publishes `HandoffControl` (credit grants, or its abort) on the
sender's `credit_subject`, an inbox the sender subscribed to before opening.

A payload is cut into segments (index, offset, length, blake3, as in an L3 manifest); a segment travels as
one or more chunks of at most `HandoffOpened.chunk_bytes`, in order, each carrying its segment's metadata and
its own place in the segment (`Handoff-Chunk`). Credits are cumulative: `CreditGrant.limit` is how many
payload bytes the sender may have published in total; a grant never shrinks it.

A link probe (`mesh.handoff.<node>.probe`, `LinkProbe` → `LinkProbeResult`) asks `<node>` to measure its link
to a peer with real handoffs of throwaway bytes (payload kind `link_probe`: verified, never restored).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from messages.datapath import DirectOffer
from messages.l3 import Digest

#: Headers of a data chunk (all decimal integers but the session and the digest).
SESSION_HEADER: Final = "Handoff-Session"
INDEX_HEADER: Final = "Handoff-Index"  # the segment's position in the payload
OFFSET_HEADER: Final = "Handoff-Offset"  # where the segment starts in the payload
LENGTH_HEADER: Final = "Handoff-Length"  # the segment's length
DIGEST_HEADER: Final = "Handoff-Digest"  # the segment's blake3 (64 lowercase hex)
CHUNK_HEADER: Final = "Handoff-Chunk"  # where this chunk starts inside its segment

#: A session id: 32 lowercase hex characters chosen by the receiver (one subject token).
Session = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$", description="32 lowercase hex")]
Inbox = Annotated[str, msgspec.Meta(max_length=256, pattern=r"^_INBOX(\.[A-Za-z0-9_-]+)+$")]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e12)]
#: A subject as a receiver names it: tokens of the characters subjects are made of, nothing else.
SessionSubject = Annotated[str, msgspec.Meta(max_length=256, pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")]
ReasonName = Annotated[str, msgspec.Meta(max_length=64)]
Detail = Annotated[str, msgspec.Meta(max_length=4096)]

# What the sender reads from the receiver (`HandoffOpened`, `HandoffControl`, `HandoffResult`) is bounded here,
# where it is decoded; what it means is the sender's own judgement (`actors/handoff/sender.py`): a receiver's
# timeout is a wish the sender caps with its own, and its session subject must be the one the protocol
# defines for that session.


class SegmentSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One segment of the payload as the sender announces it."""

    index: Count
    offset: Bytes
    length: Annotated[int, msgspec.Meta(ge=1, le=1 << 28)]
    digest: Digest


class HandoffOpen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Opens a session: what state is coming, how big it is, and (when known) its whole segment layout."""

    sender_node: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]
    identity: Digest  # the exact-state identity (actors/l3/identity.py)
    n_tokens: Count
    tokens: tuple[TokenId, ...] = ()  # the token ids the state holds (empty: not sent; then not ingested into L3)
    continuation_token: TokenId | None = None  # the prompt's next token, not in the state (fed at restore)
    payload_kind: Annotated[str, msgspec.Meta(pattern="^[a-z0-9_]{1,32}$")] = "llama_slot"
    total_bytes: Bytes | None = None  # exact size when known (then `segments` tile it); None while prefilling
    max_bytes: Bytes  # the most the payload can be: the receiver reserves staging for this
    segments: tuple[SegmentSpec, ...] = ()  # the layout when known up front; () when streamed as produced
    payload_digest: Digest | None = None  # layout.payload_root of `segments`, given with them
    credit_subject: Inbox  # where the receiver sends HandoffControl messages
    direct: bool = False  # the sender can push the chunks over the direct data path (docs/datapath.md)


class HandoffOpened(msgspec.Struct, frozen=True, kw_only=True):
    """The session is open: where to send, how big a chunk may be, and the first credit."""

    session: Session
    # the session subject, `mesh.handoff.<receiver>.<session>` and nothing else (the sender refuses another):
    # publish `<subject>.data`, request `<subject>.commit`
    subject: SessionSubject
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]  # the most payload bytes one data message carries
    credit: Bytes  # the initial credit limit (payload bytes the sender may publish before the next grant)
    idle_timeout_s: Seconds  # the receiver aborts a session that makes no progress for this long
    deadline_s: Seconds  # and any session older than this
    # where to push the chunks instead of `<subject>.data` (asked with `HandoffOpen.direct`; None: over NATS): the
    # same chunks with the same headers, each as one message of the stream; credits, commit and aborts stay on NATS
    direct: DirectOffer | None = None


class CreditGrant(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="credit"):
    session: Session
    limit: Bytes  # cumulative: the sender may have published this many payload bytes in all


class SessionAborted(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="aborted"):
    """The receiver gave the session up; its staging is freed and nothing of it is restorable."""

    session: Session
    reason: ReasonName
    detail: Detail = ""


#: What the receiver sends on `credit_subject`.
HandoffControl = CreditGrant | SessionAborted


class HandoffCommit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything is sent: the counts and the payload digest the receiver must observe before restoring."""

    session: Session
    n_segments: Count
    total_bytes: Bytes
    n_tokens: Count
    payload_digest: Digest  # layout.payload_root over every segment sent, in order


class HandoffAbort(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The sender gives the session up."""

    session: Session
    reason: Annotated[str, msgspec.Meta(max_length=64)]
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class HandoffResult(msgspec.Struct, frozen=True, kw_only=True):
    """The commit's answer: restored, or refused with the reason (then nothing of it was restored). A commit is
    the sender's only when `bytes`, `segments` and `payload_digest` are what it sent."""

    session: Session
    committed: bool
    reason: ReasonName | None = None  # a refusal's name (see docs/api.md, handoff refusal reasons)
    detail: Detail = ""
    bytes: Bytes = 0
    segments: Count = 0
    payload_digest: Digest | None = None
    restored: Annotated[str, msgspec.Meta(max_length=1024)] | None = None  # what the restore hook reported
    restore_ms: Seconds = 0.0


#: The identity link probes carry (no model's: a probe's payload is never restored or stored).
PROBE_PAYLOAD_KIND: Final = "link_probe"
MIB: Final = 1 << 20


class LinkProbe(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Measure the link from the node asked to `peer`: `rounds` handoffs of `small_bytes` and of `bytes`."""

    peer: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]
    bytes: Annotated[int, msgspec.Meta(ge=4 * MIB, le=4096 * MIB)] = 64 * MIB
    small_bytes: Annotated[int, msgspec.Meta(ge=1, le=4 * MIB)] = 256 * 1024
    rounds: Annotated[int, msgspec.Meta(ge=1, le=10)] = 2


class LinkProbeResult(msgspec.Struct, frozen=True, kw_only=True):
    """A handoff of `n` bytes from `src` to `dst` takes `fixed_s + n / bytes_per_s` (fitted on the probes)."""

    src: str
    dst: str
    bytes_per_s: float
    fixed_s: float
    samples: tuple[tuple[int, float], ...]  # (bytes, seconds) of each probe handoff, open to result
    transport: str = "nats"  # the path the probe handoffs took (the rate is that path's): direct, direct_tls, nats
