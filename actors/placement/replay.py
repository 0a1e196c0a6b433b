"""Replay (placement core, pure): recompute a recorded decision with today's core and say what differs.

A `placement_decided` event carries the request, the cluster view and ledgers the decision saw, the
model geometry and the time; replaying feeds them to `decide` again. Fields that identify the decision
rather than describe it (its id, time, the estimator version) are not compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from actors.placement.admission import ModelFacts, Outcome, ViewEntry, decide
from messages.events import PlacementDecided
from messages.model import ModelGeometry
from messages.placement import PlacementDecision

_IGNORED = frozenset({"decision_id", "decided_at", "estimator_version", "llama_cpp_version", "compute_error_ratio"})

DecideFn = Callable[..., Outcome]


@dataclass(frozen=True, slots=True)
class Difference:
    path: str
    recorded: Any
    now: Any


def recompute(event: PlacementDecided, geometry: ModelGeometry, *, decide_fn: DecideFn = decide) -> PlacementDecision:
    """The decision today's core makes from the recorded inputs."""
    recorded = event.decision
    view = {n.node_id: ViewEntry(resources=n, revision=event.view_revisions.get(n.node_id, 0)) for n in event.view}
    ledgers = {ledger.node_id: ledger for ledger in event.ledgers}
    facts = ModelFacts(geometry=geometry, path=event.model_path or "", digest=recorded.model_digest)
    outcome = decide_fn(
        event.request,
        facts,
        view,
        ledgers,
        now=recorded.decided_at,
        decision_id=recorded.decision_id,
        reservation_id=recorded.reservation_id or "",
        dry_run=recorded.dry_run,
        unreadable=frozenset(event.unreadable_ledgers),
    )
    return outcome.decision


def differences(recorded: PlacementDecision, now: PlacementDecision) -> list[Difference]:
    """Every leaf that differs between two decisions, as JSON paths (`$.stamp.settings.slots`)."""
    found: list[Difference] = []
    _walk("$", msgspec.to_builtins(recorded), msgspec.to_builtins(now), found)
    return found


def _walk(path: str, old: Any, new: Any, found: list[Difference]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if key in _IGNORED:
                continue
            _walk(f"{path}.{key}", old.get(key), new.get(key), found)
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _walk(f"{path}[{i}]", a, b, found)
    elif old != new:
        found.append(Difference(path, old, new))
