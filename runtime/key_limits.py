"""Per-key limits (runtime core, pure; front doors and routers count against them): requests and tokens per
minute as token buckets, and concurrent requests as each front door's in-flight count under a lease; one record
per key (`messages.tenant_limits.KeyState`), which the shell (`shared_limits`) keeps in a shared bucket and rewrites by
compare-and-set, so every front door computes from the same record.

Rules this module keeps:

* A rate is a token bucket (`Level`): capacity N per minute, refilled continuously at N/60 per second, full when
  first seen. `advance` brings a bucket to `now`; it refills nothing when `now` is behind the bucket's `at` (a node
  whose clock is behind another's), so a level never jumps back.
* Requests per minute (`rpm`): one token is taken when a request is admitted; refused while the level is below 1.
* Tokens per minute (`tpm`): a request's tokens (prompt + generated) are only known once it is answered, so nothing
  is taken at admission; the tokens are charged afterwards (`settle`) and may take the level below zero (a debt);
  a request is refused while the level is below zero.
* Concurrency (`max_concurrent`): each front door keeps its own count of the key's requests in flight (`Lease`,
  keyed by its node) with an expiry (`until`): the sum of unexpired counts, plus the one asking, must stay within
  the limit. A front door that stops renewing (it crashed, or lost the bus) stops counting at its lease's end.
* A refusal (`Refused`) names the limit and says when a retry can pass (`retry_after_s`: whole seconds, at least
  1): for a rate, when the bucket will have refilled enough; for concurrency, 1 (a release cannot be foreseen).
  When several limits refuse, the one that lasts longest is named.
* No clock and no I/O: `now` (unix seconds, shared by the front doors' clocks) is passed in.
"""

from __future__ import annotations

import math
from typing import Final, Literal

import msgspec

from messages.tenant_limits import KeyState, Lease, Level
from messages.tenants import TenantKey

__all__ = [
    "KeyState",
    "Lease",
    "Level",
    "Limit",
    "Refused",
    "admit",
    "advance",
    "expires_in",
    "limited",
    "settle",
    "take",
]

Limit = Literal["rpm", "tpm", "max_concurrent"]

#: How each limit is named to a client.
_NAMES: Final[dict[Limit, str]] = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "max_concurrent": "concurrent requests",
}


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    limit: Limit
    retry_after_s: int
    message: str


def limited(key: TenantKey) -> bool:
    """Whether the key has any limit (a key without one never touches the shared bucket)."""
    return key.rpm is not None or key.tpm is not None or key.max_concurrent is not None


def advance(bucket: Level | None, per_minute: int, now: float) -> Level:
    """The bucket refilled up to `now` (a full one when there was none), never above its capacity."""
    if bucket is None:
        return Level(level=float(per_minute), at=now)
    if now <= bucket.at:
        return bucket
    level = min(float(per_minute), bucket.level + (now - bucket.at) * per_minute / 60.0)
    return Level(level=level, at=now)


def take(bucket: Level | None, per_minute: int, now: float, amount: float, *, floor: float) -> Level | float:
    """`amount` taken from the bucket advanced to `now` when its level is at least `floor`; otherwise the seconds
    until it will be (the caller refuses)."""
    current = advance(bucket, per_minute, now)
    if current.level >= floor:
        return Level(level=current.level - amount, at=current.at)
    return (floor - current.level) * 60.0 / per_minute


def settle(
    state: KeyState | None,
    key: TenantKey,
    *,
    node: str,
    in_flight: int,
    tokens: int,
    now: float,
    lease_s: float,
) -> KeyState:
    """The record brought up to `now`: rate buckets advanced (dropped where the key has no such limit), `tokens`
    charged to its tokens per minute (into debt if need be), this front door's lease set to its `in_flight`
    requests (gone at 0; only counted with a concurrency limit), expired leases of others dropped."""
    state = state or KeyState()
    rpm = advance(state.rpm, key.rpm, now) if key.rpm is not None else None
    tpm = None
    if key.tpm is not None:
        tpm = advance(state.tpm, key.tpm, now)
        if tokens:
            tpm = Level(level=tpm.level - tokens, at=tpm.at)
    doors = {}
    if key.max_concurrent is not None:
        doors = {door: lease for door, lease in state.doors.items() if door != node and lease.until > now}
        if in_flight > 0:
            doors[node] = Lease(n=in_flight, until=now + lease_s)
    return KeyState(rpm=rpm, tpm=tpm, doors=doors)


def admit(
    state: KeyState | None,
    key: TenantKey,
    *,
    node: str,
    in_flight: int,
    tokens: int,
    now: float,
    lease_s: float,
) -> KeyState | Refused:
    """One more request of `key` on this front door (which has `in_flight` of them already, and `tokens` not yet
    charged): the record with it counted (a token of its requests per minute taken, its lease one higher), or why
    it is refused."""
    current = settle(state, key, node=node, in_flight=in_flight, tokens=tokens, now=now, lease_s=lease_s)
    waits: list[tuple[float, Limit, str]] = []
    rpm = current.rpm
    if key.rpm is not None:
        taken = take(current.rpm, key.rpm, now, 1.0, floor=1.0)
        if isinstance(taken, Level):
            rpm = taken
        else:
            waits.append((taken, "rpm", f"limit {key.rpm}"))
    if key.tpm is not None and current.tpm is not None and current.tpm.level < 0:
        debt = -current.tpm.level
        waits.append((debt * 60.0 / key.tpm, "tpm", f"limit {key.tpm}, {math.ceil(debt)} tokens over"))
    if key.max_concurrent is not None:
        others = sum(lease.n for door, lease in current.doors.items() if door != node)
        if others + in_flight + 1 > key.max_concurrent:
            waits.append((1.0, "max_concurrent", f"limit {key.max_concurrent}, {others + in_flight} in flight"))
    if waits:
        seconds, limit, detail = max(waits, key=lambda w: w[0])
        retry = max(1, math.ceil(seconds - 1e-9))
        message = (
            f"rate limit reached for {_NAMES[limit]} ({limit}: {detail}) on key {key.key_id} of tenant "
            f"{key.tenant}; retry after {retry} s"
        )
        return Refused(limit=limit, retry_after_s=retry, message=message)
    doors = dict(current.doors)
    if key.max_concurrent is not None:
        doors[node] = Lease(n=in_flight + 1, until=now + lease_s)
    return KeyState(rpm=rpm, tpm=current.tpm, doors=doors)


def expires_in(state: KeyState, key: TenantKey, now: float) -> float:
    """How long the record must outlive its last write: until its buckets are full again (a debt included) and
    its leases are over. Past that, a missing record reads the same as this one (everything full, nobody in
    flight), so the shell lets the bucket forget it."""
    seconds = 0.0
    for bucket, per_minute in ((state.rpm, key.rpm), (state.tpm, key.tpm)):
        if bucket is not None and per_minute is not None:
            seconds = max(seconds, (per_minute - bucket.level) * 60.0 / per_minute + max(0.0, bucket.at - now))
    for lease in state.doors.values():
        seconds = max(seconds, lease.until - now)
    return seconds
