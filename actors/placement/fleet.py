"""The cluster view indexed for admission (placement core, pure): the one path by which placement decides,
without sizing every node on every request.

Theory of operation. For a request with a fixed context (`ctx` given, no `max_ctx`), what the memory model
says about a node depends on the node only through its serving settings, its CPU features and where the
model's layers go (`weights.layer_devices`: its `-ngl` and its GPUs' split, the split being in proportion to
what each GPU has free; a draft model's layers too). So the model (with its draft model and projector, if
any) is sized once per distinct (settings, CPU features, layer layout) and context — a *sizing*, kept across
requests — and each node then only compares the sizing's per-device totals with what its ledger leaves
available: fits, headroom, or the shortfalls of its refusal. A request for the largest context that fits
(`max_ctx`, or no `ctx`) sizes each node at its own ceiling (`admission.fit_node`): that answer is the node's
alone, kept with the node's state like any other. A node's derived state (what it has available, its split)
is recomputed only when its report or its ledger changes (a report equal to the last but for its sequence
number and time keeps it, unless a reservation became running between the two: the newer report sees that
memory as used, so the live term no longer subtracts it).

A *tracked* index (the placement actor's) is told of every change (`touch`: a report, a node leaving, a
ledger) and keeps, per question (model and companions, context, `-ngl`, required settings), a standing answer
of every node (`_Standing`): a decision judges again only the nodes touched since that question was last
asked, those whose report turned stale since (a heap of deadlines) and the stale ones (their refusal says how
old the report is), then reads the answer off: the refusals in natural order, the best fit from a heap (the
nodes a request prefers looked up first). An explicit node list, or ledgers read fresh from the bucket, are
judged in full. When no node fits and the request allows a split, the split is planned over the nodes that
were sized (`admission.split_over`). An untracked index built for one decision is `decide`
(`fleet.decide`: replay, and the placement actor's requests that size every node at its ceiling or plan a
split, run off its event loop on a copy of the view).

Rules this module keeps:
- Decisions are the rules of `admission` applied to every node, field for field: the same rejections in the
  same order with the same messages, the same chosen node, breakdown, stamp and reservation, or the same
  split. The chosen node is sized by `admission.fit_node` itself; with a fixed context the others need no
  context ceiling, since a node's ceiling then shows only in the chosen node's breakdown, and the memory
  model's refusals (`unsupported_settings`) do not depend on the context. `tests/unit/test_fleet_index.py`
  checks the equality on random fleets against a brute-force oracle that judges every node in turn
  (`tests/placement_oracle.py`), for every kind of request.
- Every table is bounded: profiles, layouts and sizings are dropped wholesale past their limits (then rebuilt
  on demand; distinct ones are few in a fleet), node states are kept only for nodes in the view.
- The view's keys are the nodes' ids (the placement actor refuses a report stored under another key).
Nothing here reads a clock: the caller passes the time and when each report arrived.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Collection, Iterable, Mapping
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
    conclude_split,
    fit_node,
    holds,
    insufficient,
    natural_key,
    prefer_rank,
    refusal_of,
    settings_on,
    split_of,
    split_over,
    without_split,
)
from actors.placement.ledger import available
from actors.placement.memory import MemoryModelError, estimate
from actors.placement.weights import layer_devices
from messages.model import ModelGeometry, ProjectorGeometry
from messages.placement import (
    LISTED_REFUSALS,
    DeviceShortfall,
    NodeLedger,
    NodeRejection,
    PlacementDecision,
    PlacementRequest,
    PreferredSettings,
)
from messages.settings import ServingSettings
from messages.telemetry import NodeResources

#: A node's ledger and the revision it was read at (-1: it does not decode; 0: there is none).
LedgerEntry = tuple[NodeLedger | None, int]
NO_LEDGER: LedgerEntry = (None, 0)

#: Limits of the tables; past one, that table (and what refers to it) is dropped and rebuilt on demand.
#: (At 10,000 simulated nodes: 1,310 profiles, 7,658 layouts, 6,310 sizings; smaller limits reset the tables
#: over and over, each reset sizing every node again.)
MAX_SIZINGS = 32768
MAX_LAYOUTS = 32768
MAX_PROFILES = 16384
MAX_MODELS = 8
#: Questions (model, -ngl, context, required settings) whose standing answer a tracked index keeps, and the
#: touches it remembers (past either, they are dropped and rebuilt by the next decision).
MAX_STANDING = 64
MAX_TOUCHED = 1 << 16
#: The next best fits a brief admission's journal records beside the chosen node (a few kilobytes each: the
#: event stays inline, under the actor's 32 KiB, at any fleet size).
RIVALS = 4

_REFUSED, _MISFIT, _FITS = 0, 1, 2

#: What a node's answer depends on besides the node: (model token, -ngl, ctx, at the ceiling, settings).
_Key = tuple[int, int, int | None, bool, PreferredSettings | None]
#: A model and its companions as sized: (geometry, draft model, projector).
_Model = tuple[ModelGeometry, ModelGeometry | None, ProjectorGeometry | None]


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
    # the last question asked of this node and its answer: (question, sizing epoch) -> headroom
    asked: tuple[_Key, int] | None = None
    headroom: int = 0
    refusal: NodeRejection | None = None  # when the model does not fit (or cannot run) there
    fit: Fit | None = None  # sized at its ceiling: how the model runs there


@dataclass(frozen=True, slots=True)
class _Question:
    """One request as the index asks it of each node."""

    request: PlacementRequest
    token: int
    model: ModelFacts
    ceiling: bool  # each node sized at its own context ceiling (`max_ctx`, or no `ctx`)
    key: _Key
    monotonic_now: float

    @property
    def plain(self) -> bool:  # no settings required: the common case is checked inline
        return self.request.settings is None


@dataclass(frozen=True, slots=True)
class _Fitting:
    """A node the model fits on, as judged for one question: its state and headroom then, whether it lacks
    the model's file, and (sized at its ceiling) how the model runs there."""

    state: _NodeState
    headroom: int
    lacks: bool
    fit: Fit | None
    serial: int = 0  # tells a standing answer's current entry in its heap from earlier ones


@dataclass(frozen=True, slots=True)
class _Judged:
    """Every node's answer to one request, in the order a decision lists them."""

    refused: list[NodeRejection]  # not sized: why
    misfits: list[tuple[NodeRejection, _NodeState]]  # sized and not fitting (with the fits: the eligible nodes)
    best: _Fitting | None  # the fit chosen: holding the model's file, preferred, most headroom, natural order


@dataclass(slots=True)
class _Standing:
    """The last answer of every node of the view to one question: refused (and why), sized and not fitting
    (and why), or fitting; with when each fresh report turns stale and a heap of the fits."""

    epochs: tuple[int, int]
    seen: int  # touches taken in
    refused: dict[str, NodeRejection] = field(default_factory=dict)
    misfits: dict[str, tuple[NodeRejection, _NodeState]] = field(default_factory=dict)
    fits: dict[str, _Fitting] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)
    due: dict[str, float] = field(default_factory=dict)  # when each fresh node's report turns stale
    deadlines: list[tuple[float, str]] = field(default_factory=list)  # a heap of `due`, lazily cleaned
    best: list[tuple[bool, int, NaturalKey, str, int]] = field(default_factory=list)  # lazily cleaned
    refused_order: list[str] | None = None
    misfit_order: list[str] | None = None
    serial: int = 0
    holders: set[str] = field(default_factory=set)  # nodes of the view reporting the model's file (any state)

    def forget(self, name: str) -> None:
        if self.refused.pop(name, None) is not None:
            self.refused_order = None
        if self.misfits.pop(name, None) is not None:
            self.misfit_order = None
        self.fits.pop(name, None)
        self.stale.discard(name)
        self.due.pop(name, None)
        self.holders.discard(name)

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

    def add_fit(self, name: str, fitting: _Fitting, natural: Mapping[str, NaturalKey]) -> None:
        self.serial += 1
        fitting = dataclasses.replace(fitting, serial=self.serial)
        self.fits[name] = fitting
        heapq.heappush(self.best, (fitting.lacks, -fitting.headroom, _key(natural, name), name, fitting.serial))
        if len(self.best) > 4 * len(self.fits) + 64:
            self.best = [(f.lacks, -f.headroom, _key(natural, n), n, f.serial) for n, f in self.fits.items()]
            heapq.heapify(self.best)

    def best_for(self, prefer: tuple[str, ...]) -> _Fitting | None:
        """The fit a request preferring `prefer` chooses (None: no node fits)."""
        return self._preferred(prefer)

    def answer(self, natural: Mapping[str, NaturalKey], prefer: tuple[str, ...]) -> _Judged:
        if self.refused_order is None:
            self.refused_order = sorted(self.refused, key=lambda n: _key(natural, n))
        if self.misfit_order is None:
            self.misfit_order = sorted(self.misfits, key=lambda n: _key(natural, n))
        return _Judged(
            refused=[self.refused[n] for n in self.refused_order],
            misfits=[self.misfits[n] for n in self.misfit_order],
            best=self._preferred(prefer),
        )

    def runners_up(self, chosen: str, k: int) -> list[str]:
        """Up to `k` fits after the heap's best (other than `chosen`), best first: what a journal records beside
        the chosen node so that replay compares it with its closest rivals."""
        found: list[str] = []
        for *_, name, serial in heapq.nsmallest(4 * k + 4, self.best):
            fitting = self.fits.get(name)
            if fitting is not None and fitting.serial == serial and name != chosen:
                found.append(name)
                if len(found) == k:
                    break
        return found

    def _preferred(self, prefer: tuple[str, ...]) -> _Fitting | None:
        """The best fit for a request preferring `prefer` (in its order): a node holding the model's file
        first, then a preferred one, then the most headroom (the heap's order, which knows no preference)."""
        top = self._top()
        if not prefer:
            return top
        preferred = [self.fits[name] for name in prefer if name in self.fits]
        holding = next((f for f in preferred if not f.lacks), None)
        if holding is not None:
            return holding
        if top is not None and not top.lacks:
            return top  # a node that holds the file, none of them preferred
        return preferred[0] if preferred else top

    def _top(self) -> _Fitting | None:
        while self.best:
            *_, name, serial = self.best[0]
            fitting = self.fits.get(name)
            if fitting is not None and fitting.serial == serial:
                return fitting
            heapq.heappop(self.best)  # an answer since replaced
        return None


@dataclass(frozen=True, slots=True)
class Decided:
    """A decision, and the nodes whose reports and ledgers a journal records so that replay decides it again
    identically (None: every node of the view). A brief admission (`brief`) needs only the chosen node and the
    node it would fetch the model's file from; its closest rivals (the next `RIVALS` best fits) are recorded with
    it, so that replay with another memory model sees the choice it would now make among them."""

    outcome: Outcome
    witnesses: frozenset[str] | None


def brief(decision: PlacementDecision) -> PlacementDecision:
    """`decision` as answered to a request that did not ask for every node's refusal (`explain`): admitted, it
    names what it chose (its placements, their revisions in `view`); refused, it lists at most
    `LISTED_REFUSALS` refusals, the nodes short of memory by the least first (the ones that room on them would
    serve), then the others in the decision's order; its message is the whole decision's (a count of the rest)."""
    if decision.admitted:
        rejections: tuple[NodeRejection, ...] = ()
        named = [p.node_id for p in decision.placements]
    else:
        ranked = sorted(range(len(decision.rejections)), key=lambda i: _closeness(decision.rejections[i], i))
        rejections = tuple(decision.rejections[i] for i in ranked[:LISTED_REFUSALS])
        named = [r.node_id for r in rejections]
    view = {name: decision.view[name] for name in named if name in decision.view}
    return msgspec.structs.replace(decision, rejections=rejections, view=view)


def _closeness(rejection: NodeRejection, position: int) -> tuple[int, int, int]:
    """Orders refusals: short of memory first, by the largest shortfall on any device, then where it was."""
    if rejection.reason != "insufficient_memory":
        return 1, 0, position
    worst = max((s.need_bytes - s.have_bytes for s in rejection.shortfalls), default=0)
    return 0, worst, position


@dataclass(frozen=True, slots=True)
class IndexStats:
    """How big the index is and how often it sized something: reported by the placement actor."""

    nodes: int
    profiles: int
    layouts: int
    sizings: int
    sized: int  # memory-model sizings made since the index was created (a node at its ceiling counts one)
    resets: int  # times a table was dropped for reaching its limit
    touches: int = 0  # (tracked) changes told (`touch`): each judges the node again at the next decision


@dataclass(slots=True)
class FleetIndex:
    """Caches between decisions; `decide` with the same arguments as `fleet.decide` takes, but the view
    without ages (`arrived`: when each report arrived, on the caller's monotonic clock)."""

    _nodes: dict[str, _NodeState] = field(default_factory=dict)
    _order: list[str] = field(default_factory=list)  # the view's names in natural order
    _natural: dict[str, tuple[tuple[int, int, str], ...]] = field(default_factory=dict)
    # (id(geometry), id(draft), id(projector)) -> the three and their token
    _models: dict[tuple[int, int, int], tuple[_Model, int]] = field(default_factory=dict)
    _next_model: int = 0
    _profiles: dict[tuple[ServingSettings, tuple[str, ...] | None], int] = field(default_factory=dict)
    _layouts: dict[tuple[int, int, tuple[float, ...]], int] = field(default_factory=dict)
    _layout_ids: dict[tuple[tuple[int, ...], tuple[int, ...], bool], int] = field(default_factory=dict)
    _sizings: dict[tuple[int, int, int, int, PreferredSettings | None], Sizing] = field(default_factory=dict)
    _epoch: int = 0  # bumped when profiles or layouts are dropped: node states re-intern
    _sizing_epoch: int = 0  # bumped when sizings are dropped: nodes' remembered answers are stale
    _sized: int = 0
    _resets: int = 0
    #: The caller calls `touch` for every change of a node's report, arrival or ledger, so a decision judges
    #: again only what changed (`_standing`); untracked, every decision judges every node.
    tracked: bool = False
    _touched: list[str] = field(default_factory=list)
    _touches: int = 0
    _standing: dict[tuple[_Key, str, str | None], _Standing] = field(default_factory=dict)

    @staticmethod
    def covers(request: PlacementRequest) -> bool:
        """Whether `decide` answers `request` from shared sizings, a comparison per node cheap enough for the
        caller's event loop: a fixed context and no split (companions and preferences included). Otherwise it
        sizes each node at its own ceiling, or plans a split, work that grows with the view: the placement
        actor runs that on a copy of the view, off its loop (`fleet.decide`, a one-shot index)."""
        return request.ctx is not None and not request.max_ctx and not request.allow_multi_node

    def stats(self) -> IndexStats:
        return IndexStats(
            nodes=len(self._nodes),
            profiles=len(self._profiles),
            layouts=len(self._layout_ids),
            sizings=len(self._sizings),
            sized=self._sized,
            resets=self._resets,
            touches=self._touches,
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
        """The decision over `view` aged at `monotonic_now` and the ledgers of the nodes it considers (`fresh`
        first: read from the bucket, newer than `ledgers`)."""
        return self.decision(
            request, model, view, arrived, ledgers, now=now, monotonic_now=monotonic_now, decision_id=decision_id,
            reservation_id=reservation_id, dry_run=dry_run, fresh=fresh,
        ).outcome  # fmt: skip

    def decision(
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
    ) -> Decided:
        """`decide`, with the nodes a journal records for replay to decide it again (`Decided.witnesses`)."""
        fresh = fresh or {}
        request = pooled.resolved_request(request, model.geometry)  # an embedding or rerank model by its header
        self._keep_bounded(view)
        q = self._question(request, model, monotonic_now)
        if self.tracked and not request.nodes and not fresh:
            standing = self._standing_answer(q, view, arrived, ledgers)
            best = standing.best_for(request.prefer)
            if best is not None and not request.explain:
                return self._admitted_briefly(q, standing, best, view, now, decision_id, reservation_id, dry_run)
            judged = standing.answer(self._natural, request.prefer)
        else:
            judged = self._scan(q, request.nodes or self._natural_order(view), view, arrived, ledgers, fresh)
        outcome = self._conclude(q, judged, view, now, decision_id, reservation_id, dry_run)
        if not request.explain:
            outcome = dataclasses.replace(outcome, decision=brief(outcome.decision))
        return Decided(outcome, None)

    def _admitted_briefly(
        self,
        q: _Question,
        standing: _Standing,
        best: _Fitting,
        view: Mapping[str, ViewEntry],
        now: float,
        decision_id: str,
        reservation_id: str,
        dry_run: bool,
    ) -> Decided:
        """The brief answer of a request some node fits, read off its standing answer without walking the view:
        the decision names the chosen node (and, when it lacks the model's file, the node it would fetch it from,
        the first holder in natural order), as the decision over the whole view would after `brief`."""
        name = best.state.entry.resources.node_id
        named = {name}
        if best.lacks and standing.holders:
            named.add(min(standing.holders, key=lambda n: _key(self._natural, n)))
        outcome = conclude(
            q.request, q.model, {n: view[n] for n in named}, [self._chosen(q, best, view)], [], now=now,
            decision_id=decision_id, reservation_id=reservation_id, dry_run=dry_run,
        )  # fmt: skip
        rivals = standing.runners_up(name, RIVALS) if not dry_run else []  # a dry run is not journaled
        return Decided(dataclasses.replace(outcome, decision=brief(outcome.decision)), frozenset((*named, *rivals)))

    def _conclude(
        self,
        q: _Question,
        judged: _Judged,
        view: Mapping[str, ViewEntry],
        now: float,
        decision_id: str,
        reservation_id: str,
        dry_run: bool,
    ) -> Outcome:
        """The decision from every node's answer (`judged`): the best fit, or a split, or every refusal."""
        request, model = q.request, q.model
        rejections = judged.refused + [refusal for refusal, _ in judged.misfits]
        fits = [] if judged.best is None else [self._chosen(q, judged.best, view)]
        if not fits and request.allow_multi_node:
            # no node fits: every eligible one misfits
            states = [_caught_up(state, view) for _, state in judged.misfits]
            eligible = [state.entry for state in states]
            haves = {state.entry.resources.node_id: state.have for state in states}
            split, why = split_over(request, model, eligible, haves)
            if split is not None:
                return conclude_split(
                    request, model, view, split, rejections, now=now, decision_id=decision_id,
                    reservation_id=reservation_id, dry_run=dry_run,
                )  # fmt: skip
            refused = conclude(
                request, model, view, fits, rejections, now=now, decision_id=decision_id,
                reservation_id=reservation_id, dry_run=dry_run,
            )  # fmt: skip
            return without_split(refused, why)
        return conclude(
            request, model, view, fits, rejections, now=now, decision_id=decision_id,
            reservation_id=reservation_id, dry_run=dry_run,
        )  # fmt: skip

    def touch(self, name: str) -> None:
        """(`tracked` indexes) `name`'s report, arrival or ledger changed, or it left the view."""
        self._touches += 1
        self._touched.append(name)
        if len(self._touched) > MAX_TOUCHED:
            self._touched.clear()
            self._standing.clear()  # rebuilt by their next decision

    def refreshed(self, name: str, entry: ViewEntry) -> None:
        """(`tracked` indexes) `name` reported again what it reported last (`entry`: only its sequence number, time
        of sending, revision and arrival are new; `intake.heartbeat_of`). No answer changes, so the node is not
        judged again for it: each standing answer judges it when its earlier report would have turned stale (and
        finds it fresh), and a decision that names it reads its entry from the view (`_caught_up`). Unless a
        reservation became running between the two reports: the newer one sees that memory as used, so what the
        node offers changes (`_sees_the_same`), and it is touched."""
        state = self._nodes.get(name)
        if state is not None and not _sees_the_same(state.entry.resources, entry.resources, state.ledger):
            self.touch(name)

    def _question(self, request: PlacementRequest, model: ModelFacts, monotonic_now: float) -> _Question:
        token = self._token(model)
        ceiling = request.ctx is None or request.max_ctx
        key = (token, request.n_gpu_layers, request.ctx, ceiling, request.settings)
        return _Question(request, token, model, ceiling, key, monotonic_now)

    def _chosen(self, q: _Question, best: _Fitting, view: Mapping[str, ViewEntry]) -> Fit:
        """How the model runs on the chosen node: as sized at its ceiling, or by `admission.fit_node` itself
        (which also finds the node's context ceiling, part of the chosen node's breakdown)."""
        state = _caught_up(best.state, view)
        if best.fit is not None:
            # a heartbeat since may have replaced the node's entry (the same report, only newer)
            return best.fit if best.fit.entry is state.entry else dataclasses.replace(best.fit, entry=state.entry)
        model = q.model
        settings = settings_on(state.entry.resources, q.request.settings)  # refusal_of refused it otherwise
        chosen = fit_node(
            q.request, model.geometry, state.entry, settings, state.have, layers=(0, model.geometry.n_layer),
            draft=model.draft, projector=model.projector,
        )  # fmt: skip
        assert isinstance(chosen, Fit) and chosen.headroom == best.headroom, "sizing disagrees with fit_node"
        return chosen

    def _scan(
        self,
        q: _Question,
        names: Iterable[str],
        view: Mapping[str, ViewEntry],
        arrived: Mapping[str, float],
        ledgers: Mapping[str, LedgerEntry],
        fresh: Mapping[str, LedgerEntry],
    ) -> _Judged:
        """Every node of `names` judged now, in that order."""
        refused: list[NodeRejection] = []
        misfits: list[tuple[NodeRejection, _NodeState]] = []
        best: _Fitting | None = None
        best_key: tuple[bool, int, int, NaturalKey] | None = None
        for name in names:
            ledger = (fresh.get(name) if fresh else None) or ledgers.get(name, NO_LEDGER)
            kind, refusal, state = self._evaluate(q, name, view.get(name), ledger, arrived)
            if kind == _REFUSED:
                assert refusal is not None
                refused.append(refusal)
            elif kind == _MISFIT:
                assert refusal is not None and state is not None
                misfits.append((refusal, state))
            else:
                assert state is not None
                lacks = not holds(state.entry.resources, q.model.path, q.model.digest)
                natural = self._natural.get(name) or natural_key(name)
                key = (lacks, prefer_rank(q.request, name), -state.headroom, natural)
                if best_key is None or key < best_key:
                    best, best_key = _Fitting(state, state.headroom, lacks, state.fit if q.ceiling else None), key
        return _Judged(refused, misfits, best)

    def _evaluate(
        self, q: _Question, name: str, entry: ViewEntry | None, ledger: LedgerEntry, arrived: Mapping[str, float]
    ) -> tuple[int, NodeRejection | None, _NodeState | None]:
        """One node judged for `q`: (_REFUSED, why) before sizing, (_MISFIT, why, its state) sized and not
        fitting, or (_FITS, None, its state: headroom, and its fit when sized at its ceiling)."""
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
        if state.asked != (q.key, self._sizing_epoch):
            self._answer(state, q)
            state.asked = (q.key, self._sizing_epoch)  # the sizing epoch may have moved
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
    ) -> _Standing:
        """`_scan` over the whole view, from the answer to the same question last time: only the nodes touched
        since, those whose report has aged past its TTL since, and the stale ones (their refusal says how
        old) are judged again."""
        key = (q.key, q.model.path, q.model.digest)
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
        try:
            for name in again:
                self._judge(standing, q, name, view.get(name), ledgers.get(name, NO_LEDGER), arrived)
        except BaseException:
            del self._standing[key]  # half taken in: rebuilt by the next decision
            raise
        return standing

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
        if holds(entry.resources, q.model.path, q.model.digest):
            standing.holders.add(name)  # what the chosen node fetches, if it lacks the file, is sized by these
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
        assert state is not None
        if kind == _MISFIT:
            assert refusal is not None
            standing.misfits[name] = (refusal, state)
            standing.misfit_order = None
            return
        lacks = not holds(state.entry.resources, q.model.path, q.model.digest)
        fitting = _Fitting(state, state.headroom, lacks, state.fit if q.ceiling else None)
        standing.add_fit(name, fitting, self._natural)

    # --- one node's answer --------------------------------------------------------------------------------

    def _answer(self, state: _NodeState, q: _Question) -> None:
        """Sizes the model on `state`'s node: its headroom, or its refusal."""
        state.fit = None
        state.refusal = None
        if q.ceiling:
            self._answer_at_ceiling(state, q)
        else:
            self._answer_from_sizing(state, q)

    def _answer_from_sizing(self, state: _NodeState, q: _Question) -> None:
        """At the request's context, from a sizing shared by the nodes of the same profile and layout."""
        name = state.entry.resources.node_id
        ctx = q.request.ctx
        assert ctx is not None  # not q.ceiling
        sizing = self._sizing(q, state, ctx)
        if sizing.error is not None:
            state.headroom = -1
            state.refusal = NodeRejection(node_id=name, reason="unsupported_settings", message=sizing.error)
            return
        state.headroom = min(state.have.get(device, 0) - total for device, total in sizing.totals)
        if state.headroom < 0:
            state.refusal = insufficient(name, ctx, _shortfalls(sizing, state.have))

    def _answer_at_ceiling(self, state: _NodeState, q: _Question) -> None:
        """At the node's own context ceiling (what fits depends on what it has): `admission.fit_node`."""
        model = q.model
        settings = settings_on(state.entry.resources, q.request.settings)  # refusal_of refused it otherwise
        result = fit_node(
            q.request, model.geometry, state.entry, settings, state.have, layers=(0, model.geometry.n_layer),
            draft=model.draft, projector=model.projector,
        )  # fmt: skip
        self._sized += 1
        if isinstance(result, NodeRejection):
            state.headroom = -1
            state.refusal = result
        else:
            state.headroom = result.headroom
            state.fit = result

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

    def _token(self, model: ModelFacts) -> int:
        """The model and its companions as one number (their objects kept, so their ids stay theirs)."""
        parts: _Model = (model.geometry, model.draft, model.projector)
        key = (id(parts[0]), id(parts[1]), id(parts[2]))
        known = self._models.get(key)
        if known is not None and all(a is b for a, b in zip(known[0], parts, strict=True)):
            return known[1]
        if len(self._models) >= MAX_MODELS:
            self._models.clear()  # their sizings age out with the sizings table
        self._next_model += 1
        self._models[key] = (parts, self._next_model)
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

    def _layout(self, q: _Question, state: _NodeState) -> int:
        """The id of where the model's layers (and its draft model's) go on `state`'s node, with whether it
        has a GPU split (which places a projector, and what the host repacks)."""
        geometry, draft = q.model.geometry, q.model.draft
        ngl, split = split_of(state.entry.resources, state.have, q.request.n_gpu_layers)
        if len(split) > 1:
            # In proportion to free memory, which differs per node: computed per node state (the caller keeps
            # the answer until the state changes), and only the resulting layout is shared.
            drafted = tuple(layer_devices(draft, ngl, split)) if draft is not None else ()
            return self._layout_id(tuple(layer_devices(geometry, ngl, split)), drafted, True)
        # No GPU, or one that takes every offloaded layer whatever its (positive: split_of) weight.
        key = (q.token, ngl, (1.0,) if split else ())
        layout = self._layouts.get(key)
        if layout is None:
            drafted = tuple(layer_devices(draft, ngl, key[2])) if draft is not None else ()
            devices = tuple(layer_devices(geometry, ngl, key[2]))
            layout = self._layouts[key] = self._layout_id(devices, drafted, bool(split))
        return layout

    def _layout_id(self, devices: tuple[int, ...], drafted: tuple[int, ...], has_split: bool) -> int:
        return self._layout_ids.setdefault((devices, drafted, has_split), len(self._layout_ids))

    def _sizing(self, q: _Question, state: _NodeState, ctx: int) -> Sizing:
        layout = self._layout(q, state)
        wanted = q.request.settings
        key = (q.token, state.profile, layout, ctx, wanted)
        sizing = self._sizings.get(key)
        if sizing is not None:
            return sizing
        node = state.entry.resources
        model = q.model
        settings = settings_on(node, wanted)
        ngl, split = split_of(node, state.have, q.request.n_gpu_layers)
        try:
            breakdown = estimate(
                model.geometry, settings, ctx, n_gpu_layers=ngl, gpu_split=split, cpu_features=node.host.cpu_features,
                draft=model.draft, projector=model.projector,
            )  # fmt: skip
            sizing = Sizing(totals=tuple((d.device, d.total_bytes) for d in breakdown.devices))
        except MemoryModelError as exc:
            sizing = Sizing(totals=(), error=str(exc))
        self._sized += 1
        self._sizings[key] = sizing
        return sizing


def _key(natural: Mapping[str, NaturalKey], name: str) -> NaturalKey:
    """`name`'s natural sort key, kept or computed: a standing answer may still hold a node that has left the
    view (and whose key `_keep_bounded` dropped) until the node, touched, is judged again."""
    key = natural.get(name)
    return key if key is not None else natural_key(name)


def _same_report(a: NodeResources, b: NodeResources) -> bool:
    """Whether two reports of a node say the same but for their sequence number and time of sending (every
    other field, present or future, compared)."""
    return msgspec.structs.replace(a, seq=b.seq, sent_at=b.sent_at) == b


def _caught_up(state: _NodeState, view: Mapping[str, ViewEntry]) -> _NodeState:
    """`state` with its node's entry as the view has it now: a heartbeat taken in since (`FleetIndex.refreshed`)
    replaces the entry, as judging the node again would; every answer stands."""
    current = view.get(state.entry.resources.node_id)
    if (
        current is not None
        and current is not state.entry
        and _same_report(state.entry.resources, current.resources)
        and _sees_the_same(state.entry.resources, current.resources, state.ledger)
    ):
        state.entry = current
    return state


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
    """`fleet.decide`'s inputs: the view with each report's age, the ledgers of the nodes a request
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
    only: Collection[str] | None = None,
) -> Inputs:
    """What `fleet.decide` is given for `request` at `monotonic_now` (`fresh` ledgers first): the whole
    view, or only the nodes `only` names (a decision's witnesses, `Decided`)."""
    aged = {
        name: ViewEntry(
            resources=entry.resources,
            revision=entry.revision,
            age_s=max(0.0, monotonic_now - arrived.get(name, monotonic_now)),
        )
        for name, entry in (view.items() if only is None else ((n, view[n]) for n in only if n in view))
    }
    names = [name for name in (request.nodes or aged) if name in aged]
    considered = {name: fresh.get(name) or ledgers.get(name, NO_LEDGER) for name in names}
    held = {name: ledger for name, (ledger, _) in considered.items() if ledger is not None}
    unreadable = frozenset(name for name, (_, revision) in considered.items() if revision < 0)
    return Inputs(view=aged, ledgers=considered, held=held, unreadable=unreadable)


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
    """One decision by an index built for it (replay, and the placement actor's requests that size every node at
    its ceiling or plan a split): the decision over `view` (each report with its age, as `snapshot` gives it or
    a journal recorded it); `unreadable` names nodes whose ledger does not decode."""
    arrived = {name: -entry.age(now) for name, entry in view.items()}  # on a clock that reads 0 at the decision
    entries: dict[str, LedgerEntry] = {name: (ledger, 1) for name, ledger in ledgers.items()}
    entries.update((name, (None, -1)) for name in unreadable)
    return FleetIndex().decide(
        request, model, view, arrived, entries, now=now, monotonic_now=0.0, decision_id=decision_id,
        reservation_id=reservation_id, dry_run=dry_run,
    )  # fmt: skip


__all__ = [
    "NO_LEDGER",
    "Decided",
    "FleetIndex",
    "IndexStats",
    "Inputs",
    "LedgerEntry",
    "Sizing",
    "brief",
    "decide",
    "snapshot",
]
