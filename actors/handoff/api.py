"""What the runner asks of its node's handoff actor (an in-process interface, like `actors/l3/api.py`: a
prefilled state is a file on this node, which crosses the bus only to the peer that decodes it).

* `send(peer, source, identity=..., n_tokens=..., ...)`: streams a saved slot state (a finished file, or an
  async iterator of segment bytes with `max_bytes`) to `peer`'s handoff actor and waits for its result, the
  peer's restore included. Returns a `HandoffReport`; raises `HandoffFailed` (the sender core's reason and a
  detail) when it did not commit.

The runner's shell imports this module, never the handoff actor's shell; the launcher wires the actor in.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Sequence
from pathlib import Path
from typing import Protocol

import msgspec

__all__ = ["HandoffAccess", "HandoffFailed", "HandoffReport"]


class HandoffFailed(Exception):
    """A send did not commit: `reason` is the sender core's (`sender.SendReason`) and `detail` says why."""

    def __init__(self, reason: str, detail: str, *, session: str = "") -> None:
        super().__init__(f"handoff {reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.session = session


class HandoffReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a send moved, and how long it took."""

    session: str
    peer: str
    bytes: int
    segments: int
    payload_digest: str
    transfer_ms: float  # open to result, the receiver's restore included
    restored: str | None
    restore_ms: float
    transport: str = "nats"  # the path the chunks took: `direct`, `direct_tls` (mutual TLS) or `nats`
    fallback: str = ""  # why NATS carried them, when the direct path was asked for and could not be opened


class HandoffAccess(Protocol):
    async def send(
        self,
        peer: str,
        source: Path | AsyncIterable[bytes],
        *,
        identity: str,
        n_tokens: int,
        tokens: Sequence[int] = (),
        continuation_token: int | None = None,
        payload_kind: str = "llama_slot",
        max_bytes: int | None = None,
    ) -> HandoffReport: ...
