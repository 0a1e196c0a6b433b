"""A placement decision by brute force, for tests only: every node of the view judged in turn by admission's
per-node rules, every eligible one sized at the request's context (or its own ceiling), then the choice, or
a split when none fits and the request allows one.

This is how placement decided before the fleet index (`actors/placement/fleet.py`) took every request; the
product decides only through the index now, and property tests (`tests/unit/test_fleet_index.py`) hold the
index to this statement, field for field, on random fleets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from actors.placement import pooled
from actors.placement.admission import (
    Fit,
    ModelFacts,
    Outcome,
    ViewEntry,
    conclude,
    conclude_split,
    fit_node,
    natural_key,
    refusal_of,
    settings_on,
    split_over,
    without_split,
)
from actors.placement.fleet import brief
from actors.placement.ledger import available
from messages.placement import NodeLedger, NodeRejection, PlacementRequest


def _eligible(
    request: PlacementRequest, view: Mapping[str, ViewEntry], now: float, unreadable: frozenset[str]
) -> tuple[list[ViewEntry], list[NodeRejection]]:
    eligible: list[ViewEntry] = []
    rejections: list[NodeRejection] = []
    for name in request.nodes or sorted(view, key=natural_key):
        entry = view.get(name)
        refusal = refusal_of(request, name, entry, entry.age(now) if entry else 0.0, name in unreadable)
        if refusal is not None:
            rejections.append(refusal)
        else:
            assert entry is not None
            eligible.append(entry)
    return eligible, rejections


def full_scan(
    request: PlacementRequest,
    model: ModelFacts,
    view: Mapping[str, ViewEntry],
    ledgers: Mapping[str, NodeLedger],
    *,
    now: float,
    decision_id: str,
    reservation_id: str,
    dry_run: bool,
    unreadable: frozenset[str] = frozenset(),
) -> Outcome:
    """What `fleet.decide` answers: the whole decision (`explained_scan`), brief unless the request asks for
    every node's refusal (`fleet.brief`: the chosen node only, or the refusals closest to fitting)."""
    outcome = explained_scan(
        request, model, view, ledgers, now=now, decision_id=decision_id, reservation_id=reservation_id,
        dry_run=dry_run, unreadable=unreadable,
    )  # fmt: skip
    if request.explain:
        return outcome
    return dataclasses.replace(outcome, decision=brief(outcome.decision))


def explained_scan(
    request: PlacementRequest,
    model: ModelFacts,
    view: Mapping[str, ViewEntry],
    ledgers: Mapping[str, NodeLedger],
    *,
    now: float,
    decision_id: str,
    reservation_id: str,
    dry_run: bool,
    unreadable: frozenset[str] = frozenset(),
) -> Outcome:
    """The whole decision, every node sized and every refusal listed (`unreadable`: nodes whose ledger does not
    decode)."""
    geometry = model.geometry
    request = pooled.resolved_request(request, geometry)  # an embedding or rerank model by its header
    eligible, rejections = _eligible(request, view, now, unreadable)
    haves = {e.resources.node_id: available(e.resources, ledgers.get(e.resources.node_id)) for e in eligible}
    fits: list[Fit] = []
    for entry in eligible:
        settings = settings_on(entry.resources, request.settings)  # _eligible kept nodes that advertise settings
        result = fit_node(
            request, geometry, entry, settings, haves[entry.resources.node_id], layers=(0, geometry.n_layer),
            draft=model.draft, projector=model.projector,
        )  # fmt: skip
        if isinstance(result, NodeRejection):
            rejections.append(result)
        else:
            fits.append(result)
    if not fits and request.allow_multi_node:
        split, why = split_over(request, model, eligible, haves)
        if split is not None:
            return conclude_split(
                request, model, view, split, rejections, now=now, decision_id=decision_id,
                reservation_id=reservation_id, dry_run=dry_run,
            )  # fmt: skip
        refused = conclude(
            request, model, view, fits, rejections, now=now, decision_id=decision_id, reservation_id=reservation_id,
            dry_run=dry_run,
        )  # fmt: skip
        return without_split(refused, why)
    return conclude(
        request, model, view, fits, rejections, now=now, decision_id=decision_id, reservation_id=reservation_id,
        dry_run=dry_run,
    )  # fmt: skip


__all__ = ["explained_scan", "full_scan"]
