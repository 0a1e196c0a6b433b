"""A decision with its inputs, and what today's cores decide from them (dashboard core, pure).

For a `placement_decided` event: the request, the cluster view it was made from (each node's report, its
revision and age), the ledgers, the model's header facts, and the decision; when those inputs were recorded
inline, `actors.placement.replay.recompute` runs them through today's admission (with the header facts as
recorded: `mesh-actor replay` reads the model file again, which the page does not). Inputs kept in a side record
(a large view) are named, not fetched. For a `generate_routed` event: the prompt's length, the candidates with
their load and held prefixes, the weights and links, the decision, and the router's decision from them now.
This is what `mesh-actor replay` re-decides, shown for one event.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.placement.replay import differences, recompute
from actors.router.routing import route
from messages.events import GenerateRouted, PlacementDecided

__all__ = ["explain"]

_ROUTED = msgspec.json.Decoder(GenerateRouted)
_DECIDED = msgspec.json.Decoder(PlacementDecided)


def explain(data: bytes) -> dict[str, Any]:
    """The decision of one stored event (`placement_decided` or `generate_routed`) with its inputs, and its
    replay: `{"same": bool, "differences": [...]}`, or `{"error": ...}` when it cannot be re-decided here."""
    raw: Any = msgspec.json.decode(data)
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "generate_routed":
        return _routing(raw, data)
    if kind == "placement_decided":
        return _placement(raw, data)
    raise ValueError(f"not a decision event: {kind!r}")


def _routing(raw: dict[str, Any], data: bytes) -> dict[str, Any]:
    inputs = {k: raw.get(k) for k in ("model", "n_prompt", "candidates", "weights", "links", "link_fixed_s")}
    detail: dict[str, Any] = {"kind": "routing", "event": _envelope(raw), "decision": raw.get("decision"),
                              "inputs": {**inputs, "router_version": raw.get("router_version")}}  # fmt: skip
    try:
        routed = _ROUTED.decode(data)
    except msgspec.ValidationError as exc:
        detail["replay"] = {"error": f"a routing this version cannot read: {exc}"}
        return detail
    now = route(routed.n_prompt, routed.candidates, routed.weights, routed.links, routed.link_fixed_s)
    detail["replay"] = _compared(routed.decision, now)
    return detail


def _placement(raw: dict[str, Any], data: bytes) -> dict[str, Any]:
    names = ("request", "view_revisions", "view_ages", "ledgers", "geometry", "model_path", "unreadable_ledgers")
    inputs = {k: raw.get(k) for k in names}
    inputs["view"] = raw.get("view")
    detail: dict[str, Any] = {"kind": "placement", "event": _envelope(raw), "decision": raw.get("decision"),
                              "inputs": inputs, "record": raw.get("record")}  # fmt: skip
    try:
        decided = _DECIDED.decode(data)
    except msgspec.ValidationError as exc:
        detail["replay"] = {"error": f"a decision this version cannot read: {exc}"}
        return detail
    if decided.record is not None:
        detail["replay"] = {"error": "its inputs are in a side record: `mesh-actor replay` fetches and re-decides it"}
    elif decided.geometry is None:
        detail["replay"] = {"error": "the model's header was unreadable when it was decided"}
    else:
        try:
            detail["replay"] = _compared(decided.decision, recompute(decided, decided.geometry))
        except (ValueError, KeyError, TypeError) as exc:  # inputs today's core refuses: say so, do not fail
            detail["replay"] = {"error": f"today's admission cannot re-decide it: {exc}"}
    return detail


def _compared(recorded: msgspec.Struct, now: msgspec.Struct) -> dict[str, Any]:
    found = differences(recorded, now)
    return {
        "same": not found,
        "now": msgspec.to_builtins(now),
        "differences": [{"path": d.path, "recorded": d.recorded, "now": d.now} for d in found],
    }


def _envelope(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: raw.get(k) for k in ("id", "time", "node", "actor", "type")}
