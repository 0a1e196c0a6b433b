"""Registry entry signing and verification (placement core, pure: bytes and keys in, verdicts out).

Keys are NATS nkeys (ed25519): a seed (`S…`) signs, a public key (`U…`, `A…`, `O…`, `N…`, `C…`) verifies.
An entry is trusted only when its `public_key` is one of the configured keys, the signature verifies over
the canonical encoding, it is stored under the name it was signed for (so a valid entry for one model
cannot be copied under another model's name), and — when the file can be checked — size and digest match
what was signed.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable

import msgspec
import nacl.exceptions
import nacl.signing
import nkeys

from messages.registry import RegistryEntry

_CANONICAL = msgspec.json.Encoder(order="sorted")


class RegistryUntrusted(ValueError):
    """The entry cannot be trusted; the message says why."""


def signing_payload(entry: RegistryEntry) -> bytes:
    return _CANONICAL.encode(msgspec.structs.replace(entry, signature=""))


def public_key_of(seed: bytes) -> str:
    try:
        return str(nkeys.from_seed(seed.strip()).public_key.decode())
    except (nkeys.NkeysError, binascii.Error, ValueError) as exc:
        raise RegistryUntrusted(f"not an nkey seed: {exc}") from exc


def sign(entry: RegistryEntry, seed: bytes) -> RegistryEntry:
    """The entry with `public_key` and `signature` set by the key whose seed is given."""
    key = nkeys.from_seed(seed.strip())
    unsigned = msgspec.structs.replace(entry, public_key=key.public_key.decode(), signature="")
    signature = key.sign(signing_payload(unsigned))
    return msgspec.structs.replace(unsigned, signature=base64.b64encode(signature).decode())


def _verify_key(public_key: str) -> nacl.signing.VerifyKey:
    text = public_key.strip()
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError) as exc:
        raise RegistryUntrusted(f"public key {public_key!r} is not base32") from exc
    if len(raw) != 35 or not nkeys.valid_public_prefix_byte(raw[0]):
        raise RegistryUntrusted(f"{public_key!r} is not an nkey public key")
    if nkeys.crc16_checksum(raw[:-2]) != raw[-2:]:
        raise RegistryUntrusted(f"public key {public_key!r} has a bad checksum")
    return nacl.signing.VerifyKey(raw[1:-2])


def check_public_key(public_key: str) -> str:
    """Returns the key if it is a well-formed nkey public key; raises RegistryUntrusted otherwise."""
    _verify_key(public_key)
    return public_key.strip()


def verify(entry: RegistryEntry, trusted: Iterable[str], *, stored_as: str | None = None) -> None:
    """Raises RegistryUntrusted unless a trusted key signed exactly this entry (and, given `stored_as`, the
    registry key it was read from, signed it for that name)."""
    if stored_as is not None and entry.name != stored_as:
        raise RegistryUntrusted(
            f"registry entry stored as {stored_as!r} was signed for {entry.name!r}: an entry is only trusted "
            "under its own name"
        )
    if not entry.signature:
        raise RegistryUntrusted(f"registry entry {entry.name!r} is unsigned")
    if entry.public_key not in set(trusted):
        raise RegistryUntrusted(
            f"registry entry {entry.name!r} is signed by {entry.public_key}, which is not a trusted registry key"
        )
    try:
        signature = base64.b64decode(entry.signature, validate=True)
        _verify_key(entry.public_key).verify(signing_payload(entry), signature)
    except (binascii.Error, ValueError, nacl.exceptions.BadSignatureError) as exc:
        raise RegistryUntrusted(
            f"registry entry {entry.name!r} does not match its signature (tampered with or corrupt)"
        ) from exc


def check_file(entry: RegistryEntry, *, size: int, digest: str | None) -> None:
    """Raises RegistryUntrusted when the file at hand is not the one the entry was signed for."""
    if size != entry.size_bytes:
        raise RegistryUntrusted(
            f"the file is {size} bytes but registry entry {entry.name!r} was signed for {entry.size_bytes} bytes"
        )
    if digest is not None and digest != entry.blake3:
        raise RegistryUntrusted(
            f"the file's blake3 {digest[:16]}… differs from registry entry {entry.name!r} ({entry.blake3[:16]}…)"
        )
