"""Exact-state identity: which saved states a server can restore and continue exactly (pure).

Rules this module keeps:

* Two states share an identity only if everything that shapes their bytes is the same: the model file's
  *content* digest (so a requantized or republished file behind the same name never shares state), the
  llama.cpp build, the K and V cache types, flash attention, unified KV, the per-slot context (`n_ctx_seq`:
  llama.cpp rotates keys with a model's long or short RoPE factors by whether it exceeds the original
  context, and K is cached after the rotation), the number of KV streams (a slot file records it and
  restores only into as many), a full or window-sized SWA cache (a window-sized one keeps only the last
  window's cells), the draft/MTP settings (spec type, draft depth, draft cache types), the payload kind, the
  platform (machine, byte order) and a split's layer layout over nodes. What was considered and left out, and why, is in
  docs/architecture.md ("What the exact-state identity covers").
* Where the state was made is not part of it: there is no node, port or slot field, and decoding refuses
  unknown fields, so such a field cannot slip in from the wire.
* The identity is blake3 over a canonical encoding. Each field is written as its name (length-prefixed) and
  a self-delimiting value: `N` for absent, `B`+byte, `I`+8 bytes, `S`+length+UTF-8, `T`+a nested record.
  The field order is the table `_FIELDS`; every field of every input struct is in it (a test checks).
  So absent differs from empty, and no two different inputs (swapped fields, moved boundaries) encode alike.
"""

from __future__ import annotations

from typing import Final, Literal

import blake3
import msgspec

from actors.l3.layout import check_digest

__all__ = ["DraftSettings", "Platform", "StateInputs", "canonical_encoding", "exact_state_identity"]

# v3 added the per-slot context and the stream count, v4 the split. Entries stored under earlier identities are
# never matched again (their entry ids differ); they stay valid entries of another identity until eviction
# takes them.
_DOMAIN: Final = b"mesh-actor/l3/exact-state-identity/v4\x00"
_INT_LIMIT: Final = 1 << 63


class Platform(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    machine: str  # platform.machine(): x86_64, aarch64, …
    byte_order: Literal["little", "big"]  # sys.byteorder


class DraftSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding as the server runs it; each field None when that setting is absent."""

    spec_type: str | None  # --spec-type (draft-mtp, draft-eagle3, …)
    draft_depth: int | None  # --spec-draft-n-max (the recurrent rollback rows follow it)
    cache_type_k: str | None  # --spec-draft-type-k
    cache_type_v: str | None  # --spec-draft-type-v


class StateInputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the identity covers. No defaults: a caller says "absent" (None) explicitly."""

    model_digest: str  # blake3 of the model file's content (runtime.model_files.FileDigests)
    llama_build: str | None  # /props build_info
    cache_type_k: str | None
    cache_type_v: str | None
    flash_attention: bool | None
    unified_kv: bool | None
    # Cells one slot can use, as llama.cpp resolves -c, -np and -kvu (/props' per-slot n_ctx): above the
    # model's original context it rotates keys with the long RoPE factors, and K is cached rotated.
    n_ctx_seq: int
    n_stream: int  # KV streams (1 unified, else one per slot): a slot file restores only into as many
    swa_full: bool | None  # --swa-full (None: the model has no sliding-window layers)
    draft: DraftSettings | None  # None: no speculative decoding configured
    payload_kind: str
    platform: Platform | None
    # A split over nodes (llama.cpp RPC): each device's [first, last) blocks in device order, the head's first,
    # as "0-4,4-8" (None: the model runs on one node). States are shared only within one layout.
    split: str | None


_Record = StateInputs | DraftSettings | Platform

#: The canonical field order of each record. Changing it changes every identity: bump `_DOMAIN` then.
_FIELDS: Final[dict[type[_Record], tuple[str, ...]]] = {
    StateInputs: (
        "model_digest",
        "llama_build",
        "cache_type_k",
        "cache_type_v",
        "flash_attention",
        "unified_kv",
        "n_ctx_seq",
        "n_stream",
        "swa_full",
        "draft",
        "payload_kind",
        "platform",
        "split",
    ),
    DraftSettings: ("spec_type", "draft_depth", "cache_type_k", "cache_type_v"),
    Platform: ("machine", "byte_order"),
}


def _length(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _value(value: object) -> bytes:
    if value is None:
        return b"N"
    if isinstance(value, bool):  # before int: bool is an int
        return b"B" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise ValueError(f"integer {value} does not fit the identity encoding")
        return b"I" + value.to_bytes(8, "big", signed=True)
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"S" + _length(len(data)) + data
    if isinstance(value, StateInputs | DraftSettings | Platform):
        body = _record(value)
        return b"T" + _length(len(body)) + body
    raise TypeError(f"cannot encode a {type(value).__name__} in an identity")


def _record(record: _Record) -> bytes:
    names = _FIELDS[type(record)]
    parts = [type(record).__name__.encode("ascii"), _length(len(names))]
    for name in names:
        tag = name.encode("ascii")
        parts += [_length(len(tag)), tag, _value(getattr(record, name))]
    return b"".join(parts)


def canonical_encoding(inputs: StateInputs) -> bytes:
    """The bytes the identity hashes (exposed for tests and for `l3 stat` to explain an identity)."""
    check_digest(inputs.model_digest, "model digest")
    return _DOMAIN + _record(inputs)


def scoped_identity(identity: str, scope: str) -> str:
    """The identity a cache scope's states are stored and looked up under: the instance's own for the shared scope
    (""), else blake3 of it and the scope, so no look-up of one scope finds another's states (vLLM's cache salt)."""
    if not scope:
        return identity
    return str(blake3.blake3(b"%s\0scope\0%s" % (identity.encode(), scope.encode())).hexdigest())


def exact_state_identity(inputs: StateInputs) -> str:
    """blake3 (64 lowercase hex) of the canonical encoding of `inputs`."""
    return str(blake3.blake3(canonical_encoding(inputs)).hexdigest())
