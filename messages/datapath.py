"""The direct data path: bulk bytes beside the bus, on a TCP stream opened for one transfer.

The negotiation stays on NATS: the node that holds the bytes (a model file, an L3 segment) or that takes them
(a handoff receiver) answers a NATS request with a `DirectOffer`, where its data listener is and a one-shot
ticket bound to what moves (digest, byte range, chunk size), to whom (the receiving node) and until when. The
asking node opens a TCP connection to that address (inside mutual TLS under the cluster's CA when the nodes
have cluster certificates), sends a `DataHello` naming the ticket and what it asks, and reads a `DataAnswer`:
`ok`, or refused (then the listener closes the connection and no byte of the data moves). After an `ok` the
bytes flow from the holder to the receiver as frames: a fixed header (the chunk's offset in the range's
object, big-endian u64; its length, u32; its blake3, 32 raw bytes) followed by the chunk's bytes.

On the stream, the hello and the answer are each a big-endian u32 length and that many bytes of JSON, at most
`MAX_CONTROL_BYTES`. See runtime/datapath.py (listener and client) and runtime/tickets.py (the ticket rules).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from messages.l3 import Digest, NodeId, Offset, Size

#: The most bytes a hello or an answer may take on the stream (read before anything is allocated).
MAX_CONTROL_BYTES: Final = 4096

#: A ticket as it travels: 64 lowercase hex (32 random bytes).
Ticket = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$", description="64 lowercase hex, one-shot")]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.:-]+$")]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
ChunkSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 28)]


class DirectOffer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where to open the direct stream for one transfer, and the ticket that opens it (once, before `ttl_s`)."""

    host: Host
    port: Port
    ticket: Ticket
    tls: bool  # the listener requires mutual TLS under the cluster's CA
    ttl_s: Annotated[float, msgspec.Meta(ge=0, le=3600)]
    # Which machine a loopback listener is on (a digest of its boot id and host name): a node on another machine
    # does not dial its own loopback for it, and uses NATS.
    machine: Annotated[str, msgspec.Meta(max_length=64)] = ""


class DataHello(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The first message on a direct stream: the ticket and exactly what it was issued for."""

    ticket: Ticket
    receiver: NodeId  # the node that asked for the ticket and takes the bytes
    digest: Digest  # what the bytes are of (a file's, a segment's or a payload's blake3)
    offset: Offset  # the range asked, in the object `digest` names
    length: Size
    chunk: ChunkSize  # frames carry at most this many bytes each


class DataAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The listener's word on a hello: `ok` (the frames follow), or the refusal (nothing follows)."""

    ok: bool
    reason: Annotated[str, msgspec.Meta(max_length=64)] = ""  # runtime.tickets.TicketReason, or `busy`
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""
