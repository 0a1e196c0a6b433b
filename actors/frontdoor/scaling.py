"""Replicas that follow the load: when to add an instance of a catalog model, and which one to retire (front-door
core, pure).

Rules this module keeps:

* A model keeps `min_replicas` instances (starting or ready): fewer, and one is added, whatever the load.
* The expected wait of a ready replica is its queued work over its measured rates: the queued prompts' tokens
  over its prefill rate, plus what the queued requests may generate over its decode rate times its slots. A
  new request goes where routing sends it, at best the replica that would wait least: the model's expected wait
  is that least one. A replica with queued work and no measured rate yet says nothing (no decision on a guess).
* One is added when that wait stays over `target_wait_s` for `UP_HOLD_S` (hysteresis: a blip adds nothing),
  while there are fewer than `max_replicas` and none is still starting (one addition at a time: the next is
  decided with the new one counted).
* One is retired when there are more than `max(min_replicas, 1)` (or more than `max_replicas`), none starts,
  no replica has queued work, and a replica has had no work for `retire_idle_s`: the one idle longest, then the
  one holding the fewest resident tokens (the least useful to routing), then the lowest id. Never one that is
  generating or has requests waiting.
* Everything a decision used is in `ModelScale`, `ScaleMemory` and `now`: `mesh-actor replay` re-decides it.
* Where a new replica should go first (`warm_nodes`): the nodes whose L3 stores hold the most tokens of the
  model's states (the identities its replicas run with), most first; placement takes them in that order among
  the nodes that hold the model's file alike (`PlacementRequest.prefer`), so the new replica restores its
  hottest prefixes from its own disk rather than fetching them. Its inputs (the stores' inventories) are not
  journaled; its answer is (`replica_added.preferred`, and the placement request placement journals), so the
  placement replays, this ordering does not.
* No clock and no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import msgspec

from actors.placement.admission import natural_key
from messages.frontdoor import ModelScale, Replica, ScaleAction, ScaleDecision, ScaleMemory
from messages.l3 import L3Inventory

__all__ = ["FORGET", "UP_HOLD_S", "decide", "expected_wait_s", "replay", "warm_nodes"]

#: How long the expected wait must stay over the target before a replica is added.
UP_HOLD_S = 2.0


def expected_wait_s(replica: Replica) -> float | None:
    """How long a request sent to `replica` now would wait for a slot; None when it cannot be told yet."""
    if replica.queued == 0:
        return 0.0
    if replica.prefill_tokens_per_s <= 0 or replica.decode_tokens_per_s <= 0:
        return None
    prefill = replica.queued_prompt_tokens / replica.prefill_tokens_per_s
    decode = replica.queued_generation_tokens / (replica.decode_tokens_per_s * max(1, replica.slots))
    return prefill + decode


#: A model with nothing to remember (no wait over its target).
FORGET = ScaleMemory()


def decide(scale: ModelScale, memory: ScaleMemory, now: float) -> ScaleDecision:
    """What to do for one model now."""
    replicas = scale.replicas
    ready = [r for r in replicas if r.ready]
    starting = len(replicas) - len(ready)
    known = [w for w in map(expected_wait_s, ready) if w is not None]
    wait = min(known) if known else None

    def decision(
        action: ScaleAction, reason: str, kept: ScaleMemory = FORGET, retire: str | None = None
    ) -> ScaleDecision:
        return ScaleDecision(
            model=scale.model, action=action, reason=reason, expected_wait_s=wait, memory=kept, retire=retire
        )

    if len(replicas) < scale.min_replicas:
        return decision("add", f"{len(replicas)} replicas, below min_replicas {scale.min_replicas}")
    over = wait is not None and wait > scale.target_wait_s
    if over and starting == 0 and len(replicas) < scale.max_replicas:
        since = memory.over_since if memory.over_since is not None else now
        held_s = now - since
        target = f"over the target {scale.target_wait_s:g}s for {held_s:.1f}s"
        if held_s >= UP_HOLD_S:
            return decision("add", f"expected wait {wait:.2f}s {target}")
        return decision("hold", f"expected wait {wait:.2f}s {target}", ScaleMemory(over_since=since))
    keep = max(scale.min_replicas, 1)
    if starting == 0 and len(replicas) > keep and all(r.queued == 0 for r in replicas):
        if len(replicas) > scale.max_replicas:  # over the maximum (the catalog changed): any idle one
            idle = [r for r in ready if r.busy == 0]
        else:
            idle = [r for r in ready if r.busy == 0 and r.idle_s >= scale.retire_idle_s]
        if idle:
            chosen = min(idle, key=lambda r: (-r.idle_s, r.resident_tokens, r.instance_id))
            reason = f"{len(replicas)} replicas, {chosen.instance_id} idle for {chosen.idle_s:.0f}s"
            return decision("retire", reason, retire=chosen.instance_id)
    return decision("hold", "over the target, at the most replicas or one starting" if over else "within the target")


def replay(scale: ModelScale, memory: ScaleMemory, now: float, recorded: ScaleDecision) -> list[tuple[str, Any, Any]]:
    """How today's rules differ from a recorded decision: (field, recorded, now) for each that differs."""
    again = decide(scale, memory, now)
    fields = ("action", "retire", "expected_wait_s", "memory")
    return [
        (name, msgspec.to_builtins(getattr(recorded, name)), msgspec.to_builtins(getattr(again, name)))
        for name in fields
        if msgspec.to_builtins(getattr(recorded, name)) != msgspec.to_builtins(getattr(again, name))
    ]


def warm_nodes(
    inventories: Iterable[L3Inventory], identities: Collection[str], candidates: Collection[str]
) -> tuple[str, ...]:
    """The `candidates` whose L3 stores hold states of `identities`, by tokens held (most first; ties in
    natural order)."""
    held: dict[str, int] = {}
    for inventory in inventories:
        if inventory.node_id in candidates:
            tokens = sum(item.n_tokens for item in inventory.items if item.identity in identities)
            if tokens > 0:
                held[inventory.node_id] = tokens
    return tuple(sorted(held, key=lambda node: (-held[node], natural_key(node))))
