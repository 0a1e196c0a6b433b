"""Signed model registry entries: a model's header facts bound to its file, signed with an ed25519 nkey.

An entry lets placement admit a model that is not on the placement node. Placement trusts an entry only
when it is signed by one of its configured public keys and, when the file is present, when the file's
size and blake3 digest are the ones signed. The signature covers every field but `signature`, encoded
as JSON with sorted keys.
"""

from __future__ import annotations

import msgspec

from messages.model import ModelGeometry


class RegistryEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    file_name: str
    size_bytes: int
    blake3: str  # hex digest of the whole file
    geometry: ModelGeometry
    created_at: float
    public_key: str  # the nkey (ed25519) public key that signed it
    signature: str = ""  # base64 of the ed25519 signature
