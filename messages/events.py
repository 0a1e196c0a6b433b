"""Journal events: every decision and lifecycle change, published on `mesh.events.<actor>.<type>`.

Each event is a frozen Struct tagged by `type` and carries the envelope fields `id` (unique, used as the
JetStream `Nats-Msg-Id` so a retried publish is stored once), `time` (unix seconds), `node`, `actor` and
`trace`: the W3C traceparent of the request the event was recorded for (`runtime/tracing.py`; "" for an event
no request caused, and in events written before it existed).
Readers that meet a type they do not know (a newer producer) still show it as plain JSON.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from messages.frontdoor import ModelScale, ScaleDecision, ScaleMemory
from messages.generate import Candidate, RouteDecision, RouteWeights, StopReason
from messages.l3 import PrefixSource
from messages.memory import MemoryBreakdown
from messages.model import ModelGeometry, ProjectorGeometry
from messages.placement import NodeLedger, PlacementDecision, PlacementRequest
from messages.runner import FieldDrift, ObservedMemory
from messages.telemetry import NodeResources


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Envelope shared by every event. A `PRIVATE` event (the tenants' usage) is journaled apart, in the usage
    stream (`Subjects.usage_stream`), which the mesh's users read and no client does."""

    PRIVATE: ClassVar[bool] = False

    id: str
    time: float
    node: str
    actor: str
    trace: str = ""  # `00-<trace id>-<span id>-<flags>`: the request's trace and the hop (span) that recorded it


class ActorStarted(Event, frozen=True, kw_only=True, tag="actor_started"):
    attempt: int  # 1 for the first start, n for the (n-1)th restart


class ActorCrashed(Event, frozen=True, kw_only=True, tag="actor_crashed"):
    error: str
    crashes_in_window: int
    restart_in_s: float


class ActorRestarted(Event, frozen=True, kw_only=True, tag="actor_restarted"):
    attempt: int


class ActorGaveUp(Event, frozen=True, kw_only=True, tag="actor_gave_up"):
    """The actor crashed more often than its restart intensity allows and is stopped for good."""

    error: str
    crashes: int
    window_s: float


class ActorStopped(Event, frozen=True, kw_only=True, tag="actor_stopped"):
    pass


class NodeStarted(Event, frozen=True, kw_only=True, tag="node_started"):
    version: str
    nats_url: str
    embedded_nats: bool
    actors: tuple[str, ...]


class EventTooLarge(Event, frozen=True, kw_only=True, tag="event_too_large"):
    """Recorded by the journal in place of an event that could never be stored (over the bus's max_payload
    or the journal's event limit): the loss is visible, and the outbox never jams on it."""

    event_type: str
    event_id: str
    size_bytes: int
    limit_bytes: int


class NodeStopped(Event, frozen=True, kw_only=True, tag="node_stopped"):
    reason: str


class TelemetryChanged(Event, frozen=True, kw_only=True, tag="telemetry_changed"):
    """The node's advertisement changed in a way placement cares about (first report, settings, devices)."""

    reason: str
    resources: NodeResources


def event_type(event: Event) -> str:
    """The `type` tag of an event (also the last token of its subject)."""
    tag: Any = type(event).__struct_config__.tag
    return str(tag)


# --- placement -----------------------------------------------------------------------------------------


class DecisionInputs(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a placement decision used, complete: what replay feeds to today's core.

    Small decisions carry these fields inline in their `placement_decided` event. A large one (a view of
    thousands of nodes would not fit in one NATS message) stores this record in the decisions object store
    under the blake3 of its JSON encoding, and its event carries that digest (`record`)."""

    request: PlacementRequest
    view: tuple[NodeResources, ...]  # every node the placement actor knew, stale ones included
    view_revisions: dict[str, int]
    view_ages: dict[str, float] = {}  # seconds since each report arrived (placement's own clock)
    ledgers: tuple[NodeLedger, ...]  # memory held on those nodes at the time
    geometry: ModelGeometry | None  # the model's header facts as read (None if unreadable)
    model_path: str | None
    unreadable_ledgers: tuple[str, ...] = ()  # nodes whose reservation ledger did not decode
    decision: PlacementDecision
    draft_geometry: ModelGeometry | None = None  # the draft model's header facts (`model.draft`), as read
    projector_geometry: ProjectorGeometry | None = None  # the projector's header facts (`model.mmproj`), as read


class DecisionRecordRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decision's complete `DecisionInputs` is stored: object `blake3` of the decisions store."""

    blake3: str  # hex digest of the stored bytes (the JSON encoding of the DecisionInputs)
    size_bytes: int


class PlacementDecided(Event, frozen=True, kw_only=True, tag="placement_decided"):
    """Everything needed to recompute a decision: the request, the view it saw, and the decision.

    With `record` set, the inputs are stored beside the journal (see `DecisionInputs`) and this event is a
    bounded summary: `view`, `view_revisions`, `view_ages` and `ledgers` are empty, `geometry` is None, the
    request names at most 64 of its nodes and the decision keeps its first 8 rejections and no view."""

    request: PlacementRequest
    view: tuple[NodeResources, ...] = ()
    view_revisions: dict[str, int] = {}
    view_ages: dict[str, float] = {}
    ledgers: tuple[NodeLedger, ...] = ()
    geometry: ModelGeometry | None = None
    model_path: str | None = None
    unreadable_ledgers: tuple[str, ...] = ()
    decision: PlacementDecision
    record: DecisionRecordRef | None = None
    draft_geometry: ModelGeometry | None = None
    projector_geometry: ProjectorGeometry | None = None


class ReservationReleased(Event, frozen=True, kw_only=True, tag="reservation_released"):
    reservation_id: str
    node_id_released: str
    # "stopped", "failed", "rejected", "refused", "expired", "node_restarted", "instance_gone", "rolled_back"
    reason: str


class ReservationObserved(Event, frozen=True, kw_only=True, tag="reservation_observed"):
    """The runner reported the instance ready: the held memory is now the observed footprint."""

    reservation_id: str
    held: dict[str, int]


# --- runner --------------------------------------------------------------------------------------------


class InstanceEvent(Event, frozen=True, kw_only=True):
    instance_id: str
    reservation_id: str


class InstanceStarting(InstanceEvent, frozen=True, kw_only=True, tag="instance_starting"):
    command: tuple[str, ...]
    port: int


class InstanceReady(InstanceEvent, frozen=True, kw_only=True, tag="instance_ready"):
    port: int
    predicted: MemoryBreakdown
    observed: ObservedMemory


class DriftRejected(InstanceEvent, frozen=True, kw_only=True, tag="drift_rejected"):
    """The instance was refused or stopped because a setting differs from its stamp."""

    stage: Literal["before_start", "after_start"]
    drift: tuple[FieldDrift, ...]


class InstanceRefused(InstanceEvent, frozen=True, kw_only=True, tag="instance_refused"):
    """Worker-side admission: the model no longer fits what the node has now."""

    need_bytes: dict[str, int]
    have_bytes: dict[str, int]
    message: str


class InstanceCrashed(InstanceEvent, frozen=True, kw_only=True, tag="instance_crashed"):
    exit_code: int | None
    restart_in_s: float | None  # None: the restart limit is reached (an instance_failed follows)
    reason: str = ""  # e.g. "llama-server was killed by SIGKILL (…)", "stopped answering /health: …"
    log_tail: str
    # its log ends in an allocation failure, or it was SIGKILLed (what the kernel's OOM killer sends)
    out_of_memory: bool = False
    member: str | None = None  # a split's member whose RPC server was lost (the cause of the crash)


class InstanceRestarted(InstanceEvent, frozen=True, kw_only=True, tag="instance_restarted"):
    attempt: int


class InstanceStopped(InstanceEvent, frozen=True, kw_only=True, tag="instance_stopped"):
    reason: str


class InstanceFailed(InstanceEvent, frozen=True, kw_only=True, tag="instance_failed"):
    reason: str


class HealthCheckFailed(InstanceEvent, frozen=True, kw_only=True, tag="health_check_failed"):
    """A ready server failed one check of its liveness: a probe (one token, nothing cached), its `/health`, or a
    real completion the server failed (5xx, a dropped connection). `consecutive` failures in a row make it a crash
    once they reach the runner's limit (an `instance_crashed` follows)."""

    check: Literal["probe", "health", "completion"]
    consecutive: int
    reason: str


class InstanceStuck(InstanceEvent, frozen=True, kw_only=True, tag="instance_stuck"):
    """The server did not go away when killed: its memory stays held, and the runner keeps killing it."""

    pid: int | None
    reason: str


# ---- generation (router) ----


class GenerateRouted(Event, frozen=True, kw_only=True, tag="generate_routed"):
    """A `mesh.generate` request was routed (or refused for want of an instance), with every input of the
    choice: `mesh-actor replay` re-decides it."""

    request_id: str
    model: str
    n_prompt: int  # prompt tokens (0: the prompt was text and no tokenization was needed to choose)
    candidates: tuple[Candidate, ...]
    weights: RouteWeights
    decision: RouteDecision
    router_version: str
    links: dict[str, float] = msgspec.field(default_factory=dict)  # "src>dst" -> handoff bytes/s (fitted)
    link_fixed_s: dict[str, float] = msgspec.field(default_factory=dict)  # "src>dst" -> seconds per handoff


class GenerateCancelled(Event, frozen=True, kw_only=True, tag="generate_cancelled"):
    """A generation stopped because its requester left (an HTTP client that disconnected, a `mesh.generate`
    client that stopped answering its stream's pings): the server's slot was freed."""

    request_id: str
    instance_id: str
    endpoint: str  # the pass-through endpoint ("" for a prompt generation)
    tokens_generated: int  # what the server had generated when it stopped
    reason: str


class QueuedWaiter(msgspec.Struct, frozen=True, kw_only=True):
    """One request waiting for a slot, as the queue saw it (`actors/runner/fairqueue.py`): who, which class, what
    share and cost, and its tags with the inputs they came from (replay recomputes both)."""

    request_id: str
    tenant: str
    priority: int
    weight: float
    cost: int
    seq: int
    virtual: float  # the class's virtual time when it arrived
    previous: float  # its tenant's last finish tag then
    start: float
    finish: float


class GenerateQueued(Event, frozen=True, kw_only=True, tag="generate_queued"):
    """A request found no slot it could take on its instance and waits: why (`reason`: slots busy, and who is
    ahead of it by class and by fair share), and its place in the queue's order."""

    instance_id: str
    waiter: QueuedWaiter
    busy_slots: int
    ahead: int  # waiters served before it as the queue stands
    ahead_higher_class: int  # of those, of a higher class
    reason: str


class GenerateDequeued(Event, frozen=True, kw_only=True, tag="generate_dequeued"):
    """A waiting request got its slot: the queue's choice among everyone waiting then (highest class, then
    earliest finish tag, then arrival), with what each of them was; `mesh-actor replay` re-decides it."""

    instance_id: str
    request_id: str
    waited_ms: float
    candidates: tuple[QueuedWaiter, ...]  # at most `MAX_CANDIDATES` recorded, the best first
    more: int = 0  # waiters not recorded (beyond `MAX_CANDIDATES`: none of them was chosen)


#: Waiters one dequeue event records (the queue's first ones: the chosen one is always the first).
MAX_CANDIDATES = 32


class GenerateCompleted(Event, frozen=True, kw_only=True, tag="generate_completed"):
    """A generation this node's runner answered (a prompt generation or a pass-through to one of the server's
    endpoints), with the figures of its result: where its prefix came from, its token counts and its timings.
    Recorded once the answer is complete; a request refused or failed before an answer is not recorded here."""

    request_id: str
    decision_id: str  # its `generate_routed` event ("" when it came without a routing decision)
    instance_id: str
    endpoint: str  # the pass-through endpoint ("" for a prompt generation)
    status: int  # the server's HTTP status (200 for a prompt generation)
    stop_reason: StopReason
    source: PrefixSource
    prompt_tokens: int
    tokens_cached: int  # reused by the server (restored ones included)
    tokens_restored: int  # restored from L3 into the slot first
    tokens_evaluated: int
    tokens_generated: int
    ttft_ms: float  # from the router's receipt to the first generated token
    total_ms: float
    path: Literal["local", "disaggregated"] = "local"
    prefill_node: str | None = None
    handoff_bytes: int = 0
    handoff_ms: float = 0.0
    prefill_fallback: str = ""  # why the prefill planned on `GenerateRequest.prefill_node` was computed here
    tenant: str = ""  # who asked (`GenerateRequest.tenant`)
    queued_ms: float = 0.0  # how long it waited for a slot (`generate_queued` says why)


# ---- the front door (models on demand) ----


class ModelLoading(Event, frozen=True, kw_only=True, tag="model_loading"):
    """A request found no ready instance of a catalog model: one is being placed and started for it."""

    model: str
    waiting: int  # requests waiting for it


class ModelLoaded(Event, frozen=True, kw_only=True, tag="model_loaded"):
    model: str
    instance_id: str
    instance_node: str
    load_ms: float


class RoomMade(Event, frozen=True, kw_only=True, tag="room_made"):
    """Instances stopped so that a model fits (least recently used, lowest priority, never pinned or in use)."""

    model: str
    stopped_on: str  # the node where room was made
    stopped: tuple[str, ...]
    frees: dict[str, int]


class ModelRefused(Event, frozen=True, kw_only=True, tag="model_refused"):
    """A model that can never fit (HTTP 507), or that could not be placed."""

    model: str
    reason: str
    need_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    have_bytes: dict[str, int] = msgspec.field(default_factory=dict)


class ScalingDecided(Event, frozen=True, kw_only=True, tag="scaling_decided"):
    """The scaler added or retired a replica of a catalog model (`actors/frontdoor/scaling.py`): what it saw
    (`scale`: every replica's load, queued work and measured rates; `memory`: its hysteresis before; `now`: its
    clock), and what it decided; `mesh-actor replay` re-decides it from these."""

    scale: ModelScale
    memory: ScaleMemory
    now: float
    decision: ScaleDecision


class ReplicaAdded(Event, frozen=True, kw_only=True, tag="replica_added"):
    """A replica the scaler decided is placed and ready (or could not be: `error`)."""

    model: str
    instance_id: str = ""
    instance_node: str = ""
    load_ms: float = 0.0
    error: str = ""
    warmed_entries: int = 0  # L3 entries of its identity fetched from peers for it (`mesh.l3.<node>.warm`)
    warmed_bytes: int = 0
    preferred: tuple[str, ...] = ()  # the nodes placement was asked to take first (their stores hold its states)


class IdleStopped(Event, frozen=True, kw_only=True, tag="idle_stopped"):
    model: str | None
    instance_id: str
    idle_s: float


class RequestUsage(Event, frozen=True, kw_only=True, tag="request_usage"):
    """One request to the front door's API, answered or refused: whose key (`tenant` and `key_id` empty for the
    admin key or an open door), which catalog model ("" when the request named none it may use), its HTTP status
    (499: the client left first), the tokens its answer reports (0 when it has none) and how long it took. What
    `mesh-actor usage` sums. Private: journaled in the usage stream, which no client reads."""

    PRIVATE: ClassVar[bool] = True  # whose requests, to what and how many tokens: not for other tenants' eyes

    tenant: str
    key_id: str
    model: str
    endpoint: str
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those the server reused
    generated_tokens: int = 0
    duration_ms: float
    refused: str = ""  # the key's limit that refused it (`rpm`, `tpm`, `max_concurrent`), "" otherwise
    # How many requests the event stands for: a front door journals the requests it refused before serving
    # them (4xx: an unknown model, a bad body, a limit) as one event per key, model, endpoint, status and limit
    # every few seconds, with their summed duration, so that a flood of refusals does not flood the journal.
    count: int = 1


# ---- L3 (the node's store of saved slot states; owned by the L3 actor) ----


class L3Captured(Event, frozen=True, kw_only=True, tag="l3_captured"):
    """A saved slot state was committed to this node's store."""

    entry: str
    identity: str
    n_tokens: int
    bytes: int
    new_bytes: int  # bytes of segments the store did not hold before (content addressing dedupes the rest)
    ingest_ms: float  # until loadable (and servable)
    durable_ms: float | None = None  # until fsynced, counted from the start; None: the flush failed (retried)


class L3CaptureDropped(Event, frozen=True, kw_only=True, tag="l3_capture_dropped"):
    """A capture was not stored (queue full, refused by the commit rules, over budget, I/O error)."""

    identity: str
    n_tokens: int
    reason: str


class L3Evicted(Event, frozen=True, kw_only=True, tag="l3_evicted"):
    """One eviction pass: the entries it removed (least recently used first) and the bytes it freed."""

    entries: tuple[str, ...]
    freed_bytes: int
    budget_bytes: int
    stored_bytes: int  # after the pass


class L3Quarantined(Event, frozen=True, kw_only=True, tag="l3_quarantined"):
    """A manifest that failed to load or verify was moved aside; its segments are kept."""

    entry: str
    reason: str


class L3Fetched(Event, frozen=True, kw_only=True, tag="l3_fetched"):
    """An entry was fetched from a peer's store and verified (bytes moved: segments this node lacked)."""

    entry: str
    peer: str
    bytes: int
    moved_bytes: int
    fetch_ms: float
    transport: str = "nats"  # the path the segments took: direct, direct_tls, nats, or several joined by `+`


class ModelFilePulled(Event, frozen=True, kw_only=True, tag="model_file_pulled"):
    """A model file was fetched from a peer into this node's models dir and verified (whole-file blake3)."""

    name: str  # the catalog model or registry entry
    path: str  # relative to the models dir
    blake3: str
    bytes: int
    peer: str
    resumed_from: int  # bytes of an interrupted pull kept (re-verified), not fetched again
    moved_bytes: int
    fetch_ms: float
    transport: str = "nats"  # the path the bytes took (`PullReply.transport`: direct, direct_tls, nats, direct+nats)
    fallback: str = ""  # why the bus carried bytes, when it did


class ModelFilePullRefused(Event, frozen=True, kw_only=True, tag="model_file_pull_refused"):
    """A pull was refused (`reason`: `transfer.TransferReason`); wrong bytes were deleted, a peer's failure left
    the part."""

    name: str
    path: str  # relative to the models dir ("" when the name named no file)
    reason: str
    detail: str
    peer: str = ""


class HandoffCommitted(Event, frozen=True, kw_only=True, tag="handoff_committed"):
    """A handoff session was verified (every segment, the tiling, the counts, the payload digest) and restored."""

    session: str
    sender_node: str
    identity: str
    n_tokens: int
    bytes: int
    segments: int
    payload_digest: str
    restored: str | None  # what the restore hook reported (e.g. an L3 entry id)
    transfer_ms: float  # open to commit
    restore_ms: float
    transport: str = "nats"  # the path the chunks took: `direct` (the data path) or `nats`


class HandoffAborted(Event, frozen=True, kw_only=True, tag="handoff_aborted"):
    """A handoff session ended without a restore (refused, stalled, or given up by either side); its staging
    was freed."""

    session: str
    peer: str  # the other node
    role: str  # sender or receiver: which side recorded it
    reason: str
    detail: str
    bytes: int  # payload bytes received (receiver) or sent (sender) before the abort


class LinkMeasured(Event, frozen=True, kw_only=True, tag="link_measured"):
    """A probe measured the handoff link from `src` to `dst` (routers learn it as a handoff result)."""

    src: str
    dst: str
    bytes_per_s: float
    fixed_s: float
    samples: tuple[tuple[int, float], ...]  # (bytes, seconds) of each probe handoff
    transport: str = "nats"  # the path the probe handoffs took (the rate is that path's): direct, direct_tls, nats


class L3EvictionBlocked(Event, frozen=True, kw_only=True, tag="l3_eviction_blocked"):
    """Quarantine holds manifests that cannot be parsed: the segments they name are unknown, so no segment may
    be freed and the store cannot shrink. Captures that do not fit the budget are dropped (`eviction_blocked`)
    until the quarantined manifests are deleted: by the store's policy once it needs the room and they have
    been kept a while (`l3_quarantine_cleared`), or at once by `mesh-actor l3 gc --quarantine`."""

    unreadable: tuple[str, ...]  # the quarantined manifests that cannot be parsed
    stored_bytes: int
    budget_bytes: int


class ReservationRebooked(Event, frozen=True, kw_only=True, tag="reservation_rebooked"):
    """A runner found an instance it runs without its reservation (released while the runner could not refresh
    its records) and booked it again; `outcome` `stopping` when it no longer fitted and is being stopped (its
    memory stays booked until the server is gone)."""

    instance_id: str
    reservation_id: str
    state: str  # the booking written: "starting" or "running"
    held: dict[str, int]  # device -> bytes booked
    outcome: Literal["rebooked", "stopping"]
    reason: str = ""


# --- split serving: a member's lending ---------------------------------------------------------------------


class LendEvent(Event, frozen=True, kw_only=True):
    reservation_id: str
    head: str  # the split's head node, whose llama-server uses this member's RPC server


class RpcLent(LendEvent, frozen=True, kw_only=True, tag="rpc_lent"):
    """A member started serving its part of a split: its RPC server on loopback, behind its tunnel exit."""

    port: int  # the tunnel exit's port
    command: tuple[str, ...]
    private_loopback: bool = False  # the RPC server's loopback is its own (no other local process reaches it)


class RpcServerExited(LendEvent, frozen=True, kw_only=True, tag="rpc_server_exited"):
    """A member's RPC server ended without being asked to: the head's instance loses its devices there."""

    exit_code: int | None
    restart_in_s: float | None  # None: the restart limit is reached (the part is given up: rpc_lend_ended)
    log_tail: str


class RpcLendEnded(LendEvent, frozen=True, kw_only=True, tag="rpc_lend_ended"):
    """A member stopped serving its part (its booking is gone, its RPC server gave up, or the runner stops)."""

    reason: str


class L3QuarantineCleared(Event, frozen=True, kw_only=True, tag="l3_quarantine_cleared"):
    """The L3 store deleted quarantined manifests by its policy, and freed the segments only they named:
    `retention` (kept their whole retention) or `space` (the store needed the room, and they had been kept
    their minimum). Why each was quarantined is its `l3_quarantined` event."""

    manifests: tuple[str, ...]  # their names in quarantine/ (at most 32: `count` says how many)
    count: int
    reason: str  # retention | space
    freed_bytes: int  # the manifests and the segments only they named
    stored_bytes: int  # after


AnyEvent = (
    ActorStarted
    | ActorCrashed
    | ActorRestarted
    | ActorGaveUp
    | ActorStopped
    | NodeStarted
    | NodeStopped
    | EventTooLarge
    | TelemetryChanged
    | PlacementDecided
    | ReservationReleased
    | ReservationObserved
    | InstanceStarting
    | InstanceReady
    | DriftRejected
    | InstanceRefused
    | InstanceCrashed
    | InstanceRestarted
    | InstanceStopped
    | InstanceFailed
    | InstanceStuck
    | HealthCheckFailed
    | GenerateRouted
    | GenerateCancelled
    | GenerateQueued
    | GenerateDequeued
    | GenerateCompleted
    | ModelLoading
    | ModelLoaded
    | RoomMade
    | ModelRefused
    | ScalingDecided
    | ReplicaAdded
    | IdleStopped
    | RequestUsage
    | L3Captured
    | L3CaptureDropped
    | L3Evicted
    | L3Quarantined
    | L3Fetched
    | ModelFilePulled
    | ModelFilePullRefused
    | HandoffCommitted
    | HandoffAborted
    | LinkMeasured
    | L3EvictionBlocked
    | ReservationRebooked
    | RpcLent
    | RpcServerExited
    | RpcLendEnded
    | L3QuarantineCleared
)
