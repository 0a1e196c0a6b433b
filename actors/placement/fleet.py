"""The cluster view indexed for admission (placement core, pure): `admission.decide`'s decisions, without
sizing every node on every request.

Theory of operation. For a request with a fixed context (`ctx` given, no `max_ctx`), what the memory model
says about a node depends on the node only through its serving settings, its CPU features and where the
model's layers go (`weights.layer_devices`: its `-ngl` and its GPUs' split, the split being in proportion to
what each GPU has free). So the model is sized once per distinct (settings, CPU features, layer layout) and
context — a *sizing*, kept across requests — and each node then only compares the sizing's per-device totals
with what its ledger leaves available: fits, headroom, or the shortfalls of its refusal. A node's derived
state (what it has available, its split) is recomputed only when its report or its ledger changes (a report
equal to the last but for its sequence number and time keeps it, unless a reservation became running between
the two: the newer report sees that memory as used, so the live term no longer subtracts it).

A *tracked* index (the placement actor's) is told of every change (`touch`: a report, a node leaving, a
ledger) and keeps, per question (model, context, `-ngl`, required settings), a standing answer of every node
(`_Standing`): a decision judges again only the nodes touched since that question was last asked, those whose
report turned stale since (a heap of deadlines) and the stale ones (their refusal says how old the report
is), then reads the answer off: the refusals in natural order, the best fit from a heap. An explicit node
list, or ledgers read fresh from the bucket, are judged in full.

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

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from actors.placement import pooled
from actors.placement.admission import (
    Fit,
    ModelFacts,
    NaturalKey,
    Outcome,
    ViewEntry,
    conclude,
    decide,
    fit_node,
    holds,
    insufficient,
    natural_key,
    refusal_of,
    settings_on,
    split_of,
)
from actors.placement.ledger import available
from actors.placement.memory import MemoryModelError, estimate
from actors.placement.weights import layer_devices
from messages.model import ModelGeometry
from messages.placement import DeviceShortfall, NodeLedger, NodeRejection, PlacementRequest, PreferredSettings
from messages.settings import ServingSettings
from messages.telemetry import NodeResources

#: A node's ledger and the revision it was read at (-1: it does not decode; 0: there is none).
LedgerEntry = tuple[NodeLedger | None, int]
NO_LEDGER: LedgerEntry = (None, 0)

#: Limits of the tables; past one, that table (and what refers to it) is dropped and rebuilt on demand.
MAX_SIZINGS = 4096
MAX_LAYOUTS = 8192
MAX_PROFILES = 4096
MAX_MODELS = 8
#: Questions (model, -ngl, context, required settings) whose standing answer a tracked index keeps, and the
#: touches it remembers (past either, they are dropped and rebuilt by the next decision).
MAX_STANDING = 64
MAX_TOUCHED = 1 << 16

_REFUSED, _MISFIT, _FITS = 0, 1, 2


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
    # the last question asked of this node and its answer: (model, -ngl, ctx, settings, sizing epoch) -> headroom
    asked: tuple[int, int, int, PreferredSettings | None, int] | None = None
    headroom: int = 0
    refusal: NodeRejection | None = None  # when the model does not fit (or cannot run) there


@dataclass(frozen=True, slots=True)
class _Question:
    """One request as the index asks it of each node."""

    request: PlacementRequest
    token: int
    geometry: ModelGeometry
    n_gpu_layers: int
    ctx: int
    monotonic_now: float
    path: str  # the model file's: a node that holds it (in this version, when known) comes first
    digest: str | None

    @property
    def plain(self) -> bool:  # no settings required: the common case is checked inline
        return self.request.settings is None


@dataclass(slots=True)
class _Standing:
    """The last answer of every node of the view to one question: refused (and why), sized and not fitting
    (and why), or fitting (its state); with when each fresh report turns stale and a heap of the fits."""

    epochs: tuple[int, int]
    seen: int  # touches taken in
    refused: dict[str, NodeRejection] = field(default_factory=dict)
    misfits: dict[str, NodeRejection] = field(default_factory=dict)
    # its state, its headroom then, and whether it lacks the model's file
    fits: dict[str, tuple[_NodeState, int, bool]] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)
    due: dict[str, float] = field(default_factory=dict)  # when each fresh node's report turns stale
    deadlines: list[tuple[float, str]] = field(default_factory=list)  # a heap of `due`, lazily cleaned
    best: list[tuple[bool, int, NaturalKey, str, int]] = field(default_factory=list)  # lazily cleaned
    refused_order: list[str] | None = None
    misfit_order: list[str] | None = None

    def forget(self, name: str) -> None:
        if self.refused.pop(name, None) is not None:
            self.refused_order = None
        if self.misfits.pop(name, None) is not None:
            self.misfit_order = None
        self.fits.pop(name, None)
        self.stale.discard(name)
        self.due.pop(name, None)

    def expect(self, name: str, when: float) -> None:
        """`name` is judged again at `when` (when its report turns stale)."""
        self.due[name] = when
        heapq.heappush(self.deadlines, (when, name))
        if len(self.deadlines) > 4 * len(self.due) + 64:  # entries of earlier reports
            self.deadlines = [(w, n) for n, w in self.due.items()]
            heapq.heapify(self.deadlines)

    def expired(self, now: float) -> set[str]:
        """The nodes whose report has turned stale by `now` (each once)."""
        names = set()
        while self.deadlines and self.deadlines[0][0] < now:
            when, name = heapq.heappop(self.deadlines)
            if self.due.get(name) == when:  # not an entry of an earlier report
                del self.due[name]
                names.add(name)
        return names

    def rebuild_best(self, natural: Mapping[str, NaturalKey]) -> None:
        self.best = [(lacks, -room, natural[n], n, id(state)) for n, (state, room, lacks) in self.fits.items()]
        heapq.heapify(self.best)

    def answer(
        self, natural: Mapping[str, NaturalKey]
    ) -> tuple[list[NodeRejection], list[NodeRejection], tuple[_NodeState, int] | None]:
        if self.refused_order is None:
            self.refused_order = sorted(self.refused, key=natural.__getitem__)
        if self.misfit_order is None:
            self.misfit_order = sorted(self.misfits, key=natural.__getitem__)
        best = None
        while self.best:
            lacks, negative, _, name, state_id = self.best[0]
            fit = self.fits.get(name)
            if fit is not None and id(fit[0]) == state_id and fit[1] == -negative and fit[2] == lacks:
                best = fit[0], fit[1]
                break
            heapq.heappop(self.best)  # an answer since replaced
        return [self.refused[n] for n in self.refused_order], [self.misfits[n] for n in self.misfit_order], best


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
    _sizings: dict[tuple[int, int, int, int, PreferredSettings | None], Sizing] = field(default_factory=dict)
    _epoch: int = 0  # bumped when profiles or layouts are dropped: node states re-intern
    _sizing_epoch: int = 0  # bumped when sizings are dropped: nodes' remembered answers are stale
    _sized: int = 0
    _resets: int = 0
    #: The caller calls `touch` for every change of a node's report, arrival or ledger, so a decision judges
    #: again only what changed (`_standing`); untracked, every decision judges every node.
    tracked: bool = False
    _touched: list[str] = field(default_factory=list)
    _standing: dict[tuple[int, int, int, object, str, str | None], _Standing] = field(default_factory=dict)

    @staticmethod
    def covers(request: PlacementRequest) -> bool:
        """Whether `decide` answers `request` from sizings (a fixed context), not by a full scan. A model with
        companion files is sized by a full scan: sizings are kept per model geometry alone."""
        plain = request.model.draft is None and request.model.mmproj is None
        simple = request.ctx is not None and not request.max_ctx and not request.allow_multi_node
        return simple and plain and not request.prefer

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
        request = pooled.resolved_request(request, model.geometry)  # as admission.decide reads it
        if not self.covers(request):
            return self._full_scan(
                request, model, view, arrived, ledgers, fresh, now, monotonic_now, decision_id, reservation_id, dry_run
            )
        self._keep_bounded(view)
        geometry = model.geometry
        token = self._token(geometry)
        ctx = request.ctx
        assert ctx is not None  # covers()
        question = _Question(
            request, token, geometry, request.n_gpu_layers, ctx, monotonic_now, model.path, model.digest
        )
        if self.tracked and not request.nodes and not fresh:
            refused, misfits, best = self._standing_answer(question, view, arrived, ledgers)
        else:
            refused, misfits, best = self._scan(
                question, request.nodes or self._natural_order(view), view, arrived, ledgers, fresh
            )
        fits: list[Fit] = []
        if best is not None:
            state, headroom = best
            settings = settings_on(state.entry.resources, request.settings)  # refusal_of refused it otherwise
            chosen = fit_node(request, geometry, state.entry, settings, state.have, layers=(0, geometry.n_layer))
            assert isinstance(chosen, Fit) and chosen.headroom == headroom, "sizing disagrees with fit_node"
            fits.append(chosen)
        return conclude(
            request, model, view, fits, refused + misfits, now=now, decision_id=decision_id,
            reservation_id=reservation_id, dry_run=dry_run,
        )  # fmt: skip

    def touch(self, name: str) -> None:
        """(`tracked` indexes) `name`'s report, arrival or ledger changed, or it left the view."""
        self._touched.append(name)
        if len(self._touched) > MAX_TOUCHED:
            self._touched.clear()
            self._standing.clear()  # rebuilt by their next decision

    def _scan(
        self,
        q: _Question,
        names: Iterable[str],
        view: Mapping[str, ViewEntry],
        arrived: Mapping[str, float],
        ledgers: Mapping[str, LedgerEntry],
        fresh: Mapping[str, LedgerEntry],
    ) -> tuple[list[NodeRejection], list[NodeRejection], tuple[_NodeState, int] | None]:
        """Every node of `names` judged now, in that order: (refused before sizing, sized and not fitting,
        the best fit: holding the model's file, then most headroom, then natural order)."""
        refused: list[NodeRejection] = []
        misfits: list[NodeRejection] = []
        best: tuple[_NodeState, int] | None = None
        best_key: tuple[bool, int, NaturalKey] | None = None
        for name in names:
            ledger = (fresh.get(name) if fresh else None) or ledgers.get(name, NO_LEDGER)
            kind, refusal, state = self._evaluate(q, name, view.get(name), ledger, arrived)
            if kind == _REFUSED:
                assert refusal is not None
                refused.append(refusal)
            elif kind == _MISFIT:
                assert refusal is not None
                misfits.append(refusal)
            else:
                assert state is not None
                lacks = not holds(state.entry.resources, q.path, q.digest)
                key = (lacks, -state.headroom, self._natural.get(name) or natural_key(name))
                if best_key is None or key < best_key:
                    best, best_key = (state, state.headroom), key
        return refused, misfits, best

    def _evaluate(
        self, q: _Question, name: str, entry: ViewEntry | None, ledger: LedgerEntry, arrived: Mapping[str, float]
    ) -> tuple[int, NodeRejection | None, _NodeState | None]:
        """One node judged for `q`: (_REFUSED, why) before sizing, (_MISFIT, why) sized and not fitting, or
        (_FITS, None, its state: headroom)."""
        if entry is None:
            return (
                _REFUSED,
                NodeRejection(node_id=name, reason="not_found", message="no telemetry from this node"),
                None,
            )
        node = entry.resources
        age = max(0.0, q.monotonic_now - arrived.get(name, q.monotonic_now))
        if not (q.plain and age <= node.ttl_s and ledger[1] >= 0 and node.settings is not None):
            refusal = refusal_of(q.request, name, entry, age, ledger[1] < 0)
            if refusal is not None:
                return _REFUSED, refusal, None
        state = self._nodes.get(name)
        if state is None or state.ledger is not ledger[0] or state.revision != ledger[1] or state.epoch != self._epoch:
            state = self._state(name, entry, ledger)
        elif state.entry is not entry:
            if _same_report(state.entry.resources, node) and _sees_the_same(state.entry.resources, node, ledger[0]):
                state.entry = entry  # a report that only says the node is alive: every answer stands
            else:
                state = self._state(name, entry, ledger)
        asked = (q.token, q.n_gpu_layers, q.ctx, q.request.settings, self._sizing_epoch)
        if state.asked != asked:
            self._answer(state, q)
            state.asked = (q.token, q.n_gpu_layers, q.ctx, q.request.settings, self._sizing_epoch)  # epoch may move
        if state.refusal is not None:
            return _MISFIT, state.refusal, state
        return _FITS, None, state

    # --- standing answers (tracked indexes) ---------------------------------------------------------------

    def _standing_answer(
        self,
        q: _Question,
        view: Mapping[str, ViewEntry],
        arrived: Mapping[str, float],
        ledgers: Mapping[str, LedgerEntry],
    ) -> tuple[list[NodeRejection], list[NodeRejection], tuple[_NodeState, int] | None]:
        """`_scan` over the whole view, from the answer to the same question last time: only the nodes touched
        since, those whose report has aged past its TTL since, and the stale ones (their refusal says how
        old) are judged again."""
        key = (q.token, q.n_gpu_layers, q.ctx, q.request.settings, q.path, q.digest)
        standing = self._standing.get(key)
        epochs = (self._epoch, self._sizing_epoch)
        if standing is None or standing.epochs != epochs or standing.seen > len(self._touched):
            if len(self._standing) >= MAX_STANDING:
                self._standing.clear()
            standing = self._standing[key] = _Standing(epochs=epochs, seen=len(self._touched))
            again: Iterable[str] = self._natural_order(view)
        else:
            names = set(self._touched[standing.seen :])
            standing.seen = len(self._touched)
            names |= standing.stale
            names |= standing.expired(q.monotonic_now)
            again = names
        for name in again:
            self._judge(standing, q, name, view.get(name), ledgers.get(name, NO_LEDGER), arrived)
        return standing.answer(self._natural)

    def _judge(
        self,
        standing: _Standing,
        q: _Question,
        name: str,
        entry: ViewEntry | None,
        ledger: LedgerEntry,
        arrived: Mapping[str, float],
    ) -> None:
        standing.forget(name)
        if entry is None:
            return  # left the view: a whole-view scan does not name it
        if name not in self._natural:
            self._natural[name] = natural_key(name)
        kind, refusal, state = self._evaluate(q, name, entry, ledger, arrived)
        if kind == _REFUSED and refusal is not None and refusal.reason == "telemetry_stale":
            standing.stale.add(name)  # judged every time: its message counts the seconds
        else:  # judged again once stale, whatever its answer now
            standing.expect(name, arrived.get(name, q.monotonic_now) + entry.resources.ttl_s)
        if kind == _REFUSED:
            assert refusal is not None
            standing.refused[name] = refusal
            standing.refused_order = None
            return
        if kind == _MISFIT:
            assert refusal is not None
            standing.misfits[name] = refusal
            standing.misfit_order = None
            return
        assert state is not None
        lacks = not holds(state.entry.resources, q.path, q.digest)
        standing.fits[name] = (state, state.headroom, lacks)
        heapq.heappush(standing.best, (lacks, -state.headroom, self._natural[name], name, id(state)))
        if len(standing.best) > 4 * len(standing.fits) + 64:
            standing.rebuild_best(self._natural)

    def _answer(self, state: _NodeState, q: _Question) -> None:
        """Sizes the model on `state`'s node (from a shared sizing): its headroom, or its refusal."""
        name = state.entry.resources.node_id
        ctx = q.ctx
        sizing = self._sizing(q.token, q.geometry, state, q.n_gpu_layers, ctx, q.request.settings)
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

    def _sizing(
        self,
        token: int,
        geometry: ModelGeometry,
        state: _NodeState,
        n_gpu_layers: int,
        ctx: int,
        wanted: PreferredSettings | None,
    ) -> Sizing:
        layout = self._layout(token, geometry, state, n_gpu_layers)
        key = (token, state.profile, layout, ctx, wanted)
        sizing = self._sizings.get(key)
        if sizing is not None:
            return sizing
        node = state.entry.resources
        settings = settings_on(node, wanted)
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


def _same_report(a: NodeResources, b: NodeResources) -> bool:
    """Whether two reports of a node say the same but for their sequence number and time of sending (every
    other field, present or future, compared)."""
    return msgspec.structs.replace(a, seq=b.seq, sent_at=b.sent_at) == b


def _sees_the_same(a: NodeResources, b: NodeResources, ledger: NodeLedger | None) -> bool:
    """Whether reports sent at `a.sent_at` and `b.sent_at` see the same reservations as running: the live term
    of `ledger.available` subtracts what a report cannot see yet (ready at or after it was sent), so an
    instance that became ready between two reports of the same content changes what the node offers."""
    if ledger is None or a.sent_at == b.sent_at:
        return True
    return all(
        (r.running_since >= a.sent_at) == (r.running_since >= b.sent_at)
        for r in ledger.reservations
        if r.running_since is not None
    )


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
