"""What a receiving node does with a committed handoff: the restore hook the handoff actor is given.

`into_l3(l3, on_committed=…)` first calls `on_committed(state)` (the serving path's restore into llama-server,
wired by the runner: `state.path` is the verified payload and stays valid until the hook returns), then hands
a hard link of the payload to the node's L3 store, so a later request for the same prefix restores from L3 on
this node. With `on_committed`, that hand-over is a background capture (`L3Access.capture`). Without it, L3 is
the restore: the hook awaits the capture's outcome (`L3Access.store`), so a committed handoff is a prefix the
node's next generate finds locally, and a capture L3 drops (queue full, over budget, `--l3-budget 0`, eviction
blocked) fails the restore at once with L3's reason: the sender's commit is refused with `restore_failed`,
and the runner waiting on the prefill hears it now, not after the restore timeout. No polling: the outcome
is an event the capture task resolves. The hook's return value (or the L3 entry id) is what
`HandoffResult.restored` reports.
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


class NotStored(Exception):
    """The node's L3 store did not take the payload (it dropped the capture: the reason is L3's)."""


def into_l3(l3: L3Access | None, *, on_committed: OnCommitted | None = None) -> Restore:
    """The restore hook: `on_committed`, then an L3 capture of the payload (when the open listed the tokens)."""

    async def restore(state: CommittedHandoff) -> str | None:
        restored = await on_committed(state) if on_committed is not None else None
        if l3 is not None and state.tokens and layout.is_digest(state.identity):
            copy = state.path.with_name(layout.temp_name(state.path.name, secrets.token_hex(8)))
            await asyncio.to_thread(_link_or_copy, state.path, copy)
            if on_committed is not None:
                l3.capture(copy, identity=state.identity, tokens=state.tokens, payload_kind=state.payload_kind)
                entry = layout.entry_id(state.identity, state.tokens)
            else:
                outcome = await l3.store(
                    copy, identity=state.identity, tokens=state.tokens, payload_kind=state.payload_kind
                )
                if outcome.entry is None:
                    raise NotStored(f"the node's L3 store did not keep the state: {outcome.reason}")
                entry = outcome.entry
            if restored is None:
                restored = entry
        return restored

    return restore


def _link_or_copy(source: Path, dest: Path) -> None:  # worker thread
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)
