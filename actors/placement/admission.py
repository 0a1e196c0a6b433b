"""Admission (placement core, pure): a request, the cluster view and the ledgers in; one decision out.

This module states the rules one node at a time: whether a node is considered (`refusal_of`), how the model
runs on it and with how much headroom (`fit_node`), which fit is chosen (`best_of`), a split when none fits
(`split_over`), and the decision written from them (`conclude`, `conclude_split`). The decision over a whole
view is the fleet index's (`actors.placement.fleet`), the one decision path: the placement actor keeps one
index across requests, and `decide` builds one for a single decision (replay, tests). A brute-force statement
of the same decision, every node judged in turn, lives only in the tests (`tests/placement_oracle.py`), which
hold the index to it on random fleets.

Rules this module keeps:
- Settings are the node's advertised defaults with the per-model settings the request asks for in their
  place (`bounds.effective`), accepted only within the bounds the node advertises; outside them the node is
  refused with `settings_mismatch` naming the fields and the bound. The model is sized with exactly those
  settings and they are stamped: nothing runs with settings admission did not use.
- A node is eligible only with fresh telemetry and advertised serving settings. Fresh means its latest
  report arrived at the placement actor at most `ttl_s` ago, on the placement actor's own clock (the shell
  passes each report's age): a node's `sent_at` is its own clock and is never compared with ours.
- Each node is sized with the memory model against what its ledger says is available on each device
  (`actors.placement.ledger`); the decision carries the breakdown per device, need and have.
- One node is chosen: among the nodes that fit, first those that hold the model's file (its telemetry lists
  it: nothing to fetch from a peer before the server starts, the fetch being the longest part of a start
  elsewhere), then those the request prefers (`prefer`, in its order), then the one left with the most
  headroom on its tightest device (ties by node id in natural order: gpu-1 < gpu-2 < gpu-10), so load
  spreads. The decision says how many bytes the chosen node fetches first (`fetch_bytes`). A model is split over
  nodes (llama.cpp's RPC backend, `actors.placement.split`) only when the request allows it and no node fits
  alone: the decision then names the head and its members, a breakdown per node, and books a reservation on
  every member's ledger with the same id (`Reservation.split`), all of them or none (`booking.py`).
- Without `ctx`, or with `max_ctx`, the context is the largest that fits, capped at the model's
  training context; it is always one llama-server can build (multiples of 256 cells per stream).
- What the server is for (generation, embeddings, reranking) is asked for or read from the model's header
  (`pooled.resolved_request`) before anything else, so bounds, sizing and the stamp see one explicit kind;
  an embedding or rerank server's stamp pins its batch sizes, a whole input (`pooled.whole_input`).
Nothing here reads a clock, a file or the bus: `now` and the ids are passed in, which is what lets
`mesh-actor replay` recompute a recorded decision.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from actors.placement import pooled
from actors.placement.bounds import effective, invalid, out_of_bounds
from actors.placement.memory import (
    CELL_PAD,
    ESTIMATOR_VERSION,
    Budgets,
    MemoryModelError,
    estimate,
    max_context,
)
from actors.placement.split import Lender, SplitFit, best_split, node_share
from messages.memory import DeviceMemory, MemoryBreakdown
from messages.model import ModelGeometry, ProjectorGeometry
from messages.placement import (
    Companion,
    DeviceShortfall,
    ModelRef,
    NodePlacement,
    NodeRejection,
    PlacementDecision,
    PlacementRequest,
    PreferredSettings,
    RejectReason,
    Reservation,
    RpcMember,
    SplitPart,
    Stamp,
)
from messages.settings import ServingSettings
from messages.telemetry import NodeResources

_DIGITS = re.compile(r"(\d+)")
_SUMMARY_NODES = 8  # nodes named in the message of a refusal


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The model as admission needs it: its geometry, where nodes find the file, its digest if known; and its
    companions' facts: a draft model's geometry (`model.draft`) and a projector's (`model.mmproj`), each with
    the file as it is stamped."""

    geometry: ModelGeometry
    path: str
    digest: str | None = None
    draft: ModelGeometry | None = None
    draft_file: Companion | None = None
    projector: ProjectorGeometry | None = None
    projector_file: Companion | None = None


@dataclass(frozen=True, slots=True)
class ViewEntry:
    """A node's latest report, its nodes-bucket revision, and how long ago it arrived (seconds, on the
    placement actor's clock). `age_s` None (decisions recorded before ages were kept) falls back to the
    decision time minus the report's `sent_at`, as decisions were made then."""

    resources: NodeResources
    revision: int
    age_s: float | None = None

    def age(self, now: float) -> float:
        return self.age_s if self.age_s is not None else now - self.resources.sent_at


@dataclass(frozen=True, slots=True)
class Outcome:
    decision: PlacementDecision
    reservations: tuple[Reservation, ...] = ()  # one per node to add to its ledger (none when rejected/dry run)


@dataclass(frozen=True, slots=True)
class Fit:
    """A node the model fits on: how it would run there, and the headroom left on its tightest device."""

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


def settings_on(node: NodeResources, wanted: PreferredSettings | None) -> ServingSettings:
    """What the model runs with on `node` (which advertises settings: `refusal_of` refused it otherwise)."""
    assert node.settings is not None
    return effective(node.settings, wanted)


def refusal_of(
    request: PlacementRequest, name: str, entry: ViewEntry | None, age: float, unreadable: bool
) -> NodeRejection | None:
    """Why node `name` is not even sized for `request` (None: it is eligible). `age`: of its report."""
    if entry is None:
        return NodeRejection(node_id=name, reason="not_found", message="no telemetry from this node")
    node = entry.resources
    if age > node.ttl_s:
        return NodeRejection(
            node_id=name,
            reason="telemetry_stale",
            message=f"last report arrived {age:.1f}s ago, longer than its {node.ttl_s:g}s TTL",
        )
    if unreadable:
        return NodeRejection(
            node_id=name,
            reason="ledger_unreadable",
            message="the node's reservation ledger does not decode; nothing can be booked there until fixed",
        )
    if node.settings is None:
        why = node.llama_server_error or "no llama-server"
        return NodeRejection(
            node_id=name,
            reason="settings_unknown",
            message=f"the node has not advertised serving settings ({why})",
        )
    settings = effective(node.settings, request.settings)
    fields, detail = out_of_bounds(settings, node.settings, node.bounds)
    if fields:
        return NodeRejection(node_id=name, reason="settings_mismatch", message=detail, fields=fields)
    refused = invalid(settings) if request.settings is not None else None  # a node's own: the memory model's
    if refused is not None:
        return NodeRejection(node_id=name, reason="unsupported_settings", message=refused)
    return None


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


def split_of(node: NodeResources, have: Mapping[str, int], n_gpu_layers: int) -> tuple[int, tuple[float, ...]]:
    """The `-ngl` and tensor split a node runs a model with: layers split over its GPUs in proportion to
    what each has available (evenly when none has anything); no split on a node without GPUs."""
    gpus = _gpu_names(node)
    n_gpu_layers = n_gpu_layers if gpus else 0
    split: tuple[float, ...] = ()
    if gpus and n_gpu_layers != 0:
        weights = tuple(float(have.get(g, 0)) for g in gpus)
        split = weights if sum(weights) > 0 else tuple(1.0 for _ in gpus)
    return n_gpu_layers, split


def insufficient(node_id: str, ctx: int, short: Sequence[DeviceShortfall]) -> NodeRejection:
    """The refusal of a node that has less than the model needs on some device (`short`, in device order)."""
    worst = ", ".join(f"{s.device} needs {_mib(s.need_bytes)}, has {_mib(s.have_bytes)}" for s in short)
    return NodeRejection(
        node_id=node_id,
        reason="insufficient_memory",
        message=f"context {ctx}: {worst}",
        shortfalls=tuple(short),
    )


def fit_node(
    request: PlacementRequest,
    geometry: ModelGeometry,
    entry: ViewEntry,
    settings: ServingSettings,
    have: Mapping[str, int],
    *,
    layers: tuple[int, int],
    draft: ModelGeometry | None = None,
    projector: ProjectorGeometry | None = None,
) -> Fit | NodeRejection:
    """Sizes the model (with its draft model and projector, if any) on one node against what it has (`have`)."""
    node = entry.resources
    gpus = _gpu_names(node)
    n_gpu_layers, split = split_of(node, have, request.n_gpu_layers)
    budgets = Budgets(gpus=tuple(have.get(g, 0) for g in gpus), host=have.get("CPU", 0))
    step = _step(settings)
    try:
        features = node.host.cpu_features  # which quantized weights its CPU backend repacks
        ceiling = max_context(
            geometry, settings, budgets, n_gpu_layers=n_gpu_layers, gpu_split=split, cpu_features=features,
            draft=draft, projector=projector,
        )  # fmt: skip
        if request.ctx is not None and not request.max_ctx:
            ctx = request.ctx
        elif ceiling is None:
            ctx = request.ctx or step
        else:
            ctx = ceiling
            if geometry.n_ctx_train >= step:
                ctx = min(ctx, max((geometry.n_ctx_train // step) * step, request.ctx or 0))
            ctx = max(ctx, request.ctx or 0)
        breakdown = estimate(
            geometry, settings, ctx, n_gpu_layers=n_gpu_layers, gpu_split=split, cpu_features=features, draft=draft,
            projector=projector,
        )  # fmt: skip
    except MemoryModelError as exc:
        return NodeRejection(node_id=node.node_id, reason="unsupported_settings", message=str(exc))
    breakdown, short = _with_budgets(breakdown, have)
    breakdown = msgspec.structs.replace(breakdown, max_context=ceiling)
    if short:
        return insufficient(node.node_id, ctx, short)
    headroom = min(have.get(d.device, 0) - d.total_bytes for d in breakdown.devices)
    settings = pooled.whole_input(settings, breakdown.context)  # the stamp pins an embedding server's batch
    return Fit(entry, settings, breakdown, ctx, ceiling, headroom, n_gpu_layers, split, layers)


def _reservation(
    fit: Fit,
    stamp: Stamp,
    model: ModelFacts,
    *,
    reservation_id: str,
    decision_id: str,
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
        created_at=now,
        expires_at=now + hold_s,
        hold_s=hold_s,
    )


def _overall(rejections: Sequence[NodeRejection], view: Mapping[str, ViewEntry]) -> tuple[RejectReason, str]:
    if not view and not rejections:
        return "no_nodes", "no node has reported telemetry"
    if not rejections:
        return "no_nodes", "no node is eligible"
    reasons = sorted({r.reason for r in rejections})
    reason: RejectReason = "insufficient_memory" if "insufficient_memory" in reasons else reasons[0]
    summary = "; ".join(f"{r.node_id}: {r.reason} ({r.message})" for r in rejections[:_SUMMARY_NODES])
    if len(rejections) > _SUMMARY_NODES:  # every node is in `rejections`; the message stays readable
        summary += f"; and {len(rejections) - _SUMMARY_NODES} more nodes (see rejections)"
    return reason, f"no node can take the model: {summary}"


def split_over(
    request: PlacementRequest, model: ModelFacts, eligible: Sequence[ViewEntry], haves: Mapping[str, Mapping[str, int]]
) -> tuple[SplitFit | None, str]:
    """The best split over the eligible nodes (in the order the decision lists them; `haves`: what each has
    per device), or None and why there is none."""
    if model.draft is not None or model.projector is not None:
        return None, "a split is not sized with a draft model or a projector"
    # the request's n_gpu_layers is for one node: a split plans its own -ngl (the members take what the head does not)
    lenders = [Lender(e.resources, haves[e.resources.node_id], e.revision) for e in eligible]
    settings_of = {e.resources.node_id: settings_on(e.resources, request.settings) for e in eligible}
    return best_split(model.geometry, settings_of, lenders, ctx=request.ctx, max_ctx=request.max_ctx)


def without_split(outcome: Outcome, why: str) -> Outcome:
    """A refusal of a request that allowed a split, saying why no split holds the model either."""
    message = f"{outcome.decision.message}; and no split: {why}"
    return Outcome(msgspec.structs.replace(outcome.decision, message=message))


def conclude_split(
    request: PlacementRequest,
    model: ModelFacts,
    view: Mapping[str, ViewEntry],
    split: SplitFit,
    rejections: Sequence[NodeRejection],
    *,
    now: float,
    decision_id: str,
    reservation_id: str,
    dry_run: bool,
) -> Outcome:
    """An admitted split: the stamp the head runs with, a placement and a reservation per node (the head first)."""
    geometry = model.geometry
    head = split.head.node
    members = tuple(
        RpcMember(node_id=m.node.node_id, layers=layers)
        for m, layers in zip(split.members, split.layers[1:], strict=True)
    )
    stamp = Stamp(
        settings=pooled.whole_input(split.settings, split.breakdown.context),
        ctx=split.ctx,
        n_gpu_layers=split.n_gpu_layers,
        gpu_split=split.tensor_split,
        llama_server_version=head.llama_server.version if head.llama_server else None,
        rpc=members,
    )
    devices = {d.device: d for d in split.breakdown.devices}
    shares: list[tuple[Lender, tuple[int, int], MemoryBreakdown]] = [
        (split.head, split.layers[0], node_share(split.breakdown, [devices["CPU"]]))
    ]
    for index, (member, layers) in enumerate(zip(split.members, split.layers[1:], strict=True)):
        lent = msgspec.structs.replace(devices[f"RPC{index}"], device="CPU")  # the member's own host memory
        shares.append((member, layers, node_share(split.breakdown, [lent])))
    placements = tuple(
        NodePlacement(node_id=lender.node.node_id, layers=layers, breakdown=share, telemetry_revision=lender.revision)
        for lender, layers, share in shares
    )
    part = SplitPart(head=head.node_id, members=tuple(m.node_id for m in members))
    reservations: tuple[Reservation, ...] = ()
    if not dry_run:
        reservations = tuple(
            Reservation(
                reservation_id=reservation_id,
                decision_id=decision_id,
                node_id=lender.node.node_id,
                state="reserved",
                model_path=model.path,
                model_digest=model.digest,
                stamp=stamp,
                layers=layers,
                devices=share.devices,
                held={d.device: d.total_bytes for d in share.devices},
                multi_node=True,
                created_at=now,
                expires_at=now + request.hold_s,
                hold_s=request.hold_s,
                split=part,
            )
            for lender, layers, share in shares
        )

    def held(p: NodePlacement) -> str:
        output = " and the output" if p.layers[1] == geometry.n_layer else ""
        return f"{p.node_id} (blocks {p.layers[0]}-{p.layers[1] - 1}{output})"

    where = ", ".join(held(p) for p in placements)
    decision = PlacementDecision(
        decision_id=decision_id,
        admitted=True,
        dry_run=dry_run,
        model=request.model,
        architecture=geometry.architecture,
        model_digest=model.digest,
        ctx=split.ctx,
        context_ceiling=split.ceiling,
        stamp=stamp,
        placements=placements,
        multi_node=True,
        reservation_id=None if dry_run else reservation_id,
        message=f"split over {where}",
        rejections=tuple(rejections),
        view={name: entry.revision for name, entry in view.items()},
        estimator_version=ESTIMATOR_VERSION,
        decided_at=now,
        request_id=request.request_id,
    )
    return Outcome(decision, reservations)


def holds(node: NodeResources, path: str, digest: str | None) -> bool:
    """Whether `node` reports holding the model file `path` (a name in its models dir; an absolute path never
    matches) in the version `digest` (when both sides know it)."""
    return node.model_files is not None and node.model_files.version_of(path, digest) is not None


def fetch_bytes(node: NodeResources, model: ModelFacts, view: Mapping[str, ViewEntry]) -> int | None:
    """What `node` fetches of the model's file before it starts: 0 when it holds it, the size a node holding
    that version reports when it does not (the first in natural order), None when no node reports it."""
    if holds(node, model.path, model.digest):
        return 0
    for name in sorted(view, key=natural_key):
        files = view[name].resources.model_files
        size = files.version_of(model.path, model.digest) if files is not None else None
        if size is not None:
            return size
    return None


def prefer_rank(request: PlacementRequest, name: str) -> int:
    return request.prefer.index(name) if name in request.prefer else len(request.prefer)


def best_of(fits: Sequence[Fit], request: PlacementRequest, model: ModelFacts) -> Fit:
    """The fit that holds the model's file, then the one the request prefers first, then the one left with
    the most headroom on its tightest device; ties by node id in natural order."""

    def key(f: Fit) -> tuple[bool, int, int, NaturalKey]:
        node = f.entry.resources
        lacks = not holds(node, model.path, model.digest)
        return lacks, prefer_rank(request, node.node_id), -f.headroom, natural_key(node.node_id)

    return min(fits, key=key)


def conclude(
    request: PlacementRequest,
    model: ModelFacts,
    view: Mapping[str, ViewEntry],
    fits: Sequence[Fit],
    rejections: Sequence[NodeRejection],
    *,
    now: float,
    decision_id: str,
    reservation_id: str,
    dry_run: bool,
) -> Outcome:
    """The decision once every node is sized: the best of `fits` admitted, or every rejection."""
    geometry = model.geometry
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
    if not fits:
        reason, message = _overall(rejections, view)
        return Outcome(msgspec.structs.replace(base, reason=reason, message=message, rejections=tuple(rejections)))

    chosen = best_of(fits, request, model)
    node = chosen.entry.resources
    fetch = fetch_bytes(node, model, view)
    rate = node.model_files.pull_bytes_per_s if node.model_files is not None else None
    fetch_s = round(fetch / rate, 3) if fetch and rate else None
    stamp = Stamp(
        settings=chosen.settings,
        ctx=chosen.ctx,
        n_gpu_layers=chosen.n_gpu_layers,
        gpu_split=chosen.gpu_split,
        llama_server_version=node.llama_server.version if node.llama_server else None,
        draft=model.draft_file,
        mmproj=model.projector_file,
    )
    placement = NodePlacement(
        node_id=node.node_id, layers=chosen.layers, breakdown=chosen.breakdown,
        telemetry_revision=chosen.entry.revision, fetch_bytes=fetch, fetch_s=fetch_s,
    )  # fmt: skip
    reservations: tuple[Reservation, ...] = ()
    if not dry_run:
        reservations = (
            _reservation(
                chosen, stamp, model, reservation_id=reservation_id, decision_id=decision_id, now=now,
                hold_s=request.hold_s,
            ),
        )  # fmt: skip
    decision = msgspec.structs.replace(
        base,
        admitted=True,
        ctx=chosen.ctx,
        context_ceiling=chosen.ceiling,
        stamp=stamp,
        placements=(placement,),
        reservation_id=None if dry_run else reservation_id,
        message=f"on {node.node_id} blocks {chosen.layers[0]}-{chosen.layers[1] - 1}"
        + (f" (it fetches the model file, {_mib(fetch)}, from a peer first" if fetch else "")
        + (f": about {fetch_s:g}s at its last pull's rate)" if fetch_s else ")" if fetch else ""),
        rejections=tuple(r for r in rejections if r.node_id != node.node_id),
    )
    return Outcome(decision, reservations)


NaturalKey = tuple[tuple[int, int, str], ...]


def natural_key(text: str) -> NaturalKey:
    """Sort key of node ids in natural order: runs of digits compare as numbers (gpu-2 < gpu-10)."""
    return tuple((0, int(part), part) if part.isdigit() else (1, 0, part) for part in _DIGITS.split(text) if part)


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


__all__ = [
    "Fit",
    "ModelFacts",
    "ModelRef",
    "Outcome",
    "ViewEntry",
    "best_of",
    "conclude",
    "conclude_split",
    "fit_node",
    "refusal_of",
    "rejected",
    "settings_on",
    "split_over",
    "without_split",
]
