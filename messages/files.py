"""Model files from peers: what a node asks a peer about a model file, and what it asks its own node to pull.

Subjects `<prefix>.files.<node>.<verb>` (`Subjects.files`):

* `.held` (node to node): whether the node holds a file of that relative name, named by its own catalog
  (`models.toml`: never a peer's front door report) or a registry entry it trusts, and its size and blake3.
* `.facts` (node to node: placement on a node without the file): the file's size, blake3 and header facts
  (`ModelGeometry`), read by the node that holds it.
* `.chunk` (node to node): one chunk of such a file, asked by name and digest; the reply is raw bytes with the
  chunk's place and its own blake3 in headers (`FILES_OFFSET_HEADER`, `FILES_TOTAL_HEADER`,
  `FILES_BLAKE3_HEADER`), at most what fits the server's `max_payload`. Errors are the usual error replies.
* `.offer` (node to node): a one-shot ticket for the direct data path (messages/datapath.py): the range of
  such a file, asked by name and digest, is then sent over a TCP stream from the holder's data listener, each
  chunk with its own blake3; an error reply (or no responder) means the asking node uses `.chunk` instead.
* `.pull` (an operator, `mesh-actor models pull`; or the node's own runner, for a file a start needs): fetch a
  catalog model's file from a peer into this node's models directory, verified; answered once it is there (or
  refused, with the reason in `details.reason`).

A peer never names a path on the fetching node: the destination is that node's models dir and the relative
name its own catalog (or the signed registry entry) gives. See actors/files/.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from messages.l3 import Digest, NodeId, Offset, Size
from messages.model import ModelGeometry

#: Headers of a raw chunk reply.
FILES_OFFSET_HEADER: Final = "Files-Offset"
FILES_TOTAL_HEADER: Final = "Files-Total"
FILES_BLAKE3_HEADER: Final = "Files-Blake3"

#: A model file's relative name in a models dir (what a catalog's `path` or a registry entry's `file_name` says).
RelativeName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
ModelName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]


class HeldRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Does the node hold the file of this relative name (named by its catalog or a registry entry)?"""

    path: RelativeName


class FileHeld(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    path: str
    size: Size
    blake3: Digest


class FileFacts(msgspec.Struct, frozen=True, kw_only=True):
    """`.facts`: the file a node holds, as placement needs it (the answer to a `HeldRequest`)."""

    node_id: NodeId
    path: str
    size: Size
    blake3: Digest
    geometry: ModelGeometry


class ChunkRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One chunk of the file `path` whose whole-file blake3 is `blake3`; the reply is raw bytes."""

    path: RelativeName
    blake3: Digest
    offset: Offset = 0
    length: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]  # at most; the server caps it under max_payload


class OfferRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ticket for the range `offset`..`offset + length` of the file `path` at version `blake3`, in frames of
    `chunk` bytes, for the node `receiver` (the one asking) to fetch over the direct data path."""

    path: RelativeName
    blake3: Digest
    offset: Offset = 0
    length: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
    chunk: Annotated[int, msgspec.Meta(ge=4096, le=1 << 26)]
    receiver: NodeId


class PullRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Fetch the file of catalog model (or registry entry) `name` into this node's models dir; or, from the node
    itself (a runner starting a model whose file it lacks), the file of relative name `path`, which a catalog or
    a trusted registry entry must name, at the version `blake3` when admission stamped one."""

    name: ModelName | None = None
    path: RelativeName | None = None
    blake3: Digest | None = None  # with `path`: the version to fetch (else the signed one, else the holders')
    peer: NodeId | None = None  # fetch from this node only (default: any live node that holds it)


class PullReply(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    name: str  # the model asked for ("" when a path was)
    path: str  # the relative name in the node's models dir
    size: Size
    blake3: Digest
    peer: str = ""  # where the bytes came from ("" when the file was already here)
    already: bool = False  # the file was already here, with that digest
    resumed_from: Size = 0  # bytes of an interrupted fetch kept (verified again) and not fetched again
    moved_bytes: Size = 0  # bytes fetched from the peer by this pull (either path)
    fetch_ms: float = 0.0
    # `direct` (plain TCP on loopback), `direct_tls` (mutual TLS under the cluster CA), `nats`, `direct+nats` (the
    # direct stream broke off and NATS fetched the rest); "" when nothing moved
    transport: str = ""  # the path the bytes took: direct, direct_tls, nats or direct+nats ("": nothing moved)
    fallback: Annotated[str, msgspec.Meta(max_length=1024)] = ""  # why the bus carried bytes, when it did
