"""The L3 actor's hold on its store: the one writer of it, and the catalog that mirrors it.

A `StoreKeeper` belongs to one `L3Actor` and is shared by its parts (the actor's capture and materialize,
`peer`'s fetch, `serve`'s endpoints); nothing else touches it. It owns:

* the `Store` (open once the incarnation has reconciled it) and the worker threads every blocking store call
  runs in (`blocking`);
* the `Catalog` of what is stored, pinned and last used, kept in step with the disk by the mutations here
  (`refill` after a reconcile, `enforce` after every commit, `forget` when an entry goes);
* the lock that serialises store mutations (ingest, the commit of a fetch, eviction, gc): network waits never
  hold it;
* the budget, the count of fetches running (gc waits for none), and the `changed` flag the inventory loop
  publishes on.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from actors.l3.api import L3Unavailable
from actors.l3.budget import Eviction
from actors.l3.catalog import Catalog
from actors.l3.store import Inventory, Store
from messages.events import L3Evicted, L3Quarantined
from runtime.actor import ActorContext

__all__ = ["StoreKeeper"]

T = TypeVar("T")


class StoreKeeper:
    def __init__(self, root: Path, *, budget_bytes: int, threads: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.store: Store | None = None
        self.catalog = Catalog()
        self.mutate = asyncio.Lock()
        self.changed = asyncio.Event()
        self.fetching = 0
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="l3")

    def require_store(self) -> Store:
        if self.store is None:
            raise L3Unavailable("the node's L3 store is not open")
        return self.store

    async def blocking(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Runs blocking store work in the actor's threads. A thread cannot be stopped: when the caller is
        cancelled, it first waits (bounded) for the work to end, so a lock it holds is not released early."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait({future}, timeout=5.0)
            raise

    def refill(self, ctx: ActorContext, inventory: Inventory) -> None:
        """The catalog from a reconcile pass (known entries keep their last use); quarantines are events."""
        before = self.catalog.last_use()
        catalog = Catalog()
        for e in inventory.entries:
            catalog.add(
                e.entry,
                identity=e.identity,
                n_tokens=e.n_tokens,
                bytes=e.bytes,
                last_use=before.get(e.entry, e.mtime_ns / 1e9),
            )
        catalog.stored_bytes = inventory.bytes
        catalog.quarantined = len(inventory.quarantined)
        self.catalog = catalog
        for q in inventory.quarantined:
            if q.reason != "found in quarantine":  # moved there by this pass
                ctx.emit(L3Quarantined, entry=q.name.split(".", 1)[0], reason=q.reason)

    async def enforce(self, ctx: ActorContext, store: Store) -> Eviction:
        """One eviction pass (call it holding `mutate`); the catalog follows, the eviction is an event."""
        plan = await self.blocking(
            store.enforce_budget,
            self.budget_bytes,
            pinned=self.catalog.pinned(),
            last_use=self.catalog.last_use(),
        )
        self.catalog.stored_bytes = plan.bytes_after
        if plan.evict:
            self.catalog.remove(plan.evict)
            ctx.emit(
                L3Evicted,
                entries=plan.evict,
                freed_bytes=plan.bytes_before - plan.bytes_after,
                budget_bytes=self.budget_bytes,
                stored_bytes=plan.bytes_after,
            )
        self.changed.set()
        return plan

    def forget(self, ctx: ActorContext, entry: str, *, quarantined: str | None = None) -> None:
        """An entry is gone from the store (or quarantined: an event, with the reason)."""
        self.catalog.remove([entry])
        if quarantined is not None:
            self.catalog.quarantined += 1
            ctx.emit(L3Quarantined, entry=entry, reason=quarantined[:200])
        self.changed.set()
