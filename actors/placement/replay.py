"""Replay (placement core, pure): recompute a recorded decision with today's core and say what differs.

A decision's inputs (`DecisionInputs`: the request, the cluster view with each report's age, the ledgers,
the model geometry and the time) travel inline in its `placement_decided` event, or, for a large view, in
a side record named by its blake3 digest (the shell fetches it; `inputs_of` says which). Replaying feeds
them to `decide` again. Fields that identify the decision rather than describe it (its id, time, the
estimator version) are not compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from actors.placement.admission import ModelFacts, Outcome, ViewEntry
from actors.placement.fleet import decide
from messages.events import DecisionInputs, PlacementDecided
from messages.model import ModelGeometry
from messages.placement import Companion, PlacementDecision

_IGNORED = frozenset({"decision_id", "decided_at", "estimator_version", "llama_cpp_version", "compute_error_ratio"})

DecideFn = Callable[..., Outcome]


@dataclass(frozen=True, slots=True)
class Difference:
    path: str
    recorded: Any
    now: Any


def inputs_of(event: PlacementDecided) -> DecisionInputs | None:
    """The inputs an event carries inline; None when they are in its side record (`event.record`)."""
    if event.record is not None:
        return None
    return DecisionInputs(
        request=event.request,
        view=event.view,
        view_revisions=event.view_revisions,
        view_ages=event.view_ages,
        ledgers=event.ledgers,
        geometry=event.geometry,
        model_path=event.model_path,
        unreadable_ledgers=event.unreadable_ledgers,
        decision=event.decision,
        draft_geometry=event.draft_geometry,
        projector_geometry=event.projector_geometry,
    )


def recompute(
    recorded: DecisionInputs | PlacementDecided, geometry: ModelGeometry, *, decide_fn: DecideFn = decide
) -> PlacementDecision:
    """The decision today's core makes from the recorded inputs (an event with inline inputs, or a record)."""
    inputs = inputs_of(recorded) if isinstance(recorded, PlacementDecided) else recorded
    if inputs is None:
        raise ValueError("the event's inputs are in its side record: fetch the record and replay that")
    decision = inputs.decision
    view = {
        n.node_id: ViewEntry(
            resources=n, revision=inputs.view_revisions.get(n.node_id, 0), age_s=inputs.view_ages.get(n.node_id)
        )
        for n in inputs.view
    }
    ledgers = {ledger.node_id: ledger for ledger in inputs.ledgers}
    facts = ModelFacts(
        geometry=geometry,
        path=inputs.model_path or "",
        digest=decision.model_digest,
        draft=inputs.draft_geometry,
        draft_file=_companion(decision.stamp.draft if decision.stamp else None, inputs.request.model.draft),
        projector=inputs.projector_geometry,
        projector_file=_companion(decision.stamp.mmproj if decision.stamp else None, inputs.request.model.mmproj),
    )
    outcome = decide_fn(
        inputs.request,
        facts,
        view,
        ledgers,
        now=decision.decided_at,
        decision_id=decision.decision_id,
        reservation_id=decision.reservation_id or "",
        dry_run=decision.dry_run,
        unreadable=frozenset(inputs.unreadable_ledgers),
    )
    return outcome.decision


def _companion(stamped: Companion | None, requested: str | None) -> Companion | None:
    """A companion file as the decision stamped it, or as the request named it (a refusal stamps nothing)."""
    if stamped is not None:
        return stamped
    return Companion(path=requested) if requested is not None else None


def differences(recorded: msgspec.Struct, now: msgspec.Struct) -> list[Difference]:
    """Every leaf that differs between two decisions (placement or routing), as JSON paths
    (`$.stamp.settings.slots`)."""
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
