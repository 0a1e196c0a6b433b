"""The commit check: whether a manifest may exist, given what was observed of its payload (pure).

Rules this module keeps:

* Nothing partial is ever loadable. A manifest is written only after `validate` accepted it against the
  segments as they were really stored (index, offset, length and blake3 of the stored bytes) and the
  payload digest recomputed from those (`layout.payload_root`); nothing a peer or a caller *claims* is trusted.
* A manifest tiles its payload exactly: segment i is at position i, starts where segment i-1 ended (the first
  at 0), is not empty, and the lengths add up to `total_bytes`. No gap, overlap, duplicate or reorder passes.
* The rules are the tables `_MANIFEST_RULES` (the manifest alone) and `_OBSERVED_RULES` (against what was
  observed), checked in order; the first that fails is the `ManifestRefusal`, naming its `Rule`. `None` means valid.
* The same rules judge a manifest read back at startup (`check_manifest`, `check_present`), so a file that
  was tampered with or half-written by something else is refused, not loaded.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import msgspec

from actors.l3.layout import (
    MANIFEST_VERSION,
    MAX_SEGMENT_BYTES,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    Manifest,
    SegmentRef,
    is_digest,
    is_payload_kind,
)

__all__ = ["ManifestRefusal", "Rule", "check_manifest", "check_present", "validate"]


class Rule(enum.Enum):
    VERSION = "version"  # a manifest format this code does not know
    IDENTITY = "identity"  # identity is not a digest
    PAYLOAD_KIND = "payload_kind"
    TOKENS = "tokens"  # n_tokens differs from the list, too many, or an id out of range
    DIGEST_SYNTAX = "digest_syntax"  # a segment or payload digest is not 64 lowercase hex
    INDEX = "index"  # segment index differs from its position
    OFFSET = "offset"  # segment offset differs from the running sum of lengths (a gap or an overlap)
    LENGTH = "length"  # a segment is empty or larger than any segment size
    TOTAL = "total"  # the lengths do not add up to total_bytes
    SEGMENT_COUNT = "segment_count"  # observed a different number of segments than the manifest names
    SEGMENT_MISMATCH = "segment_mismatch"  # an observed segment differs (index, offset, length or digest)
    PAYLOAD_DIGEST = "payload_digest"  # the re-hashed payload differs from the manifest's digest
    SEGMENT_MISSING = "segment_missing"  # a named segment is not in the store
    SEGMENT_SIZE = "segment_size"  # a stored segment's size differs from its length
    SEGMENT_UNREADABLE = "segment_unreadable"  # a stored segment cannot be read (an I/O error, not a file)


class ManifestRefusal(msgspec.Struct, frozen=True, kw_only=True):
    rule: Rule
    detail: str
    index: int | None = None  # the segment concerned, where there is one


_Check = Callable[[Manifest], ManifestRefusal | None]


def _version(m: Manifest) -> ManifestRefusal | None:
    if m.version != MANIFEST_VERSION:
        return ManifestRefusal(rule=Rule.VERSION, detail=f"manifest version {m.version}, expected {MANIFEST_VERSION}")
    return None


def _identity(m: Manifest) -> ManifestRefusal | None:
    return (
        None if is_digest(m.identity) else ManifestRefusal(rule=Rule.IDENTITY, detail="identity is not a blake3 digest")
    )


def _payload_kind(m: Manifest) -> ManifestRefusal | None:
    if is_payload_kind(m.payload_kind):
        return None
    return ManifestRefusal(rule=Rule.PAYLOAD_KIND, detail="payload kind must be 1-32 of [a-z0-9_]")


def _tokens(m: Manifest) -> ManifestRefusal | None:
    if m.n_tokens != len(m.tokens):
        return ManifestRefusal(
            rule=Rule.TOKENS, detail=f"n_tokens is {m.n_tokens} but {len(m.tokens)} token ids are listed"
        )
    if len(m.tokens) > MAX_TOKENS:
        return ManifestRefusal(rule=Rule.TOKENS, detail=f"more than {MAX_TOKENS} tokens")
    if any(not 0 <= t <= MAX_TOKEN_ID for t in m.tokens):
        return ManifestRefusal(rule=Rule.TOKENS, detail="a token id is outside [0, 2^31)")
    return None


def _digests(m: Manifest) -> ManifestRefusal | None:
    if not is_digest(m.payload_digest):
        return ManifestRefusal(rule=Rule.DIGEST_SYNTAX, detail="payload digest is not a blake3 digest")
    for position, seg in enumerate(m.segments):
        if not is_digest(seg.digest):
            return ManifestRefusal(
                rule=Rule.DIGEST_SYNTAX, detail="segment digest is not a blake3 digest", index=position
            )
    return None


def _tiling(m: Manifest) -> ManifestRefusal | None:
    running = 0
    for position, seg in enumerate(m.segments):
        if seg.index != position:
            return ManifestRefusal(
                rule=Rule.INDEX, detail=f"segment at position {position} says index {seg.index}", index=position
            )
        if seg.offset != running:
            kind = "gap" if seg.offset > running else "overlap"
            return ManifestRefusal(
                rule=Rule.OFFSET,
                detail=f"{kind}: offset {seg.offset}, previous segments end at {running}",
                index=position,
            )
        if not 0 < seg.length <= MAX_SEGMENT_BYTES:
            return ManifestRefusal(rule=Rule.LENGTH, detail=f"segment length {seg.length}", index=position)
        running += seg.length
    if running != m.total_bytes:
        return ManifestRefusal(
            rule=Rule.TOTAL, detail=f"segments add up to {running} bytes, total_bytes is {m.total_bytes}"
        )
    return None


_MANIFEST_RULES: Final[tuple[_Check, ...]] = (_version, _identity, _payload_kind, _tokens, _digests, _tiling)


def check_manifest(manifest: Manifest) -> ManifestRefusal | None:
    """The manifest's own rules: format, identity, tokens, digest syntax, exact tiling of total_bytes."""
    for rule in _MANIFEST_RULES:
        refusal = rule(manifest)
        if refusal is not None:
            return refusal
    return None


def validate(
    manifest: Manifest, observed_segments: Sequence[SegmentRef], payload_digest: str
) -> ManifestRefusal | None:
    """Whether `manifest` may be committed: its own rules, then each observed segment (as stored, hashed
    from its bytes) equal to the one it names, and the payload re-hashed from those bytes equal to its digest."""
    refusal = check_manifest(manifest)
    if refusal is not None:
        return refusal
    if len(observed_segments) != len(manifest.segments):
        return ManifestRefusal(
            rule=Rule.SEGMENT_COUNT,
            detail=f"observed {len(observed_segments)} segments, the manifest names {len(manifest.segments)}",
        )
    for position, (named, seen) in enumerate(zip(manifest.segments, observed_segments, strict=True)):
        if named != seen:
            return ManifestRefusal(rule=Rule.SEGMENT_MISMATCH, detail=f"named {named}, observed {seen}", index=position)
    if payload_digest != manifest.payload_digest:
        return ManifestRefusal(
            rule=Rule.PAYLOAD_DIGEST, detail="the re-hashed payload differs from the manifest's digest"
        )
    return None


def check_present(manifest: Manifest, stored_sizes: Mapping[str, int]) -> ManifestRefusal | None:
    """The manifest's own rules, then every segment it names present in the store with its length
    (`stored_sizes`: digest -> size of the stored file). Content is not re-hashed here (`validate` does)."""
    refusal = check_manifest(manifest)
    if refusal is not None:
        return refusal
    for position, seg in enumerate(manifest.segments):
        size = stored_sizes.get(seg.digest)
        if size is None:
            return ManifestRefusal(
                rule=Rule.SEGMENT_MISSING, detail=f"segment {seg.digest[:16]}… is not stored", index=position
            )
        if size != seg.length:
            return ManifestRefusal(
                rule=Rule.SEGMENT_SIZE, detail=f"stored {size} bytes, expected {seg.length}", index=position
            )
    return None
