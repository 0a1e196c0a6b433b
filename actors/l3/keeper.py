"""The L3 actor's hold on its store: the one writer of it, and the entry index that mirrors it.

A `StoreKeeper` belongs to one `L3Actor` and is shared by its parts (the actor's capture and materialize,
`peer`'s fetch, `serve`'s endpoints); nothing else touches it. It owns:

* the `Store` (open once the incarnation has reconciled it) and the worker threads every blocking store call
  runs in (`blocking`);
* the `EntryIndex` of what is stored, pinned and last used, with every entry's segment list, kept in step with
  the disk by the mutations here (`refill` after a reconcile, `enforce` after every commit, `forget` when an
  entry goes). An eviction pass is decided from the entry index on the event loop, with the pins as they are at
  that instant, and the entry index drops what it evicts in the same step: no manifest is read, the lock is held
  only while the files go, and a restore that pins an entry a moment later either finds it kept or finds it
  gone, never half-deleted (which was reported as a corrupt entry and quarantined);
* the lock that serialises store mutations (ingest, the commit of a fetch, eviction, gc): network waits never
  hold it;
* the budget, the count of fetches running (gc waits for none), and the `changed` flag the inventory loop
  publishes on;
* `unsure`: set when a mutation failed half-way (an ingest refused after its segments landed), so the next
  pass takes the segment sizes from the disk again instead of trusting the entry index's;
* the quarantine policy's state (`budget.quarantine_due`): `pressed` once the store needs its room (a pass
  that had to evict or could not fit, a capture refused for lack of room), with `pressure` to wake the
  actor's quarantine task; `clear_quarantine` deletes what is due, journals it (`l3_quarantine_cleared`) and
  frees the segments only those manifests named.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from actors.l3 import layout
from actors.l3.api import L3Unavailable
from actors.l3.budget import Eviction, next_quarantine_due, quarantine_due
from actors.l3.entry_index import EntryIndex
from actors.l3.store import Inventory, Store
from messages.events import L3Evicted, L3EvictionBlocked, L3QuarantineCleared, L3Quarantined
from runtime.actor import ActorContext

__all__ = ["StoreKeeper"]

T = TypeVar("T")


class StoreKeeper:
    def __init__(
        self,
        root: Path,
        *,
        budget_bytes: int,
        threads: int,
        clock: Callable[[], float] = time.time,
        quarantine_retention_s: float = 86_400.0,
        quarantine_keep_s: float = 600.0,
    ) -> None:
        """`clock`: the entry index's clock (last uses, quarantine times: the store's mtimes are on it too).
        `quarantine_retention_s`: how long a quarantined manifest is kept; `quarantine_keep_s`: how long at
        least, once the store needs its room."""
        self.root = root
        self.budget_bytes = budget_bytes
        self.store: Store | None = None
        self.entry_index = EntryIndex()
        self.mutate = asyncio.Lock()
        self.changed = asyncio.Event()
        self.fetching = 0
        self.unsure = False
        self.clock = clock
        self.quarantine_retention_s = quarantine_retention_s
        self.quarantine_keep_s = quarantine_keep_s
        self.pressed = False
        self.pressure = asyncio.Event()
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
        """The entry index from a reconcile pass (known entries keep their last use, running restores their pins);
        quarantines are events, and so is a quarantine that blocks eviction."""
        before = self.entry_index.last_use()
        entry_index = EntryIndex()
        entry_index.keep_pins(self.entry_index.pins())
        for e in inventory.entries:
            entry_index.add(
                e.entry,
                identity=e.identity,
                n_tokens=e.n_tokens,
                bytes=e.bytes,
                last_use=before.get(e.entry, e.mtime_ns / 1e9),
                segments=e.segments,
            )
        entry_index.set_segments(inventory.segment_bytes)
        entry_index.set_quarantine(
            {q.name: q.segments for q in inventory.quarantined if q.readable},
            (q.name for q in inventory.quarantined if not q.readable),
            sum(q.bytes for q in inventory.quarantined),
            since={q.name: q.since_ns / 1e9 for q in inventory.quarantined},
            sizes={q.name: q.bytes for q in inventory.quarantined},
        )
        self.entry_index = entry_index
        self.unsure = False
        for q in inventory.quarantined:
            if q.reason != "found in quarantine":  # moved there by this pass
                ctx.emit(L3Quarantined, entry=q.name.split(".", 1)[0], reason=q.reason)
        if entry_index.eviction_blocked:
            self._blocked(ctx)

    def _blocked(self, ctx: ActorContext) -> None:
        unreadable = self.entry_index.eviction_blocked
        ctx.emit(
            L3EvictionBlocked,
            unreadable=unreadable[:32],
            stored_bytes=self.entry_index.stored_bytes,
            budget_bytes=self.budget_bytes,
        )
        ctx.log.warning(
            "l3_eviction_blocked",
            unreadable=list(unreadable[:10]),
            bytes=self.entry_index.stored_bytes,
            budget=self.budget_bytes,
            hint=f"deleted once the store needs room and they are {self.quarantine_keep_s:g}s old, or now by "
            "mesh-actor l3 gc --quarantine",
        )

    def room_for(self, size: int) -> bool:
        """Whether `size` more bytes may be stored: always, unless eviction is blocked and they do not fit."""
        return not self.entry_index.eviction_blocked or self.entry_index.stored_bytes + size <= self.budget_bytes

    async def enforce(self, ctx: ActorContext, store: Store) -> Eviction:
        """One eviction pass (call it holding `mutate`): decided from the entry index and applied to it at once,
        then the files go in a worker thread; the eviction is an event."""
        if self.unsure:
            self.entry_index.set_segments(await self.blocking(store.segment_sizes))
            self.unsure = False
        plan = self.entry_index.plan(self.budget_bytes)  # no await between the decision and `apply`
        self.entry_index.apply(plan)
        if plan.evict or plan.free:
            try:
                await self.blocking(store.apply_eviction, plan.evict, plan.free)
            except OSError as exc:  # some files stay: the next pass counts what the disk holds
                self.unsure = True
                ctx.log.warning("l3_eviction_failed", error=str(exc))
        if plan.evict or not plan.fits:
            self.need_room()
        if plan.evict:
            ctx.emit(
                L3Evicted,
                entries=plan.evict,
                freed_bytes=plan.bytes_before - plan.bytes_after,
                budget_bytes=self.budget_bytes,
                stored_bytes=plan.bytes_after,
            )
        if not plan.fits:
            ctx.log.warning(
                "l3_over_budget",
                budget=self.budget_bytes,
                bytes=plan.bytes_after,
                pinned=len(self.entry_index.pinned()),
                blocked=bool(self.entry_index.eviction_blocked),
            )
        self.changed.set()
        return plan

    def forget(self, ctx: ActorContext, entry: str, *, quarantined: str | None = None) -> None:
        """An entry is gone from the store (or quarantined: its segments stay counted, an event says why)."""
        if quarantined is None:
            self.entry_index.remove([entry])
        else:
            self.entry_index.quarantine(entry, layout.manifest_name(entry), at=self.clock())
            ctx.emit(L3Quarantined, entry=entry, reason=quarantined[:200])
            self.pressure.set()  # the quarantine task learns when this one is due
        self.changed.set()

    # ---- the quarantine policy ----

    def need_room(self) -> None:
        """The store needs its room: quarantined manifests go once they are `quarantine_keep_s` old."""
        self.pressed = True
        self.pressure.set()

    def next_quarantine_due(self) -> float | None:
        """When (on `clock`) a quarantined manifest is next due for deletion (None: none is quarantined)."""
        return next_quarantine_due(
            self.entry_index.quarantine_held(),
            retention_s=self.quarantine_retention_s,
            keep_s=self.quarantine_keep_s,
            pressed=self.pressed,
        )

    async def clear_quarantine(self, ctx: ActorContext, store: Store) -> tuple[str, ...]:
        """Deletes the quarantined manifests that are due (call it holding `mutate`), frees the segments only
        they named, and journals it; returns their names."""
        now = self.clock()
        held = self.entry_index.quarantine_held()
        limits = {"retention_s": self.quarantine_retention_s, "keep_s": self.quarantine_keep_s}
        due = quarantine_due(held, now=now, pressed=self.pressed, **limits)
        if not due:
            return ()
        aged = set(quarantine_due(held, now=now, pressed=False, **limits))
        reason = "retention" if aged.issuperset(due) else "space"
        before = self.entry_index.stored_bytes
        try:
            await self.blocking(store.remove_quarantined, due)
        except OSError as exc:  # some stay: the next reconcile (a start, gc) counts what the disk holds
            self.unsure = True
            ctx.log.warning("l3_quarantine_not_cleared", error=str(exc))
            return ()
        self.entry_index.unquarantine(due)
        self.pressed = False  # judged again by the passes from here on
        plan = await self.enforce(ctx, store)  # the segments only they named are orphans now
        ctx.emit(
            L3QuarantineCleared,
            manifests=due[:32],
            count=len(due),
            reason=reason,
            freed_bytes=max(0, before - plan.bytes_after),
            stored_bytes=plan.bytes_after,
        )
        ctx.log.warning("l3_quarantine_cleared", manifests=len(due), reason=reason, bytes=before - plan.bytes_after)
        return due
