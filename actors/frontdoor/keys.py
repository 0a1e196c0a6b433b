"""Tenants' API keys at the front door (front-door core, pure): which keys exist, whether a presented key is one
of them, and what it may see.

Rules this module keeps:

* The table holds what the keys bucket holds (`messages.tenants.TenantKey` by key id), as the shell's watch
  delivers it: `put` a record, `spoil` a key whose record does not decode (it stops working, and still counts as
  a key of the bucket), `remove` a deleted one. Nothing here reads the bucket, the clock or the network.
* A door needs a key when it has an admin key (`--api-key`) or its bucket holds any record. Otherwise it is open
  (what it was before tenant keys): a request without a key passes, and so does any other key a client sends
  (OpenAI's clients always send one) except a tenant key, which is checked even then: a revoked key is refused,
  never silently served as anonymous.
* The admin key opens everything (`authenticate` answers None, as for an open door); a tenant key opens only
  its models (`allows`). A presented tenant key is `mk_<key_id>_<secret>`; its secret's SHA-256 is compared with
  the record's in constant time (`hmac.compare_digest`), an unknown key id against a dummy digest, so timing
  tells an unknown key from a wrong secret no better than the answer does (both: "not valid").
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from typing import Final, Literal

from messages.tenants import TenantKey, split_key

__all__ = [
    "MAX_PRESENTED",
    "KeyRefused",
    "KeyTable",
    "RefusalReason",
    "allows",
    "authenticate",
    "format_key",
    "secret_digest",
]

RefusalReason = Literal["missing", "malformed", "unknown", "wrong_secret", "expired"]

#: The longest key looked at: a tenant key is 84 characters; anything much longer is refused unread.
MAX_PRESENTED: Final = 1024
_DUMMY_DIGEST: Final = "0" * 64

_MESSAGES: Final[dict[RefusalReason, str]] = {
    "missing": "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
    "malformed": "the API key is not valid: neither this node's key nor a tenant key (mk_<key id>_<secret>)",
    "unknown": "the API key is not valid (unknown or revoked)",
    "wrong_secret": "the API key is not valid (unknown or revoked)",  # the same answer: no key id is confirmed
    "expired": "the API key has expired",
}


class KeyRefused(Exception):
    """A request's key does not open the front door: `reason` says why (for the log), the message is the
    client's (it never tells an unknown key from a wrong secret)."""

    def __init__(self, reason: RefusalReason, key_id: str | None = None) -> None:
        super().__init__(_MESSAGES[reason])
        self.reason: RefusalReason = reason
        self.key_id = key_id


def secret_digest(secret: str) -> str:
    """What a record holds of a key's secret: its SHA-256, lowercase hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def format_key(key_id: str, secret: str) -> str:
    """The key a tenant presents (`messages.tenants.KEY_PATTERN`)."""
    return f"mk_{key_id}_{secret}"


class KeyTable:
    """The keys a front door knows, by key id, as its watch of the keys bucket delivers them."""

    def __init__(self) -> None:
        self._keys: dict[str, TenantKey] = {}
        self._spoiled: set[str] = set()  # bucket keys whose record did not decode: no key, but the bucket holds one

    def put(self, key: TenantKey) -> None:
        self._spoiled.discard(key.key_id)
        self._keys[key.key_id] = key

    def spoil(self, bucket_key: str) -> None:
        """The record under `bucket_key` is not a valid key: whatever it held before no longer opens anything."""
        self._keys.pop(bucket_key, None)
        self._spoiled.add(bucket_key)

    def remove(self, bucket_key: str) -> None:
        self._keys.pop(bucket_key, None)
        self._spoiled.discard(bucket_key)

    def clear(self) -> None:
        self._keys.clear()
        self._spoiled.clear()

    @property
    def holds_any(self) -> bool:
        """Whether the bucket holds any record (valid or not): then every request needs a key."""
        return bool(self._keys or self._spoiled)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[TenantKey]:
        return iter(self._keys.values())

    def bound(self, nats_user: str, now: float) -> TenantKey | None:
        """The live key a `client` NATS user is bound to (`TenantKey.nats_users`); None: none, or expired. A user
        bound to several keys is the most recently created one's."""
        live = [
            k for k in self._keys.values() if nats_user in k.nats_users and (k.expires_at is None or now < k.expires_at)
        ]
        return max(live, key=lambda k: (k.created_at, k.key_id), default=None)

    def get(self, key_id: str) -> TenantKey | None:
        return self._keys.get(key_id)

    def check(self, presented: str, now: float) -> TenantKey:
        """The record of the tenant key `presented` at `now` (unix seconds); `KeyRefused` when it is malformed,
        unknown, its secret wrong, or expired."""
        parts = split_key(presented) if len(presented) <= MAX_PRESENTED else None
        if parts is None:
            raise KeyRefused("malformed")
        key_id, secret = parts
        record = self._keys.get(key_id)
        # an unknown key id is compared too (against a dummy), so both refusals cost the same time
        matches = hmac.compare_digest(secret_digest(secret), record.secret_sha256 if record else _DUMMY_DIGEST)
        if record is None:
            raise KeyRefused("unknown", key_id)
        if not matches:
            raise KeyRefused("wrong_secret", key_id)
        if record.expires_at is not None and now >= record.expires_at:
            raise KeyRefused("expired", key_id)
        return record


def _same(presented: str, key: str) -> bool:
    # surrogateescape: a header's undecodable bytes come as lone surrogates, which a plain encode() refuses
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


def authenticate(presented: str | None, *, admin_key: str | None, table: KeyTable, now: float) -> TenantKey | None:
    """What a request presenting `presented` may do: None for everything (the admin key, or an open door), a
    tenant's record for its scope; `KeyRefused` when it may do nothing."""
    if presented is not None and len(presented) > MAX_PRESENTED:
        raise KeyRefused("malformed")
    if admin_key is None and not table.holds_any:  # open: only a tenant key is looked at (a revoked one fails)
        if presented is not None and split_key(presented) is not None:
            return table.check(presented, now)
        return None
    if presented is None:
        raise KeyRefused("missing")
    if admin_key is not None and _same(presented, admin_key):
        return None
    return table.check(presented, now)


def allows(key: TenantKey | None, model: str) -> bool:
    """Whether a request holding `key` (None: the admin key or an open door) may see and use the catalog model
    `model`. A key naming no models may use every one."""
    return key is None or not key.models or model in key.models
