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


# ---- replicas (`actors/frontdoor/scaling.py`: inputs and outcome, journaled as `scaling_decided`) ----


class Replica(msgspec.Struct, frozen=True, kw_only=True):
    """One instance of a catalog model as the scaler saw it: from its record (state) and its node's serving
    report (load, queued work, measured rates)."""

    instance_id: str
    node: str
    ready: bool  # False: starting
    slots: int = 1
    busy: int = 0
    queued: int = 0
    queued_prompt_tokens: int = 0  # the prompts of the requests waiting for a slot
    queued_generation_tokens: int = 0  # what they may generate (their bounds)
    prefill_tokens_per_s: float = 0.0  # measured; 0: not yet
    decode_tokens_per_s: float = 0.0  # one slot's, measured; 0: not yet
    idle_s: float = 0.0  # since it last had work (a busy slot or a waiter); 0 while it has
    resident_tokens: int = 0  # what its slots hold (prefixes routing may still credit)


class ModelScale(msgspec.Struct, frozen=True, kw_only=True):
    """A catalog model's replicas and its scaling rules, at one moment."""

    model: str
    min_replicas: int
    max_replicas: int
    target_wait_s: float
    retire_idle_s: float
    replicas: tuple[Replica, ...]


class ScaleMemory(msgspec.Struct, frozen=True, kw_only=True):
    """What the scaler remembers of a model between decisions (its hysteresis)."""

    over_since: float | None = None  # since when the expected wait is over the target


ScaleAction = Literal["hold", "add", "retire"]


class ScaleDecision(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    action: ScaleAction
    reason: str
    expected_wait_s: float | None  # the least a request would wait on a ready replica (None: not measured)
    memory: ScaleMemory  # what to remember for the next decision
    retire: str | None = None  # the instance to stop
