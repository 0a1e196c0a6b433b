"""Journal events: every decision and lifecycle change, published on `mesh.events.<actor>.<type>`.

Each event is a frozen Struct tagged by `type` and carries the envelope fields `id` (unique, used as the
JetStream `Nats-Msg-Id` so a retried publish is stored once), `time` (unix seconds), `node` and `actor`.
Readers that meet a type they do not know (a newer producer) still show it as plain JSON.
"""

from __future__ import annotations

from typing import Any

import msgspec

from messages.telemetry import NodeResources


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Envelope shared by every event."""

    id: str
    time: float
    node: str
    actor: str


class ActorStarted(Event, frozen=True, kw_only=True, tag="actor_started"):
    attempt: int  # 1 for the first start, n for the (n-1)th restart


class ActorCrashed(Event, frozen=True, kw_only=True, tag="actor_crashed"):
    error: str
    crashes_in_window: int
    restart_in_s: float


class ActorRestarted(Event, frozen=True, kw_only=True, tag="actor_restarted"):
    attempt: int


class ActorGaveUp(Event, frozen=True, kw_only=True, tag="actor_gave_up"):
    """The actor crashed more often than its restart intensity allows and is stopped for good."""

    error: str
    crashes: int
    window_s: float


class ActorStopped(Event, frozen=True, kw_only=True, tag="actor_stopped"):
    pass


class NodeStarted(Event, frozen=True, kw_only=True, tag="node_started"):
    version: str
    nats_url: str
    embedded_nats: bool
    actors: tuple[str, ...]


class NodeStopped(Event, frozen=True, kw_only=True, tag="node_stopped"):
    reason: str


class TelemetryChanged(Event, frozen=True, kw_only=True, tag="telemetry_changed"):
    """The node's advertisement changed in a way placement cares about (first report, settings, devices)."""

    reason: str
    resources: NodeResources


AnyEvent = (
    ActorStarted
    | ActorCrashed
    | ActorRestarted
    | ActorGaveUp
    | ActorStopped
    | NodeStarted
    | NodeStopped
    | TelemetryChanged
)


def event_type(event: Event) -> str:
    """The `type` tag of an event (also the last token of its subject)."""
    tag: Any = type(event).__struct_config__.tag
    return str(tag)
