"""What the runner asks of its node's L3 (an in-process interface: a state file never crosses the bus locally).

The runner owns its servers' slots; the node's L3 actor owns the store. Its users ask four things:

* `lookup(identity, tokens, max_tokens=...)`: the longest stored prefix of `tokens` (at most `max_tokens`
  long) that this node can restore, from its own store (`l3_local`) or a peer's inventory (`l3_peer`); None
  when nothing is held. Cheap (no disk read), bounded probes.
* `materialize(hit, dest, deadline_s=...)`: writes the hit's payload to `dest` (a file in the instance's
  `--slot-save-path`), verified against its manifest before it is renamed into place; fetches it from the
  peer first for an `l3_peer` hit. Single-flight per entry: a second caller waits for the first fill. Raises
  `L3Unavailable` (with a reason) when it cannot, leaving no file at `dest`.
* `capture(source, identity=..., tokens=..., payload_kind=...)`: hands over a saved slot file for ingest
  in the background; never blocks the reply and never raises. The L3 side owns `source` from then on (it
  deletes it once ingested, or when it refuses it).
* `store(source, …)`: the same hand-over, awaiting its `CaptureOutcome`: the entry id once it is loadable
  here, or why it was dropped (queue full, over budget, capture off, eviction blocked, stopping). A caller
  that needs the state kept (a handoff into this node) learns at once that it was not; the caller's own
  deadline bounds the wait, and giving up does not cancel the capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import msgspec

from messages.l3 import PrefixSource

__all__ = ["CaptureOutcome", "L3Access", "L3Hit", "L3Unavailable"]


class L3Hit(msgspec.Struct, frozen=True, kw_only=True):
    entry: str
    n_tokens: int
    bytes: int
    node: str  # the node whose store holds it
    source: PrefixSource  # l3_local or l3_peer


class CaptureOutcome(msgspec.Struct, frozen=True, kw_only=True):
    entry: str | None  # the stored entry's id; None: dropped
    reason: str = ""  # why it was dropped (the `l3_capture_dropped` reason)

    @property
    def stored(self) -> bool:
        return self.entry is not None


class L3Unavailable(Exception):
    """A hit could not be materialized (evicted meanwhile, corrupt, peer gone or stalled); go cold."""


class L3Access(Protocol):
    async def lookup(self, identity: str, tokens: Sequence[int], *, max_tokens: int) -> L3Hit | None: ...

    async def materialize(self, hit: L3Hit, dest: Path, *, deadline_s: float) -> None: ...

    def capture(self, source: Path, *, identity: str, tokens: Sequence[int], payload_kind: str) -> None: ...

    async def store(
        self, source: Path, *, identity: str, tokens: Sequence[int], payload_kind: str
    ) -> CaptureOutcome: ...
