"""Tenants' API keys (issue 20): what the keys bucket holds, one record per key, keyed by its id.

A key is `mk_<key_id>_<secret>`: `key_id` (16 lowercase hex) names the record, `secret` (64 lowercase hex, 256
random bits) is shown once by `mesh-actor keys issue` and never stored; the record holds its SHA-256
(`secret_sha256`), compared in constant time. A key with 256 random bits needs no slow hash: nothing can be
guessed from its digest. Revoking a key deletes its record; every front door follows the bucket (a watch), so a
revoked or changed key takes effect there as soon as the watch delivers it.

`priority`: the request's class in a model's queue (higher first, 0-9); `weight`: its tenant's share within the
class (weighted fair queueing by token cost). `rpm`, `tpm`, `max_concurrent`: limits per key (None: none).
"""

from __future__ import annotations

import re
from typing import Annotated, Final

import msgspec

KEY_ID_PATTERN: Final = r"^[0-9a-f]{16}$"
TENANT_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}$"
KEY_PATTERN: Final = re.compile(r"^mk_([0-9a-f]{16})_([0-9a-f]{64})$")
MAX_PRIORITY: Final = 9

Positive = Annotated[int, msgspec.Meta(ge=1)]


class TenantKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    key_id: Annotated[str, msgspec.Meta(pattern=KEY_ID_PATTERN)]
    tenant: Annotated[str, msgspec.Meta(pattern=TENANT_PATTERN)]
    secret_sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    created_at: Annotated[float, msgspec.Meta(ge=0)]  # unix seconds
    models: tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=256)], ...] = ()  # empty: every model
    priority: Annotated[int, msgspec.Meta(ge=0, le=MAX_PRIORITY)] = 0
    weight: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 1.0
    rpm: Positive | None = None  # requests per minute
    tpm: Positive | None = None  # tokens (prompt + generated) per minute
    max_concurrent: Positive | None = None
    expires_at: Annotated[float, msgspec.Meta(ge=0)] | None = None  # unix seconds; None: never
    # Whose prompt states the key's requests may reuse (held in slots, stored in L3): the keys of one group share
    # them; "" (the default): its tenant's keys only. Another scope's states are never reused, so a right guess
    # of another tenant's prompt is not told by its cached tokens or its speed.
    cache_group: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{0,64}$")] = ""
    # The `client` NATS users whose `mesh.generate` requests are this key's (`mesh-actor keys issue --client-user`):
    # held to its models, class, share and cache scope. A client user bound to no key generates nothing.
    nats_users: tuple[Annotated[str, msgspec.Meta(pattern=r"^client-[A-Za-z0-9_-]{1,120}$")], ...] = ()


def cache_scope(key: TenantKey) -> str:
    """The cache scope of a key's requests: its group's, else its tenant's (`GenerateRequest.cache_scope`)."""
    return f"group:{key.cache_group}" if key.cache_group else f"tenant:{key.tenant}"


def split_key(presented: str) -> tuple[str, str] | None:
    """`(key_id, secret)` of a tenant key as presented; None when it is not one (an admin key, garbage)."""
    match = KEY_PATTERN.match(presented)
    return (match.group(1), match.group(2)) if match else None
