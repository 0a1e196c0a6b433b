"""Models on demand (front-door shell): a request for a catalog model without a ready instance waits (at most
`max_queue` per model, beyond that 429) while one start is in flight for that model: placement is asked (with the
model's required serving settings); when it refuses for memory, `ondemand_rules.plan_room` says which instances to stop
(they are stopped, and placement is asked again), to wait for busy ones, or that the model never fits (507 at
once, with need and have). Instances with an `idle_ttl_s` stop when idle that long (never below the model's
`min_replicas`). Replicas: `replicas.ReplicaScaler` decides, the methods here carry it out.

`ModelsOnDemand` is the front door's part that starts and stops models and follows the instance records; the
HTTP part (`actor.FrontDoorActor`) holds one and asks it for a ready instance of a model (`instance_for`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from nats.js.kv import KeyValue

from actors.frontdoor import shapes
from actors.frontdoor.catalog import Catalog, CatalogModel
from actors.frontdoor.ondemand_rules import ArrivalOrder, NeverFits, Running, Stop, Wait, idle_expired, plan_room
from actors.frontdoor.relay import bus_failure
from actors.frontdoor.replicas import ReplicaScaler
from actors.placement import pooled
from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, read_header
from actors.placement.ledger import device_sizes
from messages.errors import INSUFFICIENT_MEMORY, NOT_PLACED, QUEUE_FULL, TIMEOUT, UNAVAILABLE
from messages.events import IdleStopped, ModelLoaded, ModelLoading, ModelRefused, RoomMade
from messages.frontdoor import FrontDoorModel, ModelState
from messages.generate import ServingReport
from messages.placement import NodeLedger, PlacementDecision, PlacementRequest
from messages.runner import InstanceStatus, RunnerAck, StartInstance, StopInstance
from messages.settings import ServingKind
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import ActorContext
from runtime.bus import BadMessage, BusError, RemoteError, once_listening
from runtime.model_files import ModelFileError, resolve

__all__ = ["ModelDemand", "ModelsOnDemand", "same_model"]


class ModelDemand:
    """One catalog model's requests on this front door."""

    def __init__(self, name: str, entry: CatalogModel) -> None:
        self.name = name
        self.entry = entry
        self.kind: ServingKind | None = entry.kind  # what its instances run (the header's when it names none)
        self.waiting = 0  # requests waiting for an instance
        self.held = 0  # requests held back behind earlier ones for other models (grouping off)
        self.active = 0  # requests generating
        self.starting: asyncio.Task[InstanceStatus] | None = None
        self.last_used = 0.0
        self.classes: Counter[int] = Counter()  # the classes of the requests waiting for an instance


class ModelsOnDemand:
    """The front door's models on demand: each catalog model's requests and its one start in flight, the instance
    records as the bucket holds them, idle stops and replicas (`replicas.ReplicaScaler` decides)."""

    def __init__(
        self,
        catalog: Catalog,
        models_dir: Path,
        *,
        clock: Callable[[], float],
        group_swaps: bool = True,
        min_idle_s: float = 1.0,
    ) -> None:
        self.catalog = catalog
        self.models_dir = models_dir
        self._clock = clock
        # Grouping off: no grace for the model just used, and requests in arrival order across models.
        self._min_idle_s = min_idle_s if group_swaps else 0.0
        self._order = None if group_swaps else ArrivalOrder()
        self._order_moved = asyncio.Event()
        self.models = {name: ModelDemand(name, entry) for name, entry in catalog.models.items()}
        self.instances: dict[str, InstanceStatus] = {}  # the instance records, by bucket key
        self._instances_moved = asyncio.Event()  # set (then replaced) on every change of an instance record
        self._instance_used: dict[str, float] = {}
        self._instance_class: dict[str, int] = {}  # instance -> the class of the last request sent to it
        self._scaler: ReplicaScaler | None = None
        self._starts: set[asyncio.Task[InstanceStatus]] = set()  # shared by a model's waiters; cancelled at the end
        self._ctx: ActorContext

    # --- lifetime ---------------------------------------------------------------------------------------------

    async def follow(self, ctx: ActorContext) -> asyncio.Event:
        """Follows the instance records from here on; the event is set once the current ones are in."""
        self._ctx = ctx
        self.instances.clear()
        kv = await buckets.instances(ctx.bus, ctx.subjects)
        ready = asyncio.Event()
        ctx.spawn(self._watch_instances(ctx, kv, ready), "watch-instances")
        return ready

    async def keep(self, ctx: ActorContext, doors: KeyValue) -> None:
        """Stops idle instances, and adds and retires replicas (`doors`: the front doors' reports, which say
        which one leads the scaling)."""
        ctx.spawn(self._stop_idle(ctx), "idle")
        self._scaler = ReplicaScaler(
            ctx, self.catalog.models, self._live_instances_of, self._add_replica, self._stop_instance, clock=self._clock
        )
        if self._scaler.active:
            await ctx.subscribe(ctx.subjects.serving_all, ServingReport, self._scaler.on_report)
            ctx.spawn(self._scaler.watch_doors(doors), "replica-leader")
            ctx.spawn(self._scaler.run(), "replicas")

    def cancel_starts(self) -> None:
        """Cancels the starts in flight (the front door is stopping)."""
        for task in self._starts:
            task.cancel()

    async def _watch_instances(self, ctx: ActorContext, kv: KeyValue, ready: asyncio.Event) -> None:
        async for entry in buckets.watch(kv, ready):
            if buckets.removed(entry):
                gone = self.instances.pop(entry.key, None)
                if gone is not None:  # what this front door knew of its use goes with it
                    self._instance_used.pop(gone.id, None)
                    self._instance_class.pop(gone.id, None)
                    if self._scaler is not None:
                        self._scaler.forget(gone.id)
            else:
                try:
                    self.instances[entry.key] = buckets.decode_keyed(
                        entry, InstanceStatus, lambda s: ctx.subjects.instance_key(s.node, s.id), "instance"
                    )
                except BadMessage as exc:
                    ctx.log.warning("bad_instance_record", key=entry.key, error=str(exc))
                    self.instances.pop(entry.key, None)
            self._instances_moved.set()  # wake what waits for an instance to change, then a fresh event
            self._instances_moved = asyncio.Event()

    # --- what the HTTP part asks -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def in_use(self, model: ModelDemand, instance: InstanceStatus, request_class: int) -> Iterator[None]:
        """While a request of `request_class` for `model` generates on `instance` (what idle stops and making
        room read: the model in use, the instance's last use and class)."""
        self._instance_class[instance.id] = request_class
        model.active += 1
        try:
            yield
        finally:
            model.active -= 1
            model.last_used = self._clock()
            self._instance_used[instance.id] = model.last_used

    def report(self) -> tuple[FrontDoorModel, ...]:
        """Each catalog model as this front door sees it (its report's models)."""
        models = []
        for name, m in sorted(self.models.items()):
            path = self.path_of(m.entry)
            kind = self.kind_of(m)
            ready = [s for s in self.instances.values() if s.state == "ready" and same_model(s, m.entry, path, kind)]
            held = sum(s.observed_memory.total_bytes if s.observed_memory else s.predicted_memory.total_bytes
                       for s in ready)  # fmt: skip
            state: ModelState = "ready" if ready else "starting" if m.starting and not m.starting.done() else "stopped"
            models.append(
                FrontDoorModel(
                    name=name, path=m.entry.path, state=state, instances=tuple(sorted(s.id for s in ready)),
                    held_bytes=held, queued=m.waiting + m.held, active=m.active, pinned=m.entry.pinned,
                    priority=m.entry.priority, idle_ttl_s=m.entry.idle_ttl_s, ctx=m.entry.ctx,
                    max_queue=m.entry.max_queue, settings=m.entry.required_settings(),
                )
            )  # fmt: skip
        return tuple(models)

    # --- one start per model, its requests waiting together -----------------------------------------------------

    def kind_of(self, model: ModelDemand) -> ServingKind | None:
        """What an instance of the model runs: its entry's kind, else the one its header gives (read once);
        None while unknown (no local file yet: then any kind of instance of the file serves it)."""
        if model.kind is None:
            model.kind = header_kind_of(self.path_of(model.entry))
        return model.kind

    def path_of(self, entry: CatalogModel) -> str | None:
        if entry.registry:
            return None
        try:
            return str(resolve(entry.path, self.models_dir))
        except ModelFileError:
            return None

    def ready_of(self, model: ModelDemand) -> InstanceStatus | None:
        path, kind = self.path_of(model.entry), self.kind_of(model)
        for status in sorted(self.instances.values(), key=lambda s: s.id):
            if status.state == "ready" and status.port is not None and same_model(status, model.entry, path, kind):
                return status
        return None

    async def instance_for(self, model: ModelDemand, deadline: float, request_class: int = 0) -> InstanceStatus:
        if self._order is None:
            return await self._grouped(model, deadline, request_class)
        if model.waiting + model.held >= model.entry.max_queue:
            raise _queue_full(model)
        ticket = self._order.arrive(model.name)
        model.held += 1
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    while not self._order.may_go(ticket):
                        moved = self._order_moved
                        await moved.wait()
            except TimeoutError as exc:
                raise _load_timeout(model) from exc
            finally:
                model.held -= 1  # from here it waits like any request (and keeps its model's instance in use)
            return await self._grouped(model, deadline, request_class, queued=True)
        finally:
            self._order.leave(ticket)
            self._order_moved.set()  # wake the waiters to look again
            self._order_moved = asyncio.Event()

    async def _grouped(
        self, model: ModelDemand, deadline: float, request_class: int = 0, *, queued: bool = False
    ) -> InstanceStatus:
        """A ready instance of `model`, after waiting with its other requests for the one start in flight (which
        may make room as the highest class among them may: `ondemand_rules.plan_room`)."""
        ready = self.ready_of(model)
        if ready is not None:
            return ready
        if not queued and model.waiting >= model.entry.max_queue:
            raise _queue_full(model)
        model.waiting += 1
        model.classes[request_class] += 1
        try:
            while True:
                ready = self.ready_of(model)
                if ready is not None:
                    return ready
                if model.starting is None or model.starting.done():
                    self._ctx.emit(ModelLoading, model=model.name, waiting=model.waiting)
                    model.starting = asyncio.get_running_loop().create_task(self._start(model, deadline))
                    self._starts.add(model.starting)
                    model.starting.add_done_callback(self._starts.discard)
                    model.starting.add_done_callback(_retrieve)
                try:
                    async with asyncio.timeout_at(deadline):
                        return await asyncio.shield(model.starting)
                except TimeoutError as exc:
                    raise _load_timeout(model) from exc
        finally:
            model.waiting -= 1
            model.classes[request_class] -= 1
            if model.classes[request_class] <= 0:
                del model.classes[request_class]

    async def _ask_placement(self, placement: PlacementRequest, deadline: float) -> PlacementDecision:
        """Placement's decision, asked again while no placement actor listens."""
        ctx = self._ctx
        loop = asyncio.get_running_loop()
        try:
            return await once_listening(
                lambda: ctx.bus.request(
                    ctx.subjects.placement_request, placement, PlacementDecision,
                    timeout=max(0.1, min(30.0, deadline - loop.time())),
                ),
                deadline,
            )  # fmt: skip
        except RemoteError as exc:
            raise shapes.ApiError(UNAVAILABLE, f"placement did not answer: {exc.reply.message}") from exc
        except BusError as exc:
            raise shapes.ApiError(UNAVAILABLE, f"placement did not answer: {bus_failure(exc)}") from exc

    async def _start(self, model: ModelDemand, deadline: float) -> InstanceStatus:
        """Places and starts one instance of `model`, making room when memory is short."""
        ctx = self._ctx
        entry = model.entry
        ref = entry.model_ref(self.path_of(entry))
        placement = PlacementRequest(
            model=ref, ctx=entry.ctx, settings=entry.required_settings(), request_id=f"frontdoor-{model.name}"
        )
        loop = asyncio.get_running_loop()
        began = loop.time()
        while loop.time() < deadline:
            decision = await self._ask_placement(placement, deadline)
            if decision.admitted and decision.reservation_id and decision.placements:
                ready = await self._start_admitted(decision, deadline)
                load_ms = (loop.time() - began) * 1000
                ctx.emit(ModelLoaded, model=model.name, instance_id=ready.id, instance_node=ready.node, load_ms=load_ms)
                return ready
            shortfalls = {
                r.node_id: r.shortfalls
                for r in decision.rejections
                if r.reason == "insufficient_memory" and r.shortfalls
            }
            if not shortfalls:
                ctx.emit(ModelRefused, model=model.name, reason=f"{decision.reason}: {decision.message}")
                raise shapes.ApiError(NOT_PLACED, f"{model.name!r} cannot be placed: {decision.reason}: "
                                      f"{decision.message}", extra={"reason": str(decision.reason)})  # fmt: skip
            running = await self._running()
            sizes = await self._sizes()
            top_class = max((c for c, n in model.classes.items() if n > 0), default=0)
            plan = plan_room(
                shortfalls, running, now=self._clock(), min_idle_s=self._min_idle_s, sizes=sizes,
                requester_class=top_class,
            )  # fmt: skip
            ctx.log.info(
                "frontdoor_room", model=model.name, plan=msgspec.to_builtins(plan),
                shortfalls=msgspec.to_builtins(shortfalls), running=msgspec.to_builtins(running),
            )  # fmt: skip
            if isinstance(plan, NeverFits) and not placement.allow_multi_node:
                # no single node will ever hold it: ask for a split over nodes (placement splits only then)
                placement = msgspec.structs.replace(placement, allow_multi_node=True)
                continue
            if isinstance(plan, NeverFits):
                ctx.emit(
                    ModelRefused, model=model.name, reason="never_fits", need_bytes=plan.need, have_bytes=plan.have
                )
                raise shapes.ApiError(
                    INSUFFICIENT_MEMORY, f"{model.name!r} never fits: it needs {plan.need} bytes and at most "
                    f"{plan.have} can be freed on {plan.node}",
                    extra={"need_bytes": plan.need, "have_bytes": plan.have, "node": plan.node},
                )  # fmt: skip
            if isinstance(plan, Stop):
                ctx.log.info("frontdoor_making_room", model=model.name, node=plan.node, stopping=plan.instances)
                await asyncio.gather(*(self._stop_instance(i) for i in plan.instances))
                ctx.emit(RoomMade, model=model.name, stopped_on=plan.node, stopped=plan.instances, frees=plan.frees)
            elif isinstance(plan, Wait):  # busy instances finish, or a stop lands, or placement's view catches up
                await self._instances_change(timeout_s=0.5)
        raise shapes.ApiError(TIMEOUT, f"{model.name!r} did not load in {entry.timeout_s:g}s")

    async def _start_admitted(self, decision: PlacementDecision, deadline: float) -> InstanceStatus:
        """Starts what `decision` admitted on its (head) node, and returns the instance once it is ready."""
        ctx = self._ctx
        assert decision.reservation_id is not None
        node = decision.placements[0].node_id
        try:
            ack = await ctx.bus.request(
                ctx.subjects.runner(node, "start"), StartInstance(reservation_id=decision.reservation_id), RunnerAck,
                timeout=60,
            )  # fmt: skip
        except RemoteError as exc:
            raise shapes.ApiError(UNAVAILABLE, f"the start on {node} failed: {exc.reply.message}") from exc
        except BusError as exc:
            raise shapes.ApiError(UNAVAILABLE, f"the start on {node} failed: {bus_failure(exc)}") from exc
        return await self._until_ready(ack.instance_id, deadline)

    # --- replicas (`replicas.ReplicaScaler` decides; these carry it out) ------------------------------------

    def _live_instances_of(self, name: str) -> list[InstanceStatus]:
        model = self.models[name]
        path = self.path_of(model.entry)
        return [s for s in self.instances.values() if same_model(s, model.entry, path, self.kind_of(model))]

    async def _add_replica(self, name: str, nodes: tuple[str, ...], prefer: tuple[str, ...] = ()) -> InstanceStatus:
        """One more instance of `name`: on one of `nodes` (those without one) when one fits, else wherever one
        fits, `prefer`'s nodes first among those alike (placement's rule); never by stopping other models'
        instances (a replica uses room that is free)."""
        entry = self.models[name].entry
        deadline = asyncio.get_running_loop().time() + entry.timeout_s
        placement = PlacementRequest(
            model=entry.model_ref(self.path_of(entry)), ctx=entry.ctx, settings=entry.required_settings(),
            request_id=f"replica-{name}", prefer=prefer,
        )  # fmt: skip
        for choice in (nodes, ()) if nodes else ((),):
            decision = await self._ask_placement(msgspec.structs.replace(placement, nodes=choice), deadline)
            if decision.admitted and decision.reservation_id and decision.placements:
                return await self._start_admitted(decision, deadline)
        raise shapes.ApiError(NOT_PLACED, f"no room for another replica of {name!r}: {decision.reason}: "
                              f"{decision.message}")  # fmt: skip

    def _keeps(self, model: str | None) -> bool:
        """Whether stopping one more instance of `model` would leave fewer than its `min_replicas`."""
        if model is None or model not in self.models:
            return False
        live = [s for s in self._live_instances_of(model) if s.state in ("starting", "ready", "restarting")]
        return len(live) <= self.models[model].entry.min_replicas

    async def _until_ready(self, instance_id: str, deadline: float) -> InstanceStatus:
        async with asyncio.timeout_at(deadline):
            while True:
                status = self._by_id(instance_id)
                if status is not None and status.state == "ready" and status.port is not None:
                    return status
                if status is not None and status.state in ("failed", "rejected", "stopped"):
                    raise shapes.ApiError(UNAVAILABLE, f"instance {instance_id} ended {status.state}: "
                                          f"{status.message}")  # fmt: skip
                await self._instances_change()

    def _by_id(self, instance_id: str) -> InstanceStatus | None:
        return next((s for s in self.instances.values() if s.id == instance_id), None)

    async def _stop_instance(self, instance_id: str) -> None:
        status = self._by_id(instance_id)
        if status is None:
            return
        with contextlib.suppress(RemoteError, BusError):
            await self._ctx.bus.request(
                self._ctx.subjects.runner(status.node, "stop"), StopInstance(instance_id=instance_id), RunnerAck,
                timeout=35,
            )  # fmt: skip

    async def _sizes(self) -> dict[str, dict[str, int]]:
        """Each live node's device sizes, capped by its memory limit (from its telemetry)."""
        nodes, _ = await buckets.read_all(self._ctx.bus, self._ctx.subjects.nodes_bucket, NodeResources)
        return {n.node_id: {d: size for d, (size, _) in device_sizes(n).items()} for _, n in nodes}

    async def _running(self) -> list[Running]:
        """Every live instance with what its reservation holds, and what this front door knows of its use."""
        held: dict[str, dict[str, int]] = {}
        running = []
        records, _ = await buckets.read_all(self._ctx.bus, self._ctx.subjects.reservations_bucket, NodeLedger)
        live = {s.id for s in self.instances.values()}
        for _, ledger in records:
            for r in ledger.reservations:
                if r.instance_id is not None and r.instance_id in live:
                    held[r.instance_id] = dict(r.held)
                elif r.requester is not None:  # a client's hold: not the mesh's to stop, nor a use that ends soon
                    running.append(
                        Running(
                            instance_id=f"reservation:{r.reservation_id}", node=r.node_id, model=None,
                            held=dict(r.held), last_used=self._clock(), pinned=True,
                        )
                    )  # fmt: skip
                else:  # booked, its instance not started (or not seen) yet: it will be stoppable once it runs
                    running.append(
                        Running(
                            instance_id=f"reservation:{r.reservation_id}", node=r.node_id, model=None,
                            held=dict(r.held), last_used=self._clock(), in_use=True,
                        )
                    )  # fmt: skip
        for status in self.instances.values():
            if status.state in ("stopped", "failed", "rejected") and status.id not in held:
                continue  # ended, and its memory released
            model = next((m for m in self.models.values()
                          if same_model(status, m.entry, self.path_of(m.entry), self.kind_of(m))), None)  # fmt: skip
            running.append(
                Running(
                    instance_id=status.id,
                    node=status.node,
                    model=model.name if model else None,
                    held=held.get(status.id, {}),
                    last_used=self._instance_used.get(status.id, 0.0),
                    used_class=self._instance_class.get(status.id, 0),
                    priority=model.entry.priority if model else 0,
                    pinned=model.entry.pinned if model else True,  # not ours: never stopped by us
                    in_use=bool(model and (model.active or model.waiting)) or status.state != "ready",
                    idle_ttl_s=model.entry.idle_ttl_s if model else None,
                )
            )
        return running

    async def _instances_change(self, timeout_s: float | None = None) -> None:
        """Returns once an instance record changes (or `timeout_s` passed)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._instances_moved.wait()

    async def _stop_idle(self, ctx: ActorContext) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                running = await self._running()
            except (BusError, Exception) as exc:  # a bucket read failing skips one pass
                ctx.log.warning("frontdoor_idle_check_failed", error=repr(exc))
                continue
            now = self._clock()
            by_id = {r.instance_id: r for r in running}
            for instance_id in idle_expired(running, now=now):
                idle = by_id[instance_id]
                if self._keeps(idle.model):
                    continue  # its model's min_replicas stay
                ctx.log.info("frontdoor_idle_stop", instance_id=instance_id)
                await self._stop_instance(instance_id)
                ctx.emit(IdleStopped, model=idle.model, instance_id=instance_id, idle_s=now - idle.last_used)


def header_kind_of(path: str | None) -> ServingKind | None:
    """What a model file is for by its header (`generate` when it declares no pooling); None when it cannot be
    read here."""
    if path is None:
        return None
    try:
        return pooled.header_kind(geometry_from_header(read_header(path))) or "generate"
    except (OSError, GGUFFormatError, GeometryError):
        return None


def same_model(status: InstanceStatus, entry: CatalogModel, path: str | None, kind: ServingKind | None = None) -> bool:
    """Whether `status` is an instance of the catalog model: its file, run with the settings it requires and as
    the `kind` it is for (an embedding server of a generation model's file serves another catalog entry)."""
    if not entry.runs_on(status.settings, kind):
        return False
    if path is not None:
        return status.model_path == path
    return Path(status.model_path).name == entry.path or Path(status.model_path).stem == entry.path


def _queue_full(model: ModelDemand) -> shapes.ApiError:
    return shapes.ApiError(QUEUE_FULL, f"{model.waiting + model.held} requests already wait for {model.name!r}")


def _load_timeout(model: ModelDemand) -> shapes.ApiError:
    return shapes.ApiError(TIMEOUT, f"{model.name!r} did not load in {model.entry.timeout_s:g}s")


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a start nobody waits for any more must not warn when it failed
