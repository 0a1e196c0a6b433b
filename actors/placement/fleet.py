"""The cluster view indexed for admission (placement core, pure): `admission.decide`'s decisions, without
sizing every node on every request.

Theory of operation. For a request with a fixed context (`ctx` given, no `max_ctx`), what the memory model
says about a node depends on the node only through its serving settings, its CPU features and where the
model's layers go (`weights.layer_devices`: its `-ngl` and its GPUs' split, the split being in proportion to
what each GPU has free). So the model is sized once per distinct (settings, CPU features, layer layout) and
context — a *sizing*, kept across requests — and each node then only compares the sizing's per-device totals
with what its ledger leaves available: fits, headroom, or the shortfalls of its refusal. A node's derived
state (what it has available, its split) is recomputed only when its report or its ledger changes.

Rules this module keeps:
- Decisions are exactly `admission.decide`'s, field for field: the same rejections in the same order with the
  same messages, the same chosen node, breakdown, stamp and reservation. The chosen node is sized by
  `admission.fit_node` itself; the others need no context ceiling, since with a fixed context a node's
  ceiling shows only in the chosen node's breakdown, and the memory model's refusals (`unsupported_settings`)
  do not depend on the context. `tests/unit/test_fleet_index.py` checks the equality on random fleets.
- A request for the largest context that fits (`max_ctx`, or no `ctx`) sizes each node at its own ceiling:
  `covers` says no, and the caller runs `admission.decide` (the full scan).
- Every table is bounded: profiles, layouts and sizings are dropped wholesale past their limits (then rebuilt
  on demand; distinct ones are few in a fleet), node states are kept only for nodes in the view.
- The view's keys are the nodes' ids (the placement actor refuses a report stored under another key).
Nothing here reads a clock: the caller passes the time and when each report arrived.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from actors.placement.admission import (
    Fit,
    ModelFacts,
    Outcome,
    ViewEntry,
    conclude,
    decide,
    fit_node,
    insufficient,
    natural_key,
    refusal_of,
    split_of,
)
from actors.placement.ledger import available
from actors.placement.memory import MemoryModelError, estimate
from actors.placement.weights import layer_devices
from messages.model import ModelGeometry
from messages.placement import DeviceShortfall, NodeLedger, NodeRejection, PlacementRequest
from messages.settings import ServingSettings

#: A node's ledger and the revision it was read at (-1: it does not decode; 0: there is none).
LedgerEntry = tuple[NodeLedger | None, int]
NO_LEDGER: LedgerEntry = (None, 0)

#: Limits of the tables; past one, that table (and what refers to it) is dropped and rebuilt on demand.
MAX_SIZINGS = 4096
MAX_LAYOUTS = 8192
MAX_PROFILES = 4096
MAX_MODELS = 8


@dataclass(frozen=True, slots=True)
class Sizing:
    """The memory model's answer for one (model, settings, CPU features, layout, context): the total per
    device in breakdown order, or the reason llama-server would refuse the settings."""

    totals: tuple[tuple[str, int], ...]
    error: str | None = None


@dataclass(slots=True)
class _NodeState:
    """What a node's report and ledger imply for every request, until either changes."""

    entry: ViewEntry
    ledger: NodeLedger | None
    revision: int
    epoch: int
    have: dict[str, int]
    profile: int  # interned (settings, CPU features)
    # the last question asked of this node and its answer: (model, -ngl, ctx, sizing epoch) -> headroom
    asked: tuple[int, int, int, int] | None = None
    headroom: int = 0
    refusal: NodeRejection | None = None  # when the model does not fit (or cannot run) there


@dataclass(frozen=True, slots=True)
class IndexStats:
    """How big the index is and how often it sized something: reported by the placement actor."""

    nodes: int
    profiles: int
    layouts: int
    sizings: int
    sized: int  # memory-model estimates made since the index was created
    resets: int  # times a table was dropped for reaching its limit


@dataclass(slots=True)
class FleetIndex:
    """Caches between decisions; `decide` with the same arguments as `admission.decide` would take,
    but the view without ages (`arrived`: when each report arrived, on the caller's monotonic clock)."""

    _nodes: dict[str, _NodeState] = field(default_factory=dict)
    _order: list[str] = field(default_factory=list)  # the view's names in natural order
    _natural: dict[str, tuple[tuple[int, int, str], ...]] = field(default_factory=dict)
    _models: dict[int, tuple[ModelGeometry, int]] = field(default_factory=dict)  # id(geometry) -> token
    _next_model: int = 0
    _profiles: dict[tuple[ServingSettings, tuple[str, ...] | None], int] = field(default_factory=dict)
    _layouts: dict[tuple[int, int, tuple[float, ...]], int] = field(default_factory=dict)
    _layout_ids: dict[tuple[tuple[int, ...], bool], int] = field(default_factory=dict)
    _sizings: dict[tuple[int, int, int, int], Sizing] = field(default_factory=dict)
    _epoch: int = 0  # bumped when profiles or layouts are dropped: node states re-intern
    _sizing_epoch: int = 0  # bumped when sizings are dropped: nodes' remembered answers are stale
    _sized: int = 0
    _resets: int = 0

    @staticmethod
    def covers(request: PlacementRequest) -> bool:
        """Whether `decide` answers `request` from sizings (a fixed context), not by a full scan."""
        return request.ctx is not None and not request.max_ctx and not request.allow_multi_node

    def stats(self) -> IndexStats:
        return IndexStats(
            nodes=len(self._nodes),
            profiles=len(self._profiles),
            layouts=len(self._layout_ids),
            sizings=len(self._sizings),
            sized=self._sized,
            resets=self._resets,
        )

    def decide(
        self,
        request: PlacementRequest,
        model: ModelFacts,
        view: Mapping[str, ViewEntry],
        arrived: Mapping[str, float],
        ledgers: Mapping[str, LedgerEntry],
        *,
        now: float,
        monotonic_now: float,
        decision_id: str,
        reservation_id: str,
        dry_run: bool,
        fresh: Mapping[str, LedgerEntry] | None = None,
    ) -> Outcome:
        """The decision `admission.decide` makes over `view` aged at `monotonic_now` and the ledgers of the
        nodes it considers (`fresh` first: read from the bucket, newer than `ledgers`)."""
        fresh = fresh or {}
        if not self.covers(request):
            return self._full_scan(
                request, model, view, arrived, ledgers, fresh, now, monotonic_now, decision_id, reservation_id, dry_run
            )
        self._keep_bounded(view)
        geometry = model.geometry
        token = self._token(geometry)
        ctx = request.ctx
        assert ctx is not None  # covers()
        n_gpu_layers = request.n_gpu_layers
        refused: list[NodeRejection] = []
        misfits: list[NodeRejection] = []
        best: _NodeState | None = None
        best_name = ""
        natural = self._natural

        def order(name: str) -> tuple[tuple[int, int, str], ...]:  # only asked on a tie
            return natural.get(name) or natural_key(name)

        states = self._nodes
        epoch = self._epoch
        asked = (token, n_gpu_layers, ctx, self._sizing_epoch)
        best_headroom = -1
        view_get, arrived_get, ledgers_get, fresh_get = view.get, arrived.get, ledgers.get, fresh.get
        plain = request.settings is None  # no settings required: the common case is checked inline below
        for name in request.nodes or self._natural_order(view):
            entry = view_get(name)
            ledger = (fresh_get(name) if fresh else None) or ledgers_get(name, NO_LEDGER)
            if entry is None:
                refused.append(NodeRejection(node_id=name, reason="not_found", message="no telemetry from this node"))
                continue
            node = entry.resources
            age = max(0.0, monotonic_now - arrived_get(name, monotonic_now))
            if not (plain and age <= node.ttl_s and ledger[1] >= 0 and node.settings is not None):
                refusal = refusal_of(request, name, entry, age, ledger[1] < 0)
                if refusal is not None:
                    refused.append(refusal)
                    continue
            state = states.get(name)
            if (
                state is None
                or state.entry is not entry
                or state.ledger is not ledger[0]
                or state.revision != ledger[1]
                or state.epoch != epoch
            ):
                state = self._state(name, entry, ledger)
            if state.asked != asked:
                self._answer(state, token, geometry, n_gpu_layers, ctx)
                state.asked = (token, n_gpu_layers, ctx, self._sizing_epoch)  # the epoch may have moved
            if state.refusal is not None:
                misfits.append(state.refusal)
            elif state.headroom > best_headroom or (
                state.headroom == best_headroom and best is not None and order(name) < order(best_name)
            ):
                best, best_name, best_headroom = state, name, state.headroom
        fits: list[Fit] = []
        if best is not None:
            settings = best.entry.resources.settings
            assert settings is not None  # refusal_of refused it otherwise
            chosen = fit_node(request, geometry, best.entry, settings, best.have, layers=(0, geometry.n_layer))
            assert isinstance(chosen, Fit) and chosen.headroom == best.headroom, "sizing disagrees with fit_node"
            fits.append(chosen)
        return conclude(
            request, model, view, fits, refused + misfits, now=now, decision_id=decision_id,
            reservation_id=reservation_id, dry_run=dry_run,
        )  # fmt: skip

    def _answer(self, state: _NodeState, token: int, geometry: ModelGeometry, n_gpu_layers: int, ctx: int) -> None:
        """Sizes the model on `state`'s node (from a shared sizing): its headroom, or its refusal."""
        name = state.entry.resources.node_id
        sizing = self._sizing(token, geometry, state, n_gpu_layers, ctx)
        state.refusal = None
        if sizing.error is not None:
            state.headroom = -1
            state.refusal = NodeRejection(node_id=name, reason="unsupported_settings", message=sizing.error)
            return
        state.headroom = min(state.have.get(device, 0) - total for device, total in sizing.totals)
        if state.headroom < 0:
            state.refusal = insufficient(name, ctx, _shortfalls(sizing, state.have))

    # --- the full scan ------------------------------------------------------------------------------------

    @staticmethod
    def _full_scan(
        request: PlacementRequest,
        model: ModelFacts,
        view: Mapping[str, ViewEntry],
        arrived: Mapping[str, float],
        ledgers: Mapping[str, LedgerEntry],
        fresh: Mapping[str, LedgerEntry],
        now: float,
        monotonic_now: float,
        decision_id: str,
        reservation_id: str,
        dry_run: bool,
    ) -> Outcome:
        inputs = snapshot(request, view, arrived, ledgers, fresh, monotonic_now)
        return decide(
            request, model, inputs.view, inputs.held, now=now, decision_id=decision_id,
            reservation_id=reservation_id, dry_run=dry_run, unreadable=inputs.unreadable,
        )  # fmt: skip

    # --- tables -------------------------------------------------------------------------------------------

    def _keep_bounded(self, view: Mapping[str, ViewEntry]) -> None:
        """Drops a table past its limit (checked between decisions: one decision adds at most one entry per
        node), and the states of nodes that left the view."""
        if len(self._profiles) >= MAX_PROFILES or len(self._layout_ids) >= MAX_LAYOUTS:
            self._reset_tables()
        elif len(self._sizings) >= MAX_SIZINGS:
            self._drop_sizings()
        if len(self._nodes) > len(view) + 64:
            self._nodes = {name: state for name, state in self._nodes.items() if name in view}
            self._natural = {name: key for name, key in self._natural.items() if name in view}

    def _natural_order(self, view: Mapping[str, ViewEntry]) -> list[str]:
        order = self._order
        if len(order) != len(view) or not all(name in view for name in order):
            natural = self._natural
            for name in view:
                if name not in natural:
                    natural[name] = natural_key(name)
            self._order = order = sorted(view, key=natural.__getitem__)
        return order

    def _token(self, geometry: ModelGeometry) -> int:
        known = self._models.get(id(geometry))
        if known is not None and known[0] is geometry:
            return known[1]
        if len(self._models) >= MAX_MODELS:
            self._models.clear()  # their sizings age out with the sizings table
        self._next_model += 1
        self._models[id(geometry)] = (geometry, self._next_model)
        return self._next_model

    def _state(self, name: str, entry: ViewEntry, ledger: LedgerEntry) -> _NodeState:
        state = self._nodes.get(name)
        held, revision = ledger
        if (
            state is not None
            and state.entry is entry
            and state.ledger is held
            and state.revision == revision
            and state.epoch == self._epoch
        ):
            return state
        node = entry.resources
        settings = node.settings
        assert settings is not None  # refusal_of refused it otherwise
        profile_key = (settings, node.host.cpu_features)
        profile = self._profiles.get(profile_key)
        if profile is None:
            profile = self._profiles.setdefault(profile_key, len(self._profiles))
        state = _NodeState(
            entry=entry,
            ledger=held,
            revision=revision,
            epoch=self._epoch,
            have=available(node, held),
            profile=profile,
        )
        self._nodes[name] = state
        return state

    def _reset_tables(self) -> None:
        self._profiles.clear()
        self._layouts.clear()
        self._layout_ids.clear()
        self._drop_sizings()
        self._epoch += 1

    def _drop_sizings(self) -> None:
        self._sizings.clear()
        self._sizing_epoch += 1
        self._resets += 1

    def _layout(self, token: int, geometry: ModelGeometry, state: _NodeState, n_gpu_layers: int) -> int:
        """The id of where this model's layers go on `state`'s node (with whether it has a GPU split)."""
        ngl, split = split_of(state.entry.resources, state.have, n_gpu_layers)
        if len(split) > 1:
            # In proportion to free memory, which differs per node: computed per node state (the caller keeps
            # the answer until the state changes), and only the resulting layout is shared.
            return self._layout_id(tuple(layer_devices(geometry, ngl, split)), True)
        # No GPU, or one that takes every offloaded layer whatever its (positive: split_of) weight.
        key = (token, ngl, (1.0,) if split else ())
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._layout_id(tuple(layer_devices(geometry, ngl, key[2])), bool(split))
        return layout

    def _layout_id(self, devices: tuple[int, ...], has_split: bool) -> int:
        return self._layout_ids.setdefault((devices, has_split), len(self._layout_ids))

    def _sizing(self, token: int, geometry: ModelGeometry, state: _NodeState, n_gpu_layers: int, ctx: int) -> Sizing:
        layout = self._layout(token, geometry, state, n_gpu_layers)
        key = (token, state.profile, layout, ctx)
        sizing = self._sizings.get(key)
        if sizing is not None:
            return sizing
        node = state.entry.resources
        settings = node.settings
        assert settings is not None
        ngl, split = split_of(node, state.have, n_gpu_layers)
        features = node.host.cpu_features
        try:
            breakdown = estimate(geometry, settings, ctx, n_gpu_layers=ngl, gpu_split=split, cpu_features=features)
            sizing = Sizing(totals=tuple((d.device, d.total_bytes) for d in breakdown.devices))
        except MemoryModelError as exc:
            sizing = Sizing(totals=(), error=str(exc))
        self._sized += 1
        self._sizings[key] = sizing
        return sizing


def _shortfalls(sizing: Sizing, have: Mapping[str, int]) -> list[DeviceShortfall]:
    return [
        DeviceShortfall(device=device, need_bytes=total, have_bytes=have.get(device, 0))
        for device, total in sizing.totals
        if total > have.get(device, 0)
    ]


@dataclass(frozen=True, slots=True)
class Inputs:
    """`admission.decide`'s inputs: the view with each report's age, the ledgers of the nodes a request
    considers (`ledgers`, with their revisions; `held`, those that exist) and those that do not decode."""

    view: dict[str, ViewEntry]
    ledgers: dict[str, LedgerEntry]
    held: dict[str, NodeLedger]
    unreadable: frozenset[str]


def snapshot(
    request: PlacementRequest,
    view: Mapping[str, ViewEntry],
    arrived: Mapping[str, float],
    ledgers: Mapping[str, LedgerEntry],
    fresh: Mapping[str, LedgerEntry],
    monotonic_now: float,
) -> Inputs:
    """What `admission.decide` is given for `request` at `monotonic_now` (`fresh` ledgers first)."""
    aged = {
        name: ViewEntry(
            resources=entry.resources,
            revision=entry.revision,
            age_s=max(0.0, monotonic_now - arrived.get(name, monotonic_now)),
        )
        for name, entry in view.items()
    }
    names = [name for name in (request.nodes or view) if name in view]
    considered = {name: fresh.get(name) or ledgers.get(name, NO_LEDGER) for name in names}
    held = {name: ledger for name, (ledger, _) in considered.items() if ledger is not None}
    unreadable = frozenset(name for name, (_, revision) in considered.items() if revision < 0)
    return Inputs(view=aged, ledgers=considered, held=held, unreadable=unreadable)


__all__ = ["NO_LEDGER", "FleetIndex", "IndexStats", "Inputs", "LedgerEntry", "Sizing", "snapshot"]
