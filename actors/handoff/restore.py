"""What a receiving node does with a committed handoff: the restore hook the handoff actor is given.

`into_l3(l3, on_committed=…)` first calls `on_committed(state)` (the serving path's restore into llama-server,
wired by the runner: `state.path` is the verified payload and stays valid until the hook returns), then hands
a hard link of the payload to the node's L3 store (`L3Access.capture`, which owns and deletes it), so a later
request for the same prefix restores from L3 on this node. Without `on_committed`, L3 is the restore: the hook
waits (bounded by the handoff's restore timeout) until the entry is in the store, so a committed handoff is a
prefix the node's next generate finds locally; a capture L3 dropped (over budget, disabled) fails the restore.
The hook's return value (or the L3 entry id) is what `HandoffResult.restored` reports.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from actors.handoff.actor import CommittedHandoff, Restore
from actors.l3 import layout
from actors.l3.api import L3Access

__all__ = ["NotStored", "OnCommitted", "into_l3"]

#: Called with a committed payload before anything else sees it; returns what it restored into (or None).
OnCommitted = Callable[[CommittedHandoff], Awaitable[str | None]]


def into_l3(l3: L3Access | None, *, on_committed: OnCommitted | None = None) -> Restore:
    """The restore hook: `on_committed`, then an L3 capture of the payload (when the open listed the tokens)."""

    async def restore(state: CommittedHandoff) -> str | None:
        restored = await on_committed(state) if on_committed is not None else None
        if l3 is not None and state.tokens and layout.is_digest(state.identity):
            copy = state.path.with_name(layout.temp_name(state.path.name, secrets.token_hex(8)))
            await asyncio.to_thread(_link_or_copy, state.path, copy)
            l3.capture(copy, identity=state.identity, tokens=state.tokens, payload_kind=state.payload_kind)
            entry = layout.entry_id(state.identity, state.tokens)
            if on_committed is None:
                await _stored(l3, state, entry)
            if restored is None:
                restored = entry
        return restored

    return restore


class NotStored(Exception):
    """The node's L3 store did not take the payload (it dropped the capture)."""


async def _stored(l3: L3Access, state: CommittedHandoff, entry: str) -> None:
    """Until `entry` is in the node's store (the caller's deadline bounds the wait: the restore timeout)."""
    n = len(state.tokens)
    misses = 0
    while True:
        hit = await l3.lookup(state.identity, state.tokens, max_tokens=n)
        if hit is not None and hit.entry == entry and hit.source == "l3_local":
            return
        misses += 1
        if misses > _MAX_POLLS:
            raise NotStored(f"entry {entry[:16]}… did not appear in the L3 store")
        await asyncio.sleep(_POLL_S)


_POLL_S = 0.02
_MAX_POLLS = 30_000  # 10 minutes: the restore timeout ends it sooner


def _link_or_copy(source: Path, dest: Path) -> None:  # worker thread
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)
