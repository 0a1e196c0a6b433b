"""Per-key limits shared by every front door (front-door shell): each limited key's record (`limits.KeyState`) lives
in the JetStream KV bucket `<PREFIX>_LIMITS` (in memory), and every change to it is a compare-and-set (a publish
that expects the key's last revision), so the front doors of every node count against one record.

The request's path: `admit` computes the next record from the last one this front door wrote or read (kept with
its revision, so the common case is one round trip: the write) and writes it; another front door's write in
between makes the write fail, and the record is read again and recomputed (at most `MAX_TRIES` times, within
`ADMIT_DEADLINE_S`). A refusal computed from the kept record is checked against a fresh read before it is
answered. `release` only counts (no I/O, safe in a `finally` of a cancelled request): the request's tokens are
owed, its in-flight count drops, and the flusher (`run`) writes both `FLUSH_LINGER_S` later, unless an admission
of the same key on this front door wrote them first (an admission charges what is owed and sets this door's
count in the same write: while a key is busy, one write per request). So this front door never admits on what it
has not written. The flusher also renews this front door's lease of each key it has requests of in flight (every
`LEASE_S / 3`).

How exact it is:

* Requests per minute: exact across front doors. Every admission is a compare-and-set of the key's one record:
  two front doors never both take the last token.
* Tokens per minute: a request's tokens are charged when its answer is complete (they are not known before), so
  requests admitted together can all run and overdraw the bucket (a debt that refuses later requests until it
  is refilled). The charge reaches the record within `FLUSH_LINGER_S` (50 ms) of the answer, plus a round trip;
  until then only this front door knows it. A request whose client left before the answer was complete is
  charged what the server did all the same (the prompt and the tokens generated until it stopped).
* Concurrent requests: admissions are serialized by the same compare-and-set, so the sum of front doors' counts
  never exceeds the limit. A release reaches the record up to `FLUSH_LINGER_S` after the answer: another front
  door may refuse in that moment (never admit too many). A front door that crashes, or is cut from NATS, keeps
  its count until its lease ends (`LEASE_S`); past that its requests, if it still serves them, are no longer
  counted.
* Time is each front door's wall clock (unix seconds): rates are as exact as the nodes' clocks agree (NTP);
  a clock behind the record's refills nothing until it catches up.
* The bucket is kept in memory: if every NATS server restarts, every key starts full.

When NATS is unavailable (not connected, no answer within the deadline, the bucket cannot be opened): `admit`
raises `LimitsUnavailable` (the front door answers 503 with Retry-After: a key with limits is not served
unlimited); what `release` counted stays owed and is written once the bus is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from messages.subjects import Subjects
from messages.tenants import TenantKey
from runtime import buckets
from runtime import key_limits as limits
from runtime.buckets import TTL_HEADER
from runtime.bus import Bus
from runtime.key_limits import KeyState, Refused
from runtime.logging import get_logger

__all__ = ["ADMIT_DEADLINE_S", "LEASE_S", "MAX_TRIES", "LimitsUnavailable", "SharedLimits"]

#: How long a front door's in-flight count of a key is counted without being renewed.
LEASE_S: Final = 15.0
#: The longest an admission waits for the bucket (reads, writes and retries together).
ADMIT_DEADLINE_S: Final = 2.0
#: The most compare-and-set attempts of one change (each lost to another front door's write).
MAX_TRIES: Final = 16
#: The longest the flusher waits for one key's write.
FLUSH_DEADLINE_S: Final = 5.0
#: How long a release waits to be written: a request of the same key admitted on this front door meanwhile writes
#: it with its own admission (one write per request instead of two while a key is busy).
FLUSH_LINGER_S: Final = 0.05
#: How long a key nobody used is kept in this front door's memory (its record and revision).
FORGET_S: Final = 600.0
#: A record outlives what `limits.expires_in` says by this much (other front doors' clocks may be behind).
_TTL_SLACK_S: Final = 60
_EXPECTED_LAST: Final = "Nats-Expected-Last-Subject-Sequence"
_WRONG_LAST: Final = 10071  # JetStream: the subject's last sequence is not the one expected

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(KeyState).decode


class LimitsUnavailable(Exception):
    """The limits bucket could not be read or written in time (NATS away, or the key contended past its tries)."""


class _Key:
    """What this front door holds of one key: the last record it wrote or read, and what it has not written yet."""

    __slots__ = ("changes", "in_flight", "key", "lock", "owed", "record", "renew_at", "revision", "used_at", "written")

    def __init__(self, key: TenantKey, now: float) -> None:
        self.key = key
        self.in_flight = 0  # this front door's admitted requests of the key, not yet released
        self.owed = 0  # tokens of answered requests not yet charged to the record
        self.record: KeyState | None = None
        self.revision: int | None = None  # of `record`; None: read the record before writing
        self.lock = asyncio.Lock()  # one change of the record at a time from this front door
        self.renew_at = math.inf
        self.used_at = now
        self.changes = 0  # releases counted so far
        self.written = 0  # of them, those the last write of the record included


Decide = Callable[[KeyState | None, int, float], KeyState | Refused]


class SharedLimits:
    """One front door's side of the shared limits: `admit` before a request of a limited key, `release` after it,
    `run` (the flusher) for as long as the front door runs."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        node: str,
        *,
        clock: Callable[[], float] = time.time,
        lease_s: float = LEASE_S,
        log: Any = None,
    ) -> None:
        self._bus = bus
        self._subjects = subjects
        self._node = node
        self._clock = clock
        self._lease_s = lease_s
        self._log = log or get_logger(component="limits", node=node)
        self._kv: KeyValue | None = None
        self._keys: dict[str, _Key] = {}
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._failing = False

    # --- the request's path ------------------------------------------------------------------------------------

    async def admit(self, key: TenantKey) -> Refused | None:
        """Counts one more request of `key` (None), or says why it is refused. Raises `LimitsUnavailable`."""
        if not limits.limited(key):
            return None
        now = self._clock()
        entry = self._keys.get(key.key_id)
        if entry is None:
            entry = self._keys[key.key_id] = _Key(key, now)
        entry.key, entry.used_at = key, now

        def decide(record: KeyState | None, owed: int, now: float) -> KeyState | Refused:
            return limits.admit(
                record, key, node=self._node, in_flight=entry.in_flight, tokens=owed, now=now, lease_s=self._lease_s
            )

        outcome = await self._commit(entry, decide, ADMIT_DEADLINE_S)
        if isinstance(outcome, Refused):
            return outcome
        entry.in_flight += 1
        return None

    def release(self, key: TenantKey, tokens: int) -> None:
        """The end of a request `admit` counted: its `tokens` (prompt + generated) are owed to the key's tokens per
        minute and its in-flight count drops; the flusher writes both. No I/O: safe where a request is cancelled."""
        entry = self._keys.get(key.key_id)
        if entry is None or not limits.limited(key):
            return
        entry.in_flight = max(0, entry.in_flight - 1)
        entry.used_at = self._clock()
        if key.tpm is not None:
            entry.owed += max(0, tokens)
        if (key.tpm is not None and tokens > 0) or key.max_concurrent is not None:
            entry.changes += 1
            self._dirty.add(key.key_id)
            self._wake.set()

    # --- the flusher ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Writes what `release` counted as it comes, and renews this front door's leases; at its end, one last
        flush (within a deadline)."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._lease_s / 3):
                        await self._wake.wait()
                        await asyncio.sleep(FLUSH_LINGER_S)  # an admission may write it first
                self._wake.clear()
                await self.flush()
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self.flush()

    async def flush(self) -> None:
        """Writes every key with something owed or released, and renews the leases that are due."""
        now = self._clock()
        due = self._dirty | {
            k for k, e in self._keys.items() if e.in_flight and e.key.max_concurrent and now >= e.renew_at
        }
        self._dirty = set()
        failed = None
        for key_id in sorted(due):
            entry = self._keys[key_id]
            if entry.written == entry.changes and now < entry.renew_at:
                continue  # an admission wrote it meanwhile

            def decide(record: KeyState | None, owed: int, now: float, entry: _Key = entry) -> KeyState | Refused:
                return limits.settle(
                    record, entry.key, node=self._node, in_flight=entry.in_flight, tokens=owed, now=now,
                    lease_s=self._lease_s,
                )  # fmt: skip

            try:
                await self._commit(entry, decide, FLUSH_DEADLINE_S)
            except LimitsUnavailable as exc:
                self._dirty.add(key_id)  # again at the next pass
                failed = str(exc)
        if failed is not None and not self._failing:
            self._log.warning("limits_flush_failed", error=failed, pending=len(self._dirty))
        elif failed is None and self._failing:
            self._log.info("limits_flush_recovered")
        self._failing = failed is not None
        idle = [k for k, e in self._keys.items() if not e.in_flight and not e.owed and now - e.used_at > FORGET_S]
        for key_id in idle:
            if key_id not in self._dirty:
                del self._keys[key_id]

    # --- the bucket ----------------------------------------------------------------------------------------------

    async def _commit(self, entry: _Key, decide: Decide, deadline_s: float) -> KeyState | Refused:
        """`decide`'s next record written over the last by compare-and-set (read again and decided again when
        another front door wrote first), or its refusal computed from a fresh read."""
        try:
            async with asyncio.timeout(deadline_s):
                async with entry.lock:
                    return await self._commit_locked(entry, decide)
        except TimeoutError as exc:  # nats-py's own timeouts are TimeoutErrors too
            self._kv = None
            raise LimitsUnavailable(f"the limits store did not answer within {deadline_s:g}s") from exc
        except nats.errors.Error as exc:
            self._kv = None  # opened again next time: a bucket in memory is gone when its servers restarted
            raise LimitsUnavailable(f"the limits store failed: {exc or type(exc).__name__}") from exc

    async def _commit_locked(self, entry: _Key, decide: Decide) -> KeyState | Refused:
        key_id = entry.key.key_id
        for attempt in range(MAX_TRIES):
            if not self._bus.nc.is_connected:
                raise LimitsUnavailable("this node is not connected to NATS")
            fresh = entry.revision is None
            if entry.revision is None:
                entry.record, entry.revision = await self._read(key_id)
            owed, changes = entry.owed, entry.changes
            now = self._clock()
            outcome = decide(entry.record, owed, now)
            if isinstance(outcome, Refused):
                if fresh:
                    return outcome
                entry.revision = None  # refused on what this front door last knew: ask the bucket first
                continue
            ttl = _TTL_SLACK_S + math.ceil(limits.expires_in(outcome, entry.key, now))
            try:
                revision = await self._write(key_id, outcome, entry.revision, ttl)
            except nats.js.errors.APIError as exc:
                if exc.err_code != _WRONG_LAST:
                    raise
                entry.revision = None  # another front door wrote first
                if attempt >= 2:  # several front doors in step: spread them out
                    await asyncio.sleep(random.uniform(0, 0.001 * attempt))
                continue
            entry.record, entry.revision = outcome, revision
            entry.owed -= owed
            entry.written = changes
            entry.renew_at = now + self._lease_s / 3
            return outcome
        raise LimitsUnavailable(f"the limits of key {key_id} changed under {MAX_TRIES} tries in a row")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await buckets.limits(self._bus, self._subjects)
        return self._kv

    async def _read(self, key_id: str) -> tuple[KeyState | None, int]:
        """The key's record and its revision (0 when it has none: the write then expects no record)."""
        kv = await self._bucket()
        try:
            entry = await kv.get(key_id)
        except nats.js.errors.KeyNotFoundError as exc:  # none, or a delete marker (whose revision is the last)
            marker = exc.entry
            return None, int(marker.revision) if marker is not None and marker.revision else 0
        try:
            return _decode(entry.value or b""), int(entry.revision or 0)
        except msgspec.DecodeError as exc:  # written by something else: it is replaced
            self._log.warning("limits_record_unreadable", key_id=key_id, error=str(exc))
            return None, int(entry.revision or 0)

    async def _write(self, key_id: str, record: KeyState, revision: int, ttl_s: int) -> int:
        await self._bucket()
        ack = await self._bus.js.publish(
            f"$KV.{self._subjects.limits_bucket}.{key_id}", _encode(record),
            headers={_EXPECTED_LAST: str(revision), TTL_HEADER: f"{ttl_s}s"},
        )  # fmt: skip
        return int(ack.seq)
