"""L3: what a node's durable store of saved slot states holds, as routing and peers see it.

Each node's L3 actor publishes its `L3Inventory` in the `MESH_L3` KV bucket (key = node id, per-key TTL,
refreshed while the node lives). Routing reads it to credit a node with the prefixes its store holds; a peer
that wants an entry fetches it over `mesh.l3.<node>.manifest` / `.segment`.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

#: Where a prompt's prefix came from when a generation started.
PrefixSource = Literal["resident", "l3_local", "l3_peer", "cold"]

# Everything below is read from a bucket or a peer, so its bounds are part of the schema: a decoder built
# from these types refuses a negative count, a digest that is not one, or a size no store can hold, where the
# message is decoded (`bad_request`, or a skipped inventory), never deep inside a core that trusts it.

#: The most token ids one state holds (more than any context llama.cpp supports; `actors/l3/layout.py`).
MAX_TOKENS: Final = 1 << 24
#: The largest size or byte count any L3 message may state (1 PiB).
MAX_BYTES: Final = 1 << 50

Digest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$", description="blake3, 64 lowercase hex")]
Offset = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
NodeId = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e12)]


class L3Item(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One stored entry: its exact-state identity, how many tokens it holds, its entry id and size."""

    identity: Digest
    n_tokens: TokenCount
    entry: Digest
    bytes: Size


class L3Inventory(msgspec.Struct, frozen=True, kw_only=True):
    """One node's store: totals, and its entries (the most recently used first, at most `max_items`)."""

    node_id: NodeId
    entries: Count
    tokens: Count
    bytes: Size  # every stored segment once, and the quarantined manifests
    budget_bytes: Size
    quarantined: Count = 0
    items: tuple[L3Item, ...] = ()
    truncated: bool = False  # more entries are stored than `items` lists
    sent_at: Seconds = 0.0
    eviction_blocked: bool = False  # an unreadable quarantined manifest: captures stop at the budget


# ---- peer fetch: `mesh.l3.<node>.manifests` / `.manifest` / `.segment` ----
#
# `.manifests` answers JSON. `.manifest` and `.segment` answer raw bytes (one chunk, at most what the request
# asks and never more than fits the server's max_payload), with the chunk's place in the headers:
# `L3-Offset` (where the chunk starts) and `L3-Total` (the size of the whole manifest or segment). A fetcher
# asks for the next offset until it has `L3-Total` bytes; errors are the usual error replies (headers
# `Mesh-Error` etc., JSON body). Every digest and entry id must be 64 lowercase hex characters.

#: Headers of a raw chunk reply.
CHUNK_OFFSET_HEADER: Final = "L3-Offset"
CHUNK_TOTAL_HEADER: Final = "L3-Total"


class ManifestsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The entries a node's store holds (from its catalog, no disk read), most recently used first."""

    identity: Digest | None = None  # only entries of this exact-state identity
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1000


class ManifestList(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    items: tuple[L3Item, ...]
    truncated: bool = False


class ManifestRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One chunk of an entry's manifest (the stored JSON, as on disk); the reply is raw bytes."""

    entry: Digest
    offset: Offset = 0


class SegmentRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One chunk of a stored segment, by its digest; the reply is raw bytes."""

    digest: Digest
    offset: Offset = 0
    length: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]  # at most; the server caps it under max_payload


class SegmentOfferRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`mesh.l3.<node>.offer`: a one-shot ticket for the direct data path (messages/datapath.py) to fetch the whole
    stored segment `digest` of `length` bytes in frames of `chunk` bytes, for the node `receiver` (the one asking).
    The answer is a `DirectOffer`; an error reply (or no responder) means the asking node uses `.segment`."""

    digest: Digest
    length: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    chunk: Annotated[int, msgspec.Meta(ge=4096, le=1 << 26)]
    receiver: NodeId


# ---- administration: `mesh.l3.<node>.stat` / `.verify` / `.gc` / `.evict` (what `mesh-actor l3` sends) ----


class EntryRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`stat` and `verify`: one entry by id."""

    entry: Digest


class EntryStat(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    entry: Digest
    identity: Digest
    n_tokens: TokenCount
    bytes: Size
    payload_kind: str
    payload_digest: Digest
    segments: Count
    last_use: Seconds  # unix seconds
    pinned: bool  # being committed or restored right now


class VerifyReply(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    entry: Digest
    ok: bool
    detail: str = ""  # why not: the entry was quarantined


class GcRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Reconcile the store now (temporary files, bad manifests, orphan segments); with `quarantine`, first
    delete every quarantined manifest, so the segments only they named are collected too."""

    quarantine: bool = False


class GcReply(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    entries: Count
    bytes: Size
    removed_temp: Count
    removed_orphans: Count
    quarantined: tuple[str, ...]  # manifests moved to quarantine by this pass
    gc_suspended: bool  # an unreadable manifest is quarantined: no segment was collected
    reclaimed_quarantine: Count = 0  # quarantined manifests deleted (`quarantine`)


class WarmRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`mesh.l3.<node>.warm`: bring into this node's store the entries of `identity` its peers used most
    recently (a new replica's node, before requests come), at most `max_entries` and `max_bytes` in all."""

    identity: Digest
    max_entries: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 1 << 30


class WarmReply(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    fetched: int  # entries fetched from peers
    bytes: int
    already: int  # of the chosen, held here already
    failed: int  # fetches that failed (their reasons are logged)


class EvictRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Evict one entry, or every entry not in use (`all`)."""

    entry: Digest | None = None
    all: bool = False


class EvictReply(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    evicted: tuple[str, ...]
    freed_bytes: Size
    pinned: tuple[str, ...] = ()  # asked for but in use: not evicted
