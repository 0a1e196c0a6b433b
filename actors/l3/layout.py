"""How an L3 entry is laid out: digests, the segment plan, the manifest and where each file lives (pure).

Rules this module keeps:

* A digest is blake3, written as exactly 64 lowercase hex characters. Every digest that names a file
  (a segment, a manifest) passes `check_digest` before any path is built from it, wherever it came from
  (a peer, a manifest on disk, a directory listing): a name like `../x`, `AB…`, or 63 characters is refused,
  so no path can leave the store.
* Paths are returned as tuples of names relative to the store root; the shell joins them. Each name is
  either a fixed word or a checked digest, so a path never holds a separator, `..` or a NUL.
* A payload is cut into segments of one fixed size (the last one shorter), in order. A segment is named by
  the blake3 of its bytes, so identical segments of two entries are one file.
* The payload digest is the root of a two-level hash tree: blake3 over the segment table (index, offset,
  length and blake3 of every segment, in order), like BLAKE3's own tree at a coarser grain. It commits to
  every byte and to their order exactly as a blake3 of the concatenation would, and it is recomputed from
  the segments as they are re-hashed, so one hashing pass over the bytes checks both (a flat blake3 of the
  payload would need a second pass: measured in benchmarks/RESULTS.md).
* A manifest names its entry: the entry id is blake3 over the identity and the token ids, so a manifest
  filed under another name is detected. Manifests and token lists read from disk have size ceilings that
  are checked before anything is allocated.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from typing import Final

import blake3
import msgspec

from messages import l3 as wire

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_SEGMENT_BYTES",
    "MAX_TOKENS",
    "MIN_SEGMENT_BYTES",
    "DigestError",
    "Manifest",
    "SegmentRef",
    "check_digest",
    "decode_manifest",
    "encode_manifest",
    "entry_id",
    "is_digest",
    "is_fanout_name",
    "is_payload_kind",
    "is_quarantine_name",
    "is_temp_name",
    "manifest_name",
    "manifest_path",
    "payload_root",
    "pending_path",
    "plan_segments",
    "quarantine_path",
    "segment_path",
    "temp_name",
]

#: Chosen by `benchmarks/l3_ingest.py` (benchmarks/RESULTS.md, L3 store): each segment costs an fsync when it
#: is flushed, so smaller ones are slower (8 MiB: about 0.7x the 32 MiB rate), 16-64 MiB are within noise,
#: and a larger segment is more to hash again when it is reused, and more to re-fetch when one is damaged.
DEFAULT_SEGMENT_BYTES: Final = 32 * 1024 * 1024
MIN_SEGMENT_BYTES: Final = 64 * 1024
MAX_SEGMENT_BYTES: Final = 256 * 1024 * 1024
#: A token list longer than any context llama.cpp supports is refused before it is decoded (the wire's bound).
MAX_TOKENS: Final = wire.MAX_TOKENS
#: Enough for MAX_TOKENS ids as JSON plus thousands of segments; a bigger file is not read.
MAX_MANIFEST_BYTES: Final = 256 * 1024 * 1024
MANIFEST_VERSION: Final = 1
MAX_TOKEN_ID: Final = (1 << 31) - 1  # llama_token is int32

SEGMENTS_DIR: Final = "segments"
MANIFESTS_DIR: Final = "manifests"
QUARANTINE_DIR: Final = "quarantine"
PENDING_DIR: Final = "pending"
INCOMING_DIR: Final = "incoming"  # segments arriving from a peer, before they are committed
TEMP_PREFIX: Final = ".tmp-"
MANIFEST_SUFFIX: Final = ".json"

_DIGEST = re.compile(r"[0-9a-f]{64}")
_ENTRY_DOMAIN: Final = b"mesh-actor/l3/entry/v1\x00"
_PAYLOAD_DOMAIN: Final = b"mesh-actor/l3/payload/v1\x00"
_PAYLOAD_KIND = re.compile(r"[a-z0-9_]{1,32}")


class DigestError(ValueError):
    """A string that should be a blake3 digest is not 64 lowercase hex characters."""


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def check_digest(value: object, what: str = "digest") -> str:
    """`value` as a digest, or `DigestError` (the message never echoes more than a short prefix)."""
    if not is_digest(value):
        shown = repr(value)[:40]
        raise DigestError(f"{what} must be 64 lowercase hex characters, got {shown}")
    assert isinstance(value, str)
    return value


class SegmentRef(msgspec.Struct, frozen=True, array_like=True):
    """One segment of a payload: its position, where it starts, how long it is, and its blake3."""

    index: int
    offset: int
    length: int
    digest: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What makes an entry loadable. Written last, after every segment it names is durable."""

    version: int = MANIFEST_VERSION
    identity: str  # exact-state identity (actors/l3/identity.py)
    tokens: tuple[int, ...]  # the token ids the saved slot holds
    n_tokens: int
    payload_kind: str
    total_bytes: int
    payload_digest: str  # payload_root(segments): the hash-tree root over every segment, in order
    segments: tuple[SegmentRef, ...]


_manifest_decoder: Final = msgspec.json.Decoder(Manifest)
_manifest_encoder: Final = msgspec.json.Encoder()


def encode_manifest(manifest: Manifest) -> bytes:
    return _manifest_encoder.encode(manifest)


def decode_manifest(data: bytes) -> Manifest:
    """Parses a manifest; `msgspec.ValidationError`/`DecodeError` (both `msgspec.MsgspecError`) on bad input.
    The size ceiling is checked before parsing; the content rules are `commit.check_manifest`'s job."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise msgspec.ValidationError(f"manifest is {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    return _manifest_decoder.decode(data)


def entry_id(identity: str, tokens: tuple[int, ...] | list[int]) -> str:
    """The name of the entry holding `tokens` under `identity`: blake3 over both, length-prefixed."""
    check_digest(identity, "identity")
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"{len(tokens)} tokens, more than {MAX_TOKENS}")
    if any(not 0 <= t <= MAX_TOKEN_ID for t in tokens):
        raise ValueError("token ids must be in [0, 2^31)")
    hasher = blake3.blake3(_ENTRY_DOMAIN)
    hasher.update(identity.encode("ascii"))
    hasher.update(struct.pack("<Q", len(tokens)))
    hasher.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return str(hasher.hexdigest())


def payload_root(segments: Sequence[SegmentRef]) -> str:
    """The payload digest: blake3 over the segment table, every field fixed-width or length-prefixed."""
    hasher = blake3.blake3(_PAYLOAD_DOMAIN)
    hasher.update(struct.pack("<Q", len(segments)))
    for seg in segments:
        digest = seg.digest.encode("utf-8", errors="surrogateescape")
        try:
            hasher.update(struct.pack("<qqqQ", seg.index, seg.offset, seg.length, len(digest)))
        except struct.error as exc:
            raise ValueError(f"segment {seg.index} has a field outside 64 bits") from exc
        hasher.update(digest)
    return str(hasher.hexdigest())


def is_payload_kind(value: str) -> bool:
    """A payload kind is a short word: 1-32 of [a-z0-9_]."""
    return _PAYLOAD_KIND.fullmatch(value) is not None


def plan_segments(total_bytes: int, segment_bytes: int) -> list[tuple[int, int, int]]:
    """(index, offset, length) of each segment of a `total_bytes` payload; an empty payload has none."""
    check_segment_bytes(segment_bytes)
    if total_bytes < 0:
        raise ValueError("a payload cannot have a negative size")
    return [
        (i, off, min(segment_bytes, total_bytes - off)) for i, off in enumerate(range(0, total_bytes, segment_bytes))
    ]


def check_segment_bytes(segment_bytes: int) -> int:
    if not MIN_SEGMENT_BYTES <= segment_bytes <= MAX_SEGMENT_BYTES:
        raise ValueError(
            f"segment size must be in [{MIN_SEGMENT_BYTES}, {MAX_SEGMENT_BYTES}] bytes, got {segment_bytes}"
        )
    return segment_bytes


def segment_path(digest: str) -> tuple[str, str, str]:
    """`segments/<first 2 hex>/<digest>` relative to the store root."""
    check_digest(digest, "segment digest")
    return (SEGMENTS_DIR, digest[:2], digest)


def manifest_name(entry: str) -> str:
    return check_digest(entry, "entry id") + MANIFEST_SUFFIX


def manifest_path(entry: str) -> tuple[str, str]:
    """`manifests/<entry id>.json` relative to the store root."""
    return (MANIFESTS_DIR, manifest_name(entry))


def pending_path(entry: str) -> tuple[str, str]:
    """`pending/<entry id>.json`: an empty marker, durable before the entry's manifest is written and
    removed once every byte the manifest names is durable (`Store.flush`)."""
    return (PENDING_DIR, manifest_name(entry))


def quarantine_path(name: str, copy: int = 0) -> tuple[str, str]:
    """`quarantine/<name>` (`<name>.<copy>` when an earlier one is there); `name` is a manifest name the
    store listed, checked again here."""
    if not is_manifest_name(name):
        raise DigestError(f"not a manifest name: {name[:80]!r}")
    if copy < 0:
        raise ValueError("copy number must not be negative")
    return (QUARANTINE_DIR, name if copy == 0 else f"{name}.{copy}")


def is_manifest_name(name: str) -> bool:
    return name.endswith(MANIFEST_SUFFIX) and is_digest(name[: -len(MANIFEST_SUFFIX)])


def is_quarantine_name(name: str) -> bool:
    """A name the store gives a quarantined manifest (`quarantine_path`): a manifest name, or one with a copy
    number. Any other file in quarantine/ is not the store's, and no policy deletes it."""
    base, _, copy = name.rpartition(".")
    if is_manifest_name(name):
        return True
    return is_manifest_name(base) and copy.isascii() and copy.isdigit() and copy[0] != "0" and len(copy) <= 9


def temp_name(final_name: str, nonce: str) -> str:
    """A temporary sibling of `final_name`; `nonce` (hex from the shell) keeps two writers apart."""
    if not re.fullmatch(r"[0-9a-f]{8,64}", nonce):
        raise ValueError("a temp-file nonce is 8-64 lowercase hex characters")
    return f"{TEMP_PREFIX}{nonce}-{final_name}"


def is_fanout_name(name: str) -> bool:
    """A `segments/` subdirectory: the first two hex characters of the digests inside."""
    return re.fullmatch(r"[0-9a-f]{2}", name) is not None


def is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_PREFIX)
