"""Admission (placement core, pure): a request, the cluster view and the ledgers in; one decision out.

Rules this module keeps:
- Settings are stamped from what a node advertises, never from the request. A client may *require*
  settings; a node advertising something else is refused with `settings_mismatch` naming the fields.
- A node is eligible only with fresh telemetry (`now - sent_at <= ttl_s`) and advertised serving settings.
- Each node is sized with the memory model against what its ledger says is available on each device
  (`actors.placement.ledger`); the decision carries the breakdown per device, need and have.
- One node is preferred: among the nodes that fit, the one left with the most headroom on its tightest
  device (ties by node id), so load spreads. Only when no single node fits are layers split over the
  smallest number of nodes (largest first), in proportion to what each can hold; the head node runs the
  server with its settings, and every node's share must fit.
- Without `ctx`, or with `max_ctx`, the context is the largest that fits, capped at the model's
  training context; it is always one llama-server can build (multiples of 256 cells per stream).
Nothing here reads a clock, a file or the bus: `now` and the ids are passed in, which is what lets
`mesh-actor replay` recompute a recorded decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from actors.placement.ledger import available
from actors.placement.memory import (
    CELL_PAD,
    ESTIMATOR_VERSION,
    Budgets,
    MemoryModelError,
    estimate,
    max_context,
)
from messages.memory import DeviceMemory, MemoryBreakdown
from messages.model import ModelGeometry
from messages.placement import (
    DeviceShortfall,
    ModelRef,
    NodeLedger,
    NodePlacement,
    NodeRejection,
    PlacementDecision,
    PlacementRequest,
    PreferredSettings,
    RejectReason,
    Reservation,
    Stamp,
)
from messages.settings import ServingSettings
from messages.telemetry import NodeResources


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The model as admission needs it: its geometry, where nodes find the file, its digest if known."""

    geometry: ModelGeometry
    path: str
    digest: str | None = None


@dataclass(frozen=True, slots=True)
class ViewEntry:
    resources: NodeResources
    revision: int


@dataclass(frozen=True, slots=True)
class Outcome:
    decision: PlacementDecision
    reservations: tuple[Reservation, ...] = ()  # one per node to add to its ledger (none when rejected/dry run)


@dataclass(frozen=True, slots=True)
class _Fit:
    entry: ViewEntry
    settings: ServingSettings
    breakdown: MemoryBreakdown
    ctx: int
    ceiling: int | None
    headroom: int
    n_gpu_layers: int
    gpu_split: tuple[float, ...]
    layers: tuple[int, int]


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 20):.1f} MiB"


def _mismatch(required: PreferredSettings | None, advertised: ServingSettings) -> tuple[str, ...]:
    if required is None:
        return ()
    fields = []
    for name in PreferredSettings.__struct_fields__:
        wanted = getattr(required, name)
        if wanted is not None and getattr(advertised, name) != wanted:
            fields.append(name)
    return tuple(fields)


def _eligible(
    request: PlacementRequest, view: Mapping[str, ViewEntry], now: float, unreadable: frozenset[str]
) -> tuple[list[ViewEntry], list[NodeRejection]]:
    eligible: list[ViewEntry] = []
    rejections: list[NodeRejection] = []
    for name in request.nodes or sorted(view):
        entry = view.get(name)
        if entry is None:
            rejections.append(NodeRejection(node_id=name, reason="not_found", message="no telemetry from this node"))
            continue
        node = entry.resources
        age = now - node.sent_at
        if age > node.ttl_s:
            rejections.append(
                NodeRejection(
                    node_id=name,
                    reason="telemetry_stale",
                    message=f"last report {age:.1f}s ago, older than its {node.ttl_s:g}s TTL",
                )
            )
        elif name in unreadable:
            rejections.append(
                NodeRejection(
                    node_id=name,
                    reason="ledger_unreadable",
                    message="the node's reservation ledger does not decode; nothing can be booked there until fixed",
                )
            )
        elif node.settings is None:
            why = node.llama_server_error or "no llama-server"
            rejections.append(
                NodeRejection(
                    node_id=name,
                    reason="settings_unknown",
                    message=f"the node has not advertised serving settings ({why})",
                )
            )
        elif fields := _mismatch(request.settings, node.settings):
            detail = ", ".join(
                f"{f}: node {getattr(node.settings, f)!r}, required {getattr(request.settings, f)!r}" for f in fields
            )
            rejections.append(NodeRejection(node_id=name, reason="settings_mismatch", message=detail, fields=fields))
        else:
            eligible.append(entry)
    return eligible, rejections


def _step(settings: ServingSettings) -> int:
    return CELL_PAD if settings.kv_unified else CELL_PAD * settings.slots


def _gpu_names(node: NodeResources) -> list[str]:
    return [f"GPU{g.index}" for g in sorted(node.gpus, key=lambda g: g.index)]


def _with_budgets(breakdown: MemoryBreakdown, have: Mapping[str, int]) -> tuple[MemoryBreakdown, list[DeviceShortfall]]:
    devices: list[DeviceMemory] = []
    short: list[DeviceShortfall] = []
    for device in breakdown.devices:
        budget = have.get(device.device, 0)
        fits = device.total_bytes <= budget
        devices.append(msgspec.structs.replace(device, budget_bytes=budget, fits=fits))
        if not fits:
            short.append(DeviceShortfall(device=device.device, need_bytes=device.total_bytes, have_bytes=budget))
    return msgspec.structs.replace(breakdown, devices=tuple(devices), fits=not short), short


def _fit(
    request: PlacementRequest,
    geometry: ModelGeometry,
    entry: ViewEntry,
    settings: ServingSettings,
    have: Mapping[str, int],
    *,
    layers: tuple[int, int],
    fixed_ctx: int | None = None,
) -> _Fit | NodeRejection:
    node = entry.resources
    gpus = _gpu_names(node)
    n_gpu_layers = request.n_gpu_layers if gpus else 0
    split: tuple[float, ...] = ()
    if gpus and n_gpu_layers != 0:
        weights = tuple(float(have.get(g, 0)) for g in gpus)
        split = weights if sum(weights) > 0 else tuple(1.0 for _ in gpus)
    budgets = Budgets(gpus=tuple(have.get(g, 0) for g in gpus), host=have.get("CPU", 0))
    step = _step(settings)
    try:
        ceiling = max_context(geometry, settings, budgets, n_gpu_layers=n_gpu_layers, gpu_split=split)
        if fixed_ctx is not None:
            ctx = fixed_ctx
        elif request.ctx is not None and not request.max_ctx:
            ctx = request.ctx
        elif ceiling is None:
            ctx = request.ctx or step
        else:
            ctx = ceiling
            if geometry.n_ctx_train >= step:
                ctx = min(ctx, max((geometry.n_ctx_train // step) * step, request.ctx or 0))
            ctx = max(ctx, request.ctx or 0)
        breakdown = estimate(geometry, settings, ctx, n_gpu_layers=n_gpu_layers, gpu_split=split)
    except MemoryModelError as exc:
        return NodeRejection(node_id=node.node_id, reason="unsupported_settings", message=str(exc))
    breakdown, short = _with_budgets(breakdown, have)
    breakdown = msgspec.structs.replace(breakdown, max_context=ceiling)
    if short:
        worst = ", ".join(f"{s.device} needs {_mib(s.need_bytes)}, has {_mib(s.have_bytes)}" for s in short)
        return NodeRejection(
            node_id=node.node_id,
            reason="insufficient_memory",
            message=f"context {ctx}: {worst}",
            shortfalls=tuple(short),
        )
    headroom = min(have.get(d.device, 0) - d.total_bytes for d in breakdown.devices)
    return _Fit(entry, settings, breakdown, ctx, ceiling, headroom, n_gpu_layers, split, layers)


def _sub_geometry(geometry: ModelGeometry, first: int, last: int) -> ModelGeometry:
    """The blocks [first, last) as a model of their own: the share of one node in a layer split."""
    head, tail = first == 0, last == geometry.n_layer
    layers = tuple(msgspec.structs.replace(layer, index=i) for i, layer in enumerate(geometry.layers[first:last]))
    return msgspec.structs.replace(
        geometry,
        layers=layers,
        n_layer=last - first,
        n_layer_nextn=sum(1 for layer in layers if layer.nextn),
        input_tensor_bytes=geometry.input_tensor_bytes if head else 0,
        output_tensor_bytes=geometry.output_tensor_bytes if tail else 0,
        tied_output=geometry.tied_output and tail,
        token_embd_bytes=geometry.token_embd_bytes if tail else 0,
    )


def _ranges(n_layer: int, weights: Sequence[int]) -> list[tuple[int, int]] | None:
    """Contiguous block ranges in proportion to `weights`, each at least one block."""
    k = len(weights)
    total = sum(weights)
    if n_layer < k or total <= 0:
        return None
    bounds = [0]
    acc = 0
    for i, w in enumerate(weights[:-1]):
        acc += w
        cut = round(n_layer * acc / total)
        cut = max(cut, bounds[-1] + 1)
        cut = min(cut, n_layer - (k - 1 - i))
        bounds.append(cut)
    bounds.append(n_layer)
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


def _split(
    request: PlacementRequest,
    geometry: ModelGeometry,
    candidates: Sequence[tuple[ViewEntry, dict[str, int]]],
) -> list[_Fit] | None:
    ordered = sorted(candidates, key=lambda c: (-sum(c[1].values()), c[0].resources.node_id))
    if not ordered:
        return None
    head_settings = ordered[0][0].resources.settings
    assert head_settings is not None
    # Prompt cache and checkpoints live in the head node's RAM only.
    member_settings = msgspec.structs.replace(head_settings, cache_ram_mib=0, ctx_checkpoints=0)
    for k in range(2, len(ordered) + 1):
        chosen = ordered[:k]
        ranges = _ranges(geometry.n_layer, [sum(have.values()) for _, have in chosen])
        if ranges is None:
            return None
        fits: list[_Fit] = []
        ctx: int | None = None
        # With a free context, the shared context is the smallest ceiling of the members.
        for attempt in range(2):
            fits = []
            for i, ((entry, have), (first, last)) in enumerate(zip(chosen, ranges, strict=True)):
                result = _fit(
                    request,
                    _sub_geometry(geometry, first, last),
                    entry,
                    head_settings if i == 0 else member_settings,
                    have,
                    layers=(first, last),
                    fixed_ctx=ctx,
                )
                if isinstance(result, NodeRejection):
                    break
                fits.append(result)
            if len(fits) != k:
                break
            ctxs = {f.ctx for f in fits}
            if len(ctxs) == 1:
                return fits
            if attempt == 0:
                ctx = min(ctxs)
    return None


def _reservation(
    fit: _Fit,
    stamp: Stamp,
    model: ModelFacts,
    *,
    reservation_id: str,
    decision_id: str,
    multi_node: bool,
    now: float,
    hold_s: float,
) -> Reservation:
    return Reservation(
        reservation_id=reservation_id,
        decision_id=decision_id,
        node_id=fit.entry.resources.node_id,
        state="reserved",
        model_path=model.path,
        model_digest=model.digest,
        stamp=stamp,
        layers=fit.layers,
        devices=fit.breakdown.devices,
        held={d.device: d.total_bytes for d in fit.breakdown.devices},
        multi_node=multi_node,
        created_at=now,
        expires_at=now + hold_s,
    )


def _overall(rejections: Sequence[NodeRejection], view: Mapping[str, ViewEntry]) -> tuple[RejectReason, str]:
    if not view and not rejections:
        return "no_nodes", "no node has reported telemetry"
    if not rejections:
        return "no_nodes", "no node is eligible"
    reasons = sorted({r.reason for r in rejections})
    reason: RejectReason = "insufficient_memory" if "insufficient_memory" in reasons else reasons[0]
    summary = "; ".join(f"{r.node_id}: {r.reason} ({r.message})" for r in rejections)
    return reason, f"no node can take the model: {summary}"


def decide(
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
    """`unreadable` names nodes whose ledger could not be read: nothing is booked on them."""
    geometry = model.geometry
    eligible, rejections = _eligible(request, view, now, unreadable)
    haves = {e.resources.node_id: available(e.resources, ledgers.get(e.resources.node_id), now) for e in eligible}
    fits: list[_Fit] = []
    for entry in eligible:
        settings = entry.resources.settings
        assert settings is not None  # _eligible keeps only nodes that advertise settings
        result = _fit(request, geometry, entry, settings, haves[entry.resources.node_id], layers=(0, geometry.n_layer))
        if isinstance(result, NodeRejection):
            rejections.append(result)
        else:
            fits.append(result)

    chosen: list[_Fit] = []
    if fits:
        chosen = [max(fits, key=lambda f: (f.headroom, _neg(f.entry.resources.node_id)))]
    elif request.allow_multi_node and len(eligible) > 1:
        candidates = [
            (e, haves[e.resources.node_id])
            for e in eligible
            if not any(r.node_id == e.resources.node_id and r.reason == "unsupported_settings" for r in rejections)
        ]
        chosen = _split(request, geometry, candidates) or []

    base = PlacementDecision(
        decision_id=decision_id,
        admitted=False,
        dry_run=dry_run,
        model=request.model,
        architecture=geometry.architecture,
        model_digest=model.digest,
        view={name: entry.revision for name, entry in view.items()},
        estimator_version=ESTIMATOR_VERSION,
        decided_at=now,
        request_id=request.request_id,
    )
    if not chosen:
        reason, message = _overall(rejections, view)
        return Outcome(msgspec.structs.replace(base, reason=reason, message=message, rejections=tuple(rejections)))

    head = chosen[0]
    multi = len(chosen) > 1
    chosen_ids = {f.entry.resources.node_id for f in chosen}
    stamp = Stamp(
        settings=head.settings,
        ctx=head.ctx,
        n_gpu_layers=head.n_gpu_layers,
        gpu_split=head.gpu_split,
        llama_server_version=head.entry.resources.llama_server.version if head.entry.resources.llama_server else None,
    )
    ceilings = [f.ceiling for f in chosen if f.ceiling is not None]
    placements = tuple(
        NodePlacement(
            node_id=f.entry.resources.node_id,
            layers=f.layers,
            breakdown=f.breakdown,
            telemetry_revision=f.entry.revision,
        )
        for f in chosen
    )
    reservations: tuple[Reservation, ...] = ()
    if not dry_run:
        reservations = tuple(
            _reservation(
                f,
                stamp,
                model,
                reservation_id=reservation_id,
                decision_id=decision_id,
                multi_node=multi,
                now=now,
                hold_s=request.hold_s,
            )
            for f in chosen
        )
    names = ", ".join(f"{p.node_id} blocks {p.layers[0]}-{p.layers[1] - 1}" for p in placements)
    decision = msgspec.structs.replace(
        base,
        admitted=True,
        ctx=head.ctx,
        context_ceiling=min(ceilings) if ceilings else None,
        stamp=stamp,
        placements=placements,
        multi_node=multi,
        reservation_id=None if dry_run else reservation_id,
        message=("split over " if multi else "on ") + names,
        rejections=tuple(r for r in rejections if r.node_id not in chosen_ids),
    )
    return Outcome(decision, reservations)


def _neg(text: str) -> tuple[int, ...]:
    """Sort key that prefers the smaller id under max()."""
    return tuple(-ord(c) for c in text)


def rejected(
    request: PlacementRequest,
    reason: RejectReason,
    message: str,
    *,
    decision_id: str,
    now: float,
    dry_run: bool,
    view: Mapping[str, ViewEntry],
) -> PlacementDecision:
    """A decision refused before any node was considered (the model itself is the problem)."""
    return PlacementDecision(
        decision_id=decision_id,
        admitted=False,
        dry_run=dry_run,
        model=request.model,
        reason=reason,
        message=message,
        view={name: entry.revision for name, entry in view.items()},
        estimator_version=ESTIMATOR_VERSION,
        decided_at=now,
        request_id=request.request_id,
    )


__all__ = ["ModelFacts", "ModelRef", "Outcome", "ViewEntry", "decide", "rejected"]
