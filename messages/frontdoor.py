"""The front door's state, as `mesh-actor models` and `status` show it.

Each node running a front door (`mesh-actor run --http`) publishes a `FrontDoorReport` under its node id in the
`MESH_FRONTDOORS` KV bucket (per-key TTL, refreshed every few seconds and on change).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from messages.placement import PreferredSettings

ModelState = Literal["ready", "starting", "stopped"]


class FrontDoorModel(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    path: str
    state: ModelState
    instances: tuple[str, ...]  # ready instances of it (any node)
    held_bytes: int  # what their reservations hold, all devices
    queued: int  # requests waiting here for an instance
    active: int  # requests generating from here
    pinned: bool
    priority: int
    idle_ttl_s: float | None
    ctx: int | None = None  # -c its instances are placed with
    max_queue: int | None = None  # requests that may wait for it here (beyond: 429)
    settings: PreferredSettings | None = None  # serving settings its instances must run with (None: the node's)


class FrontDoorReport(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    address: str  # http://HOST:PORT
    auth: bool  # whether a bearer key is required
    models: tuple[FrontDoorModel, ...]
    sent_at: float
