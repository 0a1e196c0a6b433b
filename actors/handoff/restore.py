"""What a receiving node does with a committed handoff: the restore hook the handoff actor is given.

`into_l3(l3, on_committed=…)` first calls `on_committed(state)` (the serving path's restore into llama-server,
wired by the runner: `state.path` is the verified payload and stays valid until the hook returns), then hands
a hard link of the payload to the node's L3 store (`L3Access.capture`, which owns and deletes it), so a later
request for the same prefix restores from L3 on this node. The hook's return value (or the L3 entry id) is
what `HandoffResult.restored` reports.
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

__all__ = ["OnCommitted", "into_l3"]

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
            if restored is None:
                restored = layout.entry_id(state.identity, state.tokens)
        return restored

    return restore


def _link_or_copy(source: Path, dest: Path) -> None:  # worker thread
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)
