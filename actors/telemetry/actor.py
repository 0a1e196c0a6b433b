"""Telemetry actor (shell): reports this node's resources every few seconds and on change.

Each report goes to `mesh.telemetry.<node>` and into the nodes KV bucket under the node id with a
per-message TTL, so a node that stops reporting disappears from the bucket (watchers see a delete marker).
Material changes (first report, settings, devices, engine) are journal events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import msgspec
import nats.errors

from actors.telemetry.probes import Nvml, read_host
from actors.telemetry.resources import HostReading, NodeFacts, NvmlReading, build_report, material_change, usable_moved
from messages.events import TelemetryChanged
from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import ModelFiles, NodeResources
from runtime import buckets
from runtime.actor import Actor, ActorContext
from runtime.buckets import TTL_HEADER
from runtime.bus import encode


class TelemetryActor(Actor):
    name = "telemetry"
    description = "node resources and serving settings"

    def __init__(
        self,
        facts: NodeFacts,
        settings_source: Callable[[], ServingSettings] | None = None,
        *,
        bounds_source: Callable[[], SettingsBounds | None] | None = None,
        files_source: Callable[[], ModelFiles | None] = lambda: None,
        interval_s: float,
        probe_interval_s: float = 1.0,
        read_host_fn: Callable[[], HostReading] = read_host,
        nvml: Nvml | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.facts = facts
        # The node's serving settings may be reloaded while it runs (SIGHUP): read them at every report.
        self._settings = settings_source or (lambda: facts.settings)
        self._bounds = bounds_source or (lambda: facts.bounds)
        self._files = files_source  # the model files this node holds (its files actor's), read at every report
        self.interval_s = interval_s
        self.probe_interval_s = min(probe_interval_s, interval_s)
        self._read_host = read_host_fn
        self._nvml = nvml or Nvml()
        self._clock = clock
        self._seq = 0
        self._last_sent: NodeResources | None = None
        self._last_journaled: NodeResources | None = None

    async def run(self, ctx: ActorContext) -> None:
        await buckets.nodes(ctx.bus, ctx.subjects)
        ctx.spawn(self._report_loop(ctx), "report")

    def _read(self) -> tuple[HostReading, NvmlReading]:
        return self._read_host(), self._nvml.read()

    async def _report_loop(self, ctx: ActorContext) -> None:
        self._nvml.open()
        try:
            while True:
                host, nvml = await asyncio.to_thread(self._read)
                self._seq += 1
                facts = dataclasses.replace(self.facts, settings=self._settings(), bounds=self._bounds())
                report = build_report(facts, seq=self._seq, now=self._clock(), host=host, nvml=nvml)
                report = msgspec.structs.replace(report, model_files=self._files())
                last = self._last_sent
                due = last is None or report.sent_at - last.sent_at >= self.interval_s
                reason = material_change(self._last_journaled, report)
                if due or reason is not None or (last is not None and usable_moved(last, report)):
                    await self._send(ctx, report)
                if reason is not None:
                    ctx.emit(TelemetryChanged, reason=reason, resources=report)
                    self._last_journaled = report
                await asyncio.sleep(self.probe_interval_s)
        finally:
            self._nvml.close()

    async def _send(self, ctx: ActorContext, report: NodeResources) -> None:
        payload = encode(report)
        ctx.bus.check_size(ctx.subjects.telemetry(report.node_id), payload)
        await ctx.bus.nc.publish(ctx.subjects.telemetry(report.node_id), payload)
        ttl = max(1, round(report.ttl_s))
        try:
            await ctx.bus.js.publish(
                f"$KV.{ctx.subjects.nodes_bucket}.{report.node_id}",
                payload,
                timeout=min(5.0, self.interval_s),
                headers={TTL_HEADER: f"{ttl}s"},
            )
        except (nats.errors.Error, TimeoutError) as exc:
            # NATS is away (it reconnects by itself); the next report retries. Not a crash.
            ctx.log.warning("telemetry_kv_put_failed", error=str(exc) or type(exc).__name__)
        self._last_sent = report
