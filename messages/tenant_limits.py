"""Per-key limits' shared record (issue 20): what the limits bucket (`Subjects.limits_bucket`) holds for each tenant
key with limits, keyed by its key id. Every front door rewrites it by compare-and-set (`runtime/key_limits.py`
computes it, `runtime/shared_limits.py` stores it).

Times are unix seconds of the writing front door's clock. A record expires (its message's own TTL) once it would
read the same as no record: its buckets full again and its leases over.
"""

from __future__ import annotations

import msgspec


class Level(msgspec.Struct, frozen=True, kw_only=True):
    """A token bucket of one rate limit: its `level` at unix time `at` (below zero: tokens owed, a debt)."""

    level: float
    at: float


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """One front door's requests of a key in flight (`n`), counted until `until` unless renewed."""

    n: int
    until: float


class KeyState(msgspec.Struct, frozen=True, kw_only=True):
    """One key's limits as every front door counts them: its requests-per-minute and tokens-per-minute buckets
    (None: the key has no such limit) and each front door's lease, by node id (with a concurrency limit)."""

    rpm: Level | None = None
    tpm: Level | None = None
    doors: dict[str, Lease] = msgspec.field(default_factory=dict)
