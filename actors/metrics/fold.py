"""One node's metrics, folded from what the mesh already says (metrics core, pure).

Nothing here is measured: every figure is read from something another actor published. Inputs, each fed by the
shell as it arrives:

* this node's journal events (`event`): counters and histograms (requests and their timings from
  `generate_completed`, restarts, crashes, failed health checks, placement decisions, L3 captures, evictions and
  fetches, handoffs, the front door's loads, swaps and refusals);
* this node's records in the buckets (`instance_record` / `instance_removed`, `ledger`, `telemetry`, `l3`,
  `frontdoor`): gauges of what is true now (predicted and observed memory, what is reserved and available, the
  L3 store's size, the front door's queues);
* the runner's serving reports (`serving`): slots busy and waiting, and the KV cells they hold, while the report
  is current.

`families` renders them, with each instance's own llama-server families that the shell scraped (`engine`), as
prometheus-client metric families (the table of names is `families.FAMILIES`). Rules it keeps:

* Only this node's figures: an event recorded by another node is ignored (each node is scraped on its own, so
  a fleet's sum counts every event once).
* An instance's series live as long as its record: when the record goes (a final record expires 10 minutes after
  the server stopped), its counters go too, so instance ids that churn (models loaded on demand) do not pile up.
* Labels are bounded: models and instances come from the records, never from a request; free text (reasons,
  statuses) goes through `BoundedLabel`.
* No clock and no I/O: the shell passes `now` (its monotonic clock) where a report's age matters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from actors.metrics.families import (
    FAMILIES,
    FRONTDOOR_STATES,
    INSTANCE_STATES,
    OBSERVED_KINDS,
    PREDICTED_KINDS,
    RESERVATION_STATES,
)
from actors.placement.ledger import available, device_sizes
from messages import events as ev
from messages.frontdoor import FrontDoorReport
from messages.generate import GENERATING_ENDPOINTS, InstanceLoad, ServingReport
from messages.l3 import L3Inventory
from messages.placement import NodeLedger
from messages.runner import InstanceStatus
from messages.telemetry import NodeResources

__all__ = ["EVENT_TYPES", "UNKNOWN", "BoundedLabel", "EngineTarget", "NodeMetrics", "model_name"]

#: The model of an instance this node has no record of (an event that arrived before its record).
UNKNOWN: Final = "unknown"
#: Instance states whose server no longer holds memory: their memory gauges are not exported.
_ENDED: Final = frozenset({"stopped", "failed", "rejected"})
#: vLLM's finish reasons for a request's stop reason.
_FINISHED: Final = {"eos": "stop", "stop_word": "stop", "limit": "length", "cancelled": "abort"}
_TOKEN = re.compile(r"[^a-z0-9_]+")
_NODE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Distinct tenants a node's metrics name; the requests of any more are the tenant `other`.
MAX_TENANTS: Final = 32


def model_name(path: str) -> str:
    """The `model` label of an instance: its model file's name without `.gguf` (as placed, any directory)."""
    return path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf") or UNKNOWN


class BoundedLabel:
    """Free text as a label value: its first word as a token (`a-z0-9_`, at most 40 characters; `refused: a rule`
    is `refused`), or a node id as it is; at most `limit` distinct values per family, the rest are `other`."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._seen: dict[str, set[str]] = {}

    def __call__(self, family: str, text: str, *, node_id: bool = False) -> str:
        if node_id:
            value = text if _NODE_ID.match(text) else "other"
        else:
            value = _TOKEN.sub("_", text.split(":", 1)[0].strip().lower()).strip("_")[:40] or "other"
        seen = self._seen.setdefault(family, set())
        if value not in seen:
            if len(seen) >= self.limit:
                return "other"
            seen.add(value)
        return value


class EngineTarget:
    """A ready instance whose llama-server the shell scrapes: where, and the labels its families get."""

    __slots__ = ("instance_id", "labels", "port")

    def __init__(self, instance_id: str, port: int, labels: dict[str, str]) -> None:
        self.instance_id = instance_id
        self.port = port
        self.labels = labels


class _Histogram:
    """One histogram series: counts per bucket (not cumulative; the last one past every bound), sum and count."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, weight: float = 1.0) -> None:
        """`weight` observations of `value` (a request's mean inter-token gap, once per gap)."""
        if not math.isfinite(value) or weight <= 0:
            return
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += weight
        self.sum += value * weight

    def buckets(self) -> list[tuple[str, float]]:
        total, cumulative = 0.0, []
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            cumulative.append((_le(bound), total))
        cumulative.append(("+Inf", total + self.counts[-1]))
        return cumulative


def _le(bound: float) -> str:
    """A bucket's bound as its `le` label (`0.1`, `1.0`, `2560.0`: any float notation reads back the same)."""
    return repr(float(bound))


_SPECS: Final = {spec.name: spec for spec in FAMILIES}


class NodeMetrics:
    """The metrics of node `node_id`: fed its events, records and reports; rendered by `families`."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._instances: dict[str, InstanceStatus] = {}
        self._loads: dict[str, InstanceLoad] = {}
        self._loads_until = -math.inf
        self._ledger: NodeLedger | None = None
        self._telemetry: NodeResources | None = None
        self._l3: L3Inventory | None = None
        self._frontdoor: FrontDoorReport | None = None
        self._counters: dict[str, dict[tuple[str, ...], float]] = {}
        self._histograms: dict[str, dict[tuple[str, ...], _Histogram]] = {}
        self.bounded = BoundedLabel()
        self._tenants: set[str] = set()

    # --- inputs: records and reports -----------------------------------------------------------------------

    def instance_record(self, status: InstanceStatus) -> None:
        if status.node == self.node_id:
            self._instances[status.id] = status

    def instance_removed(self, instance_id: str) -> None:
        """The record is gone: so are the instance's series."""
        self._instances.pop(instance_id, None)
        self._loads.pop(instance_id, None)
        for name, series in self._counters.items():
            if _SPECS[name].per_instance:
                for key in [k for k in series if k[2] == instance_id]:
                    del series[key]

    def keep_instances(self, instance_ids: Iterable[str]) -> None:
        """The records that exist now (a watch's first values): any other instance's record went while nobody
        watched, and its series go with it."""
        for gone in set(self._instances) - set(instance_ids):
            self.instance_removed(gone)

    def ledger(self, ledger: NodeLedger | None) -> None:
        self._ledger = ledger

    def telemetry(self, report: NodeResources | None) -> None:
        self._telemetry = report

    def l3(self, inventory: L3Inventory | None) -> None:
        self._l3 = inventory

    def frontdoor(self, report: FrontDoorReport | None) -> None:
        self._frontdoor = report

    def serving(self, report: ServingReport, now: float) -> None:
        """The runner's latest report: used until it is `ttl_s` old (a runner that stopped sends none)."""
        if report.node_id != self.node_id:
            return
        self._loads = {load.instance_id: load for load in report.instances}
        self._loads_until = now + report.ttl_s

    # --- inputs: events ------------------------------------------------------------------------------------

    def event(self, event: ev.Event) -> None:
        if event.node != self.node_id:
            return
        handler = _ON_EVENT.get(type(event))
        if handler is not None:
            handler(self, event)

    def _add(self, name: str, labels: tuple[str, ...], value: float = 1.0) -> None:
        series = self._counters.setdefault(name, {})
        series[labels] = series.get(labels, 0.0) + value

    def _observe(self, name: str, labels: tuple[str, ...], value: float, weight: float = 1.0) -> None:
        series = self._histograms.setdefault(name, {})
        histogram = series.get(labels)
        if histogram is None:
            histogram = series[labels] = _Histogram(_SPECS[name].buckets)
        histogram.observe(value, weight)

    def _instance(self, instance_id: str) -> tuple[str, str, str] | None:
        """The labels of an instance this node has a record of (None: no record, no per-instance series)."""
        status = self._instances.get(instance_id)
        return (self.node_id, model_name(status.model_path), instance_id) if status is not None else None

    def _model_of(self, instance_id: str) -> str:
        status = self._instances.get(instance_id)
        return model_name(status.model_path) if status is not None else UNKNOWN

    def _completed(self, e: ev.GenerateCompleted) -> None:
        instance = self._instance(e.instance_id)
        if instance is not None:
            endpoint = e.endpoint or "completion"
            self._add("mesh_requests", (*instance, endpoint, self.bounded("mesh_requests", str(e.status))))
            self._add("mesh_prompt_tokens", instance, e.prompt_tokens)
            self._add("mesh_generation_tokens", instance, e.tokens_generated)
            self._add("mesh_prefix_cache_queries", instance, e.prompt_tokens)
            self._add("mesh_prefix_cache_hits", instance, e.tokens_cached)
            self._add("mesh_routed_requests", (*instance, e.source))
            self._add("mesh_restored_tokens", (*instance, e.source), e.tokens_restored)
        if e.status >= 400:  # the server's refusal: no latency or token figures of a generation
            return
        model = (self.node_id, self._model_of(e.instance_id))
        self._add("mesh_request_success", (*model, _FINISHED.get(e.stop_reason, "stop")))
        self._observe("mesh_e2e_request_latency_seconds", model, e.total_ms / 1000)
        if e.endpoint and e.endpoint not in GENERATING_ENDPOINTS:
            return  # token counts, embeddings, rerank: nothing generated
        self._observe("mesh_request_prompt_tokens", model, e.prompt_tokens)
        self._observe("mesh_request_generation_tokens", model, e.tokens_generated)
        if e.tokens_generated > 0:
            self._observe("mesh_time_to_first_token_seconds", model, e.ttft_ms / 1000)
        if e.tokens_generated > 1:  # the decode time spread over the gaps between its tokens
            gaps = e.tokens_generated - 1
            gap_s = max(0.0, e.total_ms - e.ttft_ms) / 1000 / gaps
            self._observe("mesh_inter_token_latency_seconds", model, gap_s, weight=gaps)

    def _cancelled(self, e: ev.GenerateCancelled) -> None:
        self._per_instance("mesh_generations_cancelled", e.instance_id)

    def _routed(self, e: ev.GenerateRouted) -> None:
        if e.decision.chosen is None:  # refused; the model it named is a client's word, never a label
            self._node("mesh_routing_refusals")

    def _restarted(self, e: ev.InstanceRestarted) -> None:
        self._per_instance("mesh_instance_restarts", e.instance_id)

    def _crashed(self, e: ev.InstanceCrashed) -> None:
        self._per_instance("mesh_instance_crashes", e.instance_id, "true" if e.out_of_memory else "false")

    def _check_failed(self, e: ev.HealthCheckFailed) -> None:
        self._per_instance("mesh_health_check_failures", e.instance_id, e.check)

    def _decided(self, e: ev.PlacementDecided) -> None:
        decision = e.decision
        if decision.admitted:
            self._node("mesh_placement_decisions", "admitted", "none")
        else:
            self._node("mesh_placement_decisions", "rejected", str(decision.reason or "other"))

    def _released(self, e: ev.ReservationReleased) -> None:
        self._node("mesh_reservations_released", self.bounded("mesh_reservations_released", e.reason))

    def _captured(self, e: ev.L3Captured) -> None:
        self._node("mesh_l3_captures")
        self._node("mesh_l3_captured_bytes", value=e.bytes)
        self._node("mesh_l3_written_bytes", value=e.new_bytes)

    def _capture_dropped(self, e: ev.L3CaptureDropped) -> None:
        self._node("mesh_l3_capture_drops", self.bounded("mesh_l3_capture_drops", e.reason))

    def _evicted(self, e: ev.L3Evicted) -> None:
        self._node("mesh_l3_evictions", value=len(e.entries))
        self._node("mesh_l3_evicted_bytes", value=e.freed_bytes)

    def _quarantined(self, e: ev.L3Quarantined) -> None:
        self._node("mesh_l3_quarantines")

    def _fetched(self, e: ev.L3Fetched) -> None:
        peer = self.bounded("peer", e.peer, node_id=True)
        self._node("mesh_l3_peer_fetches", peer)
        self._node("mesh_l3_peer_fetched_bytes", peer, value=e.moved_bytes)

    def _handoff_committed(self, e: ev.HandoffCommitted) -> None:
        peer = self.bounded("peer", e.sender_node, node_id=True)
        self._node("mesh_handoffs", peer)
        self._node("mesh_handoff_bytes", peer, value=e.bytes)
        self._observe("mesh_handoff_seconds", (self.node_id, peer), e.transfer_ms / 1000)

    def _handoff_aborted(self, e: ev.HandoffAborted) -> None:
        peer = self.bounded("peer", e.peer, node_id=True)
        role, reason = self.bounded("role", e.role), self.bounded("mesh_handoff_aborts", e.reason)
        self._node("mesh_handoff_aborts", peer, role, reason)

    # The front door's events name catalog models of this node's front door (it refuses any other name first).

    def _model_loaded(self, e: ev.ModelLoaded) -> None:
        self._add("mesh_frontdoor_model_loads", (self.node_id, e.model))
        self._observe("mesh_frontdoor_model_load_seconds", (self.node_id, e.model), e.load_ms / 1000)

    def _room_made(self, e: ev.RoomMade) -> None:
        self._add("mesh_frontdoor_swaps", (self.node_id, e.model))

    def _model_refused(self, e: ev.ModelRefused) -> None:
        reason = self.bounded("mesh_frontdoor_refusals", e.reason)  # "never_fits", or placement's reason
        self._add("mesh_frontdoor_refusals", (self.node_id, e.model, reason))

    def _idle_stopped(self, e: ev.IdleStopped) -> None:
        self._add("mesh_frontdoor_idle_stops", (self.node_id, e.model or UNKNOWN))

    def _request_usage(self, e: ev.RequestUsage) -> None:
        tenant = e.tenant
        if tenant not in self._tenants:
            if len(self._tenants) >= MAX_TENANTS:
                tenant = "other"
            else:
                self._tenants.add(tenant)
        labels = (self.node_id, e.model or UNKNOWN, tenant)
        status = str(e.status) if 100 <= e.status <= 599 else "other"
        self._add("mesh_frontdoor_tenant_requests", (*labels, status), max(1, e.count))
        for kind, tokens in (
            ("prompt", e.prompt_tokens),
            ("cached", e.cached_tokens),
            ("generated", e.generated_tokens),
        ):
            if tokens > 0:
                self._add("mesh_frontdoor_tenant_tokens", (*labels, kind), tokens)

    def _actor_crashed(self, e: ev.ActorCrashed) -> None:
        self._node("mesh_actor_crashes", self.bounded("mesh_actor_crashes", e.actor))

    def _per_instance(self, name: str, instance_id: str, *extra: str) -> None:
        instance = self._instance(instance_id)
        if instance is not None:
            self._add(name, (*instance, *extra))

    def _node(self, name: str, *extra: str, value: float = 1.0) -> None:
        self._add(name, (self.node_id, *extra), value)

    # --- output ----------------------------------------------------------------------------------------------

    def engine_targets(self) -> list[EngineTarget]:
        """The ready instances whose llama-server metrics are re-exported, with their labels."""
        return [
            EngineTarget(s.id, s.port, {"node": self.node_id, "model": model_name(s.model_path), "instance": s.id})
            for s in sorted(self._instances.values(), key=lambda s: s.id)
            if s.state == "ready" and s.port is not None
        ]

    def families(self, now: float, engines: Mapping[str, Sequence[Metric] | None] | None = None) -> list[Metric]:
        """Every family of the catalog (empty ones too: a scraper learns the names), then llama-server's own.
        `engines`: what the shell scraped, per instance id (None: its /metrics did not answer)."""
        engines = engines or {}
        gauges = self._gauges(now, engines)
        out: list[Metric] = []
        for spec in FAMILIES:
            if spec.kind == "counter":
                counter = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
                for labels, value in sorted(self._counters.get(spec.name, {}).items()):
                    counter.add_metric(labels, value)
                out.append(counter)
            elif spec.kind == "histogram":
                histograms = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
                for labels, histogram in sorted(self._histograms.get(spec.name, {}).items()):
                    histograms.add_metric(labels, histogram.buckets(), histogram.sum)
                out.append(histograms)
            else:
                gauge = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
                for labels, value in gauges.get(spec.name, ()):
                    gauge.add_metric(labels, value)
                out.append(gauge)
        out += _merge(m for target in self.engine_targets() for m in (engines.get(target.instance_id) or ()))
        return out

    def _gauges(
        self, now: float, engines: Mapping[str, Sequence[Metric] | None]
    ) -> dict[str, list[tuple[tuple[str, ...], float]]]:
        gauges: dict[str, list[tuple[tuple[str, ...], float]]] = {}

        def put(name: str, labels: tuple[str, ...], value: float) -> None:
            gauges.setdefault(name, []).append((labels, float(value)))

        loads = self._loads if now <= self._loads_until else {}
        for status in sorted(self._instances.values(), key=lambda s: s.id):
            labels = (self.node_id, model_name(status.model_path), status.id)
            for state in INSTANCE_STATES:
                put("mesh_instance_state", (*labels, state), status.state == state)
            context = status.predicted_memory.context.n_ctx
            put("mesh_instance_slots", labels, status.settings.settings.slots)
            put("mesh_instance_context_tokens", labels, context)
            if status.state == "ready" and status.port is not None:
                put("mesh_engine_metrics_up", labels, engines.get(status.id) is not None)
            load = loads.get(status.id)
            if load is not None:
                put("mesh_num_requests_running", labels, load.busy)
                put("mesh_num_requests_waiting", labels, load.queued)
                if context > 0:
                    put("mesh_kv_cache_usage_perc", labels, min(1.0, load.kv_tokens / context))
            if status.state in _ENDED:
                continue  # its server is gone: no memory to show
            predicted = status.predicted_memory
            for kind in PREDICTED_KINDS:
                put("mesh_memory_predicted_bytes", (*labels, kind), getattr(predicted, f"{kind}_bytes"))
            for device in predicted.devices:
                for kind in PREDICTED_KINDS:
                    put("mesh_memory_predicted_device_bytes", (*labels, device.device, kind),
                        getattr(device, f"{kind}_bytes"))  # fmt: skip
            observed = status.observed_memory
            if observed is not None:
                for kind in OBSERVED_KINDS:
                    put("mesh_memory_observed_bytes", (*labels, kind), getattr(observed, f"{kind}_bytes"))
                for buffer, size in sorted(observed.devices.items()):
                    put("mesh_memory_observed_buffer_bytes", (*labels, buffer), size)
        self._memory_gauges(put)
        self._store_gauges(put)
        return gauges

    def _memory_gauges(self, put: Callable[[str, tuple[str, ...], float], None]) -> None:
        node = self.node_id
        held: dict[tuple[str, str], int] = {}
        for r in self._ledger.reservations if self._ledger is not None else ():
            for device, size in r.held.items():
                held[device, r.state] = held.get((device, r.state), 0) + size
        devices = sorted({d for d, _ in held} | set(device_sizes(self._telemetry) if self._telemetry else ()))
        for device in devices:
            for state in RESERVATION_STATES:
                put("mesh_node_memory_reserved_bytes", (node, device, state), held.get((device, state), 0))
        if self._telemetry is not None:
            for device, (size, usable) in sorted(device_sizes(self._telemetry).items()):
                put("mesh_node_memory_size_bytes", (node, device), size)
                put("mesh_node_memory_usable_bytes", (node, device), usable)
            for device, free in sorted(available(self._telemetry, self._ledger).items()):
                put("mesh_node_memory_available_bytes", (node, device), free)

    def _store_gauges(self, put: Callable[[str, tuple[str, ...], float], None]) -> None:
        node = (self.node_id,)
        if self._l3 is not None:
            store = self._l3
            put("mesh_l3_stored_bytes", node, store.bytes)
            put("mesh_l3_budget_bytes", node, store.budget_bytes)
            put("mesh_l3_entries", node, store.entries)
            put("mesh_l3_tokens", node, store.tokens)
            put("mesh_l3_quarantined_entries", node, store.quarantined)
            put("mesh_l3_eviction_blocked", node, store.eviction_blocked)
        for m in self._frontdoor.models if self._frontdoor is not None else ():
            labels = (self.node_id, m.name)
            put("mesh_frontdoor_queued_requests", labels, m.queued)
            put("mesh_frontdoor_inflight_requests", labels, m.active)
            put("mesh_frontdoor_model_held_bytes", labels, m.held_bytes)
            for state in FRONTDOOR_STATES:
                put("mesh_frontdoor_model_state", (*labels, state), m.state == state)


def _merge(families: Iterable[Metric]) -> list[Metric]:
    """One family per name (several instances' relabelled families of one name are one family)."""
    merged: dict[str, Metric] = {}
    for family in families:
        into = merged.get(family.name)
        if into is None:
            into = merged[family.name] = Metric(family.name, family.documentation, family.type)
        if into.type == family.type:
            into.samples += family.samples
    return list(merged.values())


#: What each event does to the figures (events of other types change nothing here).
_ON_EVENT: Final[dict[type[ev.Event], Callable[[NodeMetrics, Any], None]]] = {
    ev.GenerateCompleted: NodeMetrics._completed,
    ev.GenerateCancelled: NodeMetrics._cancelled,
    ev.GenerateRouted: NodeMetrics._routed,
    ev.InstanceRestarted: NodeMetrics._restarted,
    ev.InstanceCrashed: NodeMetrics._crashed,
    ev.HealthCheckFailed: NodeMetrics._check_failed,
    ev.PlacementDecided: NodeMetrics._decided,
    ev.ReservationReleased: NodeMetrics._released,
    ev.L3Captured: NodeMetrics._captured,
    ev.L3CaptureDropped: NodeMetrics._capture_dropped,
    ev.L3Evicted: NodeMetrics._evicted,
    ev.L3Quarantined: NodeMetrics._quarantined,
    ev.L3Fetched: NodeMetrics._fetched,
    ev.HandoffCommitted: NodeMetrics._handoff_committed,
    ev.HandoffAborted: NodeMetrics._handoff_aborted,
    ev.ModelLoaded: NodeMetrics._model_loaded,
    ev.RoomMade: NodeMetrics._room_made,
    ev.ModelRefused: NodeMetrics._model_refused,
    ev.IdleStopped: NodeMetrics._idle_stopped,
    ev.RequestUsage: NodeMetrics._request_usage,
    ev.ActorCrashed: NodeMetrics._actor_crashed,
}

#: The `type` tags of the events that change a figure: the shell decodes no other event.
EVENT_TYPES: Final = frozenset(str(event_class.__struct_config__.tag) for event_class in _ON_EVENT)
