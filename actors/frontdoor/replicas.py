"""Replicas of the catalog's models (front-door shell): every `SCALE_INTERVAL_S`, each model with replicas
(`min_replicas` > 0 or `max_replicas` > 1) is seen as `scaling` sees it and decided there; an addition or a
retirement is journaled (`scaling_decided`, with everything the decision used) and carried out here.

What it sees: the model's instances (their records: starting or ready) and, for each, its node's latest serving
report (`mesh.serving.<node>`: busy and queued slots, the queued requests' prompt and generation tokens, the
measured prefill and decode rates, the tokens its slots hold), and since when it has had no work.

Adding places one more instance through placement like any other, on a node that has none of the model first
(the file travels there if it lacks it: the runner fetches it), on any node that fits when none of those does,
preferring (after the nodes that hold the file, which placement ranks first) the nodes whose L3 stores hold the
most of the model's states (`scaling.warm_nodes`, from the stores' inventories in `MESH_L3`), and starts it;
once ready, its node's L3 store fetches the states of its identity its peers used most recently
(`mesh.l3.<node>.warm`), and the new replica is journaled (`replica_added`, with what was warmed and which
nodes were preferred). A replica
that cannot be placed (no room) is not tried again for `RETRY_AFTER_S`. Retiring stops the chosen instance
(never one generating: `scaling` chose an idle one). One action per model at a time.

One front door scales: the live one with the lowest node id (from the front doors' records in `MESH_FRONTDOORS`,
watched: a record appears with its door and expires 30 s after the door stopped writing it), so two front doors
do not both add. While front doors come and go, two may both believe they lead for a moment (until the
records expire): at worst one replica too many, retired later when idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Final

import msgspec
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from actors.frontdoor.catalog import CatalogModel
from actors.frontdoor.scaling import FORGET, decide, warm_nodes
from messages.events import ReplicaAdded, ScalingDecided
from messages.frontdoor import FrontDoorReport, ModelScale, Replica, ScaleMemory
from messages.generate import InstanceLoad, ServingReport
from messages.l3 import L3Inventory, WarmReply, WarmRequest
from messages.runner import InstanceStatus
from runtime import buckets
from runtime.actor import ActorContext
from runtime.bus import BadMessage, BusError

__all__ = ["RETRY_AFTER_S", "SCALE_INTERVAL_S", "ReplicaScaler"]

SCALE_INTERVAL_S: Final = 1.0
RETRY_AFTER_S: Final = 30.0
#: A new replica's warming: how long to wait for its identity in its node's report, how many entries its store
#: fetches at most, and how long that may take.
WARM_IDENTITY_WAIT_S: Final = 10.0
WARM_ENTRIES: Final = 8
WARM_TIMEOUT_S: Final = 120.0
_LIVE: Final = ("starting", "ready", "restarting")


class ReplicaScaler:
    def __init__(
        self,
        ctx: ActorContext,
        models: dict[str, CatalogModel],
        instances_of: Callable[[str], Sequence[InstanceStatus]],
        add: Callable[[str, tuple[str, ...], tuple[str, ...]], Awaitable[InstanceStatus]],
        stop: Callable[[str], Coroutine[Any, Any, None]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`instances_of(model)`: its live instance records; `add(model, nodes, prefer)`: places (on one of
        `nodes` first, when not empty; `prefer`'s first) and starts one more, ready; `stop(instance)`: stops
        one."""
        self._ctx = ctx
        self._models = {name: entry for name, entry in models.items() if entry.max_replicas > 1 or entry.min_replicas}
        self._instances_of = instances_of
        self._add = add
        self._stop = stop
        self._clock = clock
        self._reports: dict[str, tuple[float, ServingReport]] = {}  # node -> (received, report)
        self._worked: dict[str, float] = {}  # instance -> when it last had work (or was first seen)
        self._memory: dict[str, ScaleMemory] = {}
        self._acting: dict[str, asyncio.Task[None]] = {}  # model -> its addition or retirement in flight
        self._resting_until: dict[str, float] = {}  # model -> no addition before (its last one failed)
        self._doors: set[str] = set()  # the live front doors' node ids (their records)
        self._doors_known = asyncio.Event()  # the records were read once: leadership can be judged

    @property
    def active(self) -> bool:
        return bool(self._models)

    async def on_report(self, report: ServingReport, msg: Msg) -> None:
        node = msg.subject.rsplit(".", 1)[-1]
        if report.node_id != node:
            return  # a node speaks only for itself
        now = self._clock()
        self._reports[node] = (now, report)
        for load in report.instances:
            if load.busy or load.queued:
                self._worked[load.instance_id] = now

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(SCALE_INTERVAL_S)
                if self.leading():
                    self.tick()
        finally:
            for task in self._acting.values():
                task.cancel()

    async def watch_doors(self, doors: KeyValue) -> None:
        """The live front doors, as their records (keyed by node id, naming it) are written and expire. While
        the watch is down (NATS away), nobody leads from here; it is watched again a second later."""
        while True:
            try:
                async for entry in buckets.watch(doors, self._doors_known):
                    self._doors.discard(entry.key)
                    if not buckets.removed(entry):
                        with contextlib.suppress(BadMessage):  # a record that does not decode is no live door
                            buckets.decode_keyed(entry, FrontDoorReport, lambda r: r.node_id, "front door report")
                            self._doors.add(entry.key)
            except Exception as exc:
                self._ctx.log.warning("scaler_doors_watch_failed", error=repr(exc))
            self._doors_known.clear()
            self._doors.clear()
            await asyncio.sleep(1.0)

    def leading(self) -> bool:
        """Whether this front door is the live one with the lowest node id (never before the records are read)."""
        node = self._ctx.node_id
        return self._doors_known.is_set() and min(self._doors | {node}) == node

    def tick(self) -> None:
        """One decision per model with nothing in flight."""
        now = self._clock()
        for name, entry in self._models.items():
            if name in self._acting:
                continue
            scale = self.view(name, entry, now)
            memory = self._memory.get(name, FORGET)
            decision = decide(scale, memory, now)
            self._memory[name] = decision.memory
            if decision.action == "hold" or (decision.action == "add" and now < self._resting_until.get(name, 0.0)):
                continue
            self._ctx.emit(ScalingDecided, scale=scale, memory=memory, now=now, decision=decision)
            self._ctx.log.info("scaling_decided", model=name, action=decision.action, reason=decision.reason,
                               retire=decision.retire)  # fmt: skip
            if decision.action == "add":
                action = self._adding(name, scale)
            else:
                assert decision.retire is not None
                action = self._stop(decision.retire)
            task = asyncio.get_running_loop().create_task(action)
            self._acting[name] = task
            task.add_done_callback(functools.partial(self._done, name))

    def _done(self, model: str, task: asyncio.Task[None]) -> None:
        self._acting.pop(model, None)
        if not task.cancelled() and task.exception() is not None:
            self._ctx.log.warning("scaling_action_failed", model=model, error=repr(task.exception()))

    async def _adding(self, model: str, scale: ModelScale) -> None:
        began = self._clock()
        elsewhere = tuple(sorted(self._other_nodes({r.node for r in scale.replicas})))
        prefer = await self._warm_nodes(scale, elsewhere)
        try:
            ready = await self._add(model, elsewhere, prefer)
        except Exception as exc:  # no room, a start that failed: journaled, tried again later
            self._resting_until[model] = self._clock() + RETRY_AFTER_S
            self._ctx.emit(ReplicaAdded, model=model, error=_message(exc), preferred=prefer)
            return
        load_ms = (self._clock() - began) * 1000
        warmed = await self._warm(ready)
        self._ctx.emit(
            ReplicaAdded, model=model, instance_id=ready.id, instance_node=ready.node, load_ms=load_ms,
            warmed_entries=warmed.fetched if warmed else 0, warmed_bytes=warmed.bytes if warmed else 0,
            preferred=prefer,
        )  # fmt: skip

    async def _warm_nodes(self, scale: ModelScale, candidates: tuple[str, ...]) -> tuple[str, ...]:
        """`scaling.warm_nodes` over the L3 stores' inventories (none when they cannot be read: placement then
        goes by the file and headroom alone)."""
        ids = {r.instance_id for r in scale.replicas}
        identities = {
            load.identity
            for _, report in self._reports.values()
            for load in report.instances
            if load.instance_id in ids and load.identity
        }
        if not identities or not candidates:
            return ()
        ctx = self._ctx
        try:
            stores, _ = await buckets.read_all(ctx.bus, ctx.subjects.l3_bucket, L3Inventory)
        except Exception as exc:  # the bus is away, or no store: placement decides without
            ctx.log.info("replica_l3_view_unavailable", error=repr(exc))
            return ()
        return warm_nodes((inv for key, inv in stores if inv.node_id == key), identities, candidates)  # its own

    async def _warm(self, ready: InstanceStatus) -> WarmReply | None:
        """Its node's L3 store fetches its peers' most recent states of its identity (as its node reports it),
        so that the prefixes the model's other replicas served restore there too; None when that cannot be."""
        ctx = self._ctx
        identity = None
        deadline = self._clock() + WARM_IDENTITY_WAIT_S
        while identity is None and self._clock() < deadline:
            report = self._reports.get(ready.node)
            load = next((i for i in report[1].instances if i.instance_id == ready.id), None) if report else None
            identity = load.identity if load is not None else None
            if identity is None:
                await asyncio.sleep(0.25)
        if identity is None:
            return None
        try:
            return await ctx.bus.request(
                ctx.subjects.l3(ready.node, "warm"), WarmRequest(identity=identity, max_entries=WARM_ENTRIES),
                WarmReply, timeout=WARM_TIMEOUT_S,
            )  # fmt: skip
        except BusError as exc:  # no store there (L3 off), or it failed: the replica serves cold
            ctx.log.info("replica_not_warmed", instance_id=ready.id, node=ready.node, error=str(exc))
            return None

    def _other_nodes(self, taken: set[str]) -> set[str]:
        fresh = {node for node, (at, report) in self._reports.items() if self._clock() - at <= report.ttl_s}
        return fresh - taken

    def view(self, name: str, entry: CatalogModel, now: float) -> ModelScale:
        """The model's replicas as `scaling` decides on them."""
        loads: dict[str, InstanceLoad] = {}
        for at, report in self._reports.values():
            if now - at <= report.ttl_s:
                loads.update({load.instance_id: load for load in report.instances})
        replicas = []
        for status in sorted(self._instances_of(name), key=lambda s: s.id):
            if status.state not in _LIVE:
                continue
            load = loads.get(status.id)
            worked = self._worked.setdefault(status.id, now)
            replicas.append(_replica(status, load, idle_s=0.0 if load and (load.busy or load.queued) else now - worked))
        return ModelScale(
            model=name, min_replicas=entry.min_replicas, max_replicas=entry.max_replicas,
            target_wait_s=entry.target_wait_s, retire_idle_s=entry.replica_idle_s, replicas=tuple(replicas),
        )  # fmt: skip

    def forget(self, instance_id: str) -> None:
        """An instance's record is gone."""
        self._worked.pop(instance_id, None)


def _replica(status: InstanceStatus, load: InstanceLoad | None, *, idle_s: float) -> Replica:
    fields: dict[str, Any] = {"instance_id": status.id, "node": status.node, "ready": status.state == "ready",
                              "idle_s": round(idle_s, 3)}  # fmt: skip
    if load is not None:
        fields.update(
            slots=load.slots, busy=load.busy, queued=load.queued, queued_prompt_tokens=load.queued_prompt_tokens,
            queued_generation_tokens=load.queued_generation_tokens, prefill_tokens_per_s=load.prefill_tokens_per_s,
            decode_tokens_per_s=load.decode_tokens_per_s, resident_tokens=load.kv_tokens,
        )  # fmt: skip
    return msgspec.convert(fields, Replica)


def _message(exc: BaseException) -> str:
    with contextlib.suppress(Exception):
        return str(getattr(exc, "message", "") or exc)[:500]
    return type(exc).__name__
