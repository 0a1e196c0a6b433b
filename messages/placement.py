"""Placement: where a model fits, with which settings, and the memory held for it.

`mesh.placement.request` takes a `PlacementRequest` and answers a `PlacementDecision` (admitted or not; an
admitted decision holds a reservation). `mesh.placement.fit` takes the same request and answers the same
decision without reserving anything. The minimal request is `{"model": {"path": "/models/x.gguf"},
"ctx": 8192}`. Reservations live in the `MESH_RESERVATIONS` KV bucket, one key per node (`node.<id>`)
holding every reservation on that node, updated with revision compare-and-set.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from messages.memory import DeviceMemory, MemoryBreakdown
from messages.settings import CacheType, Pooling, ServingKind, ServingSettings

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
#: A node id as a request names it: one subject token (what `messages.subjects.check_token` accepts).
NodeId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
#: A registry entry name: a KV key (dot-separated tokens of `-/_=` and alphanumerics, no empty token).
RegistryName = Annotated[str, msgspec.Meta(max_length=255, pattern=r"^[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*$")]
#: A client's correlation id, echoed in the decision: bounded so that a decision always fits a reply.
RequestId = Annotated[str, msgspec.Meta(max_length=256)]
#: The most nodes one request may name (a decision lists a refusal for each one it did not choose).
MAX_REQUEST_NODES = 1024

#: Machine-readable reasons a node (or the whole request) was refused.
RejectReason = Literal[
    "insufficient_memory",  # need > have on some device; see shortfalls
    "settings_unknown",  # the node has not advertised serving settings (no llama-server)
    "settings_mismatch",  # the node's advertised settings differ from what the client requires
    "telemetry_stale",  # the node's last report is older than its TTL
    "not_found",  # a requested node is not in the cluster view
    "model_unreadable",  # the GGUF file cannot be read or is malformed
    "unsupported_architecture",
    "unsupported_settings",  # llama-server would refuse these settings for this model
    "registry_untrusted",  # a registry entry is unsigned, tampered with or not bound to the file
    "no_nodes",  # no node is eligible at all
    "reservation_conflict",  # another placement took the memory first, repeatedly
    "ledger_unreadable",  # the node's reservation ledger does not decode: nothing is booked there
    "multi_node_unsupported",  # no longer given (split serving is admitted); kept so old journals decode
    "hold_too_long",  # hold_s is over the placement node's maximum (`--max-hold`)
    "over_client_share",  # the requesting client would hold more of the node than its share (`--client-share`)
]


#: A file name as a request gives it (a model's companion): bounded like a path the node will resolve.
CompanionPath = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class ModelRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model: a GGUF path readable by the placement actor, or a signed registry entry (by name).

    Companions are files llama-server loads beside the model, named like `path` (relative: in the node's
    models dir; absolute: in one of its model directories): `draft`, a draft model for `spec_type =
    "draft-simple"` (`--model-draft`), which must share the model's vocabulary; `mmproj`, a multimodal
    projector (`--mmproj`). Admission sizes both from their own headers."""

    path: str | None = None
    registry: RegistryName | None = None
    draft: CompanionPath | None = None
    mmproj: CompanionPath | None = None


class PreferredSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-model settings the client asks for, in place of a node's advertised defaults. A node accepts them
    within the bounds it advertises (`SettingsBounds`); outside them it is refused with `settings_mismatch`,
    naming the fields and the bound. The instance runs with exactly the resulting settings (the stamp)."""

    slots: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    kv_unified: bool | None = None
    cache_type_k: CacheType | None = None
    cache_type_v: CacheType | None = None
    flash_attn: Literal["on", "off"] | None = None
    spec_type: str | None = None
    spec_draft_n_max: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    swa_full: bool | None = None
    spec_draft_type_k: CacheType | None = None
    spec_draft_type_v: CacheType | None = None
    # An embedding or rerank server's batch holds a whole input (the per-slot context).
    kind: ServingKind | None = None  # what the server is for; None: the header's (a pooling type, rank: rerank)
    pooling: Pooling | None = None  # how an embedding or rerank model pools; None: its header's (else mean)

    def met_by(self, settings: ServingSettings) -> bool:
        """Whether a server running with `settings` runs every setting named here (None: any)."""
        return all(
            getattr(self, name) is None or getattr(self, name) == getattr(settings, name)
            for name in self.__struct_fields__
        )


class PlacementRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: ModelRef
    ctx: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] | None = None  # -c; omit with max_ctx
    max_ctx: bool = False  # admit the largest context that fits (ctx, if given, is the minimum)
    nodes: Annotated[tuple[NodeId, ...], msgspec.Meta(max_length=MAX_REQUEST_NODES)] = ()  # only these (default: any)
    settings: PreferredSettings | None = None
    n_gpu_layers: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -ngl; -1 = all layers on GPUs when there are GPUs
    allow_multi_node: bool = False  # split over nodes (llama.cpp RPC) when no node holds the model alone
    # Among the nodes that fit and hold the model's file alike (none has to fetch it, or all do), these first,
    # in this order (the replica scaler names the nodes whose L3 stores hold the model's hottest prefixes).
    prefer: Annotated[tuple[NodeId, ...], msgspec.Meta(max_length=MAX_REQUEST_NODES)] = ()
    # A reservation no runner claimed within this many seconds (on each placement actor's own clock, from when
    # it first saw the reservation) expires; a claimed one is held while its instance lives. Each placement node
    # refuses a hold over its own maximum (`hold_too_long`; `--max-hold`, default 3600 s).
    hold_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 600.0
    request_id: RequestId | None = None  # the client's own correlation id, echoed in the decision
    # Without `explain` a decision names what it chose (its placements, and their revisions in `view`), or,
    # refused, lists the refusals of at most `LISTED_REFUSALS` nodes, those short of memory by the least first:
    # a bounded reply at any fleet size.
    explain: bool = False  # list every node's refusal (`rejections`) and telemetry revision (`view`)


#: Refusals a refused decision lists when the request did not ask for every one (`explain`).
LISTED_REFUSALS = 16


class Companion(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A file the server loads beside its model, as admitted: its name and the blake3 of the file admission
    read. The runner starts only that file (another digest is `model_mismatch`)."""

    path: str
    digest: str | None = None


class RpcMember(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A node lending memory to a split instance: its `ggml-rpc-server` is one RPC device of the head's
    llama-server (`--rpc`), allocating in that node's `device` (its host memory, "CPU": the server runs with
    `-d CPU`). `layers`: the [first, last) blocks it holds; `last` equal to the model's block count means it
    holds the output layer too."""

    node_id: NodeId
    device: Literal["CPU"] = "CPU"
    layers: tuple[int, int]


class Stamp(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Exactly how the instance must run: the runner pins every field on llama-server's command line.

    A split instance (`rpc` not empty) runs on its head node with `--rpc` naming each member's RPC server in
    `rpc` order, `-ngl n_gpu_layers` and `-ts gpu_split` (one weight per RPC device, in the same order, then
    one per GPU of the head): llama.cpp then puts exactly the blocks each member's `layers` names on it and
    keeps the first blocks, the token embeddings, the logits and the compute of its own part on the head."""

    settings: ServingSettings
    ctx: NonNegative  # -c as passed to llama-server (total cells over all streams)
    n_gpu_layers: int  # -ngl as passed (0 on a node without GPUs)
    gpu_split: tuple[float, ...] = ()  # --tensor-split: one weight per GPU (after one per RPC member, if any)
    llama_server_version: str | None = None  # the node's engine build at admission
    draft: Companion | None = None  # --model-draft (with -ngld as -ngl), sized from its own header
    mmproj: Companion | None = None  # --mmproj, sized from its own header
    rpc: tuple[RpcMember, ...] = ()  # a split's members in --rpc order (empty: the model runs on one node)


class DeviceShortfall(msgspec.Struct, frozen=True, kw_only=True):
    device: str
    need_bytes: NonNegative
    have_bytes: NonNegative


class NodeRejection(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    reason: RejectReason
    message: str
    shortfalls: tuple[DeviceShortfall, ...] = ()
    fields: tuple[str, ...] = ()  # for settings_mismatch: the differing fields


class NodePlacement(msgspec.Struct, frozen=True, kw_only=True):
    """One node's share of an admitted model. In a split the head comes first (its host and GPUs), then each
    member, whose breakdown names the device its RPC server allocates in ("CPU": its host memory)."""

    node_id: str
    layers: tuple[int, int]  # [first, last) blocks on this node
    breakdown: MemoryBreakdown  # this node's devices, with its budget and fit
    telemetry_revision: NonNegative  # the nodes-bucket revision the decision used
    # Bytes of the model's file this node fetches from a peer before it starts (0: it holds the file; None:
    # unknown, no node reports holding it). Part of its time to ready: placement prefers a node with 0.
    fetch_bytes: NonNegative | None = None
    # The fetch's expected seconds at this node's last measured pull rate (None: no fetch, or no pull measured).
    fetch_s: float | None = None


class PlacementDecision(msgspec.Struct, frozen=True, kw_only=True):
    decision_id: str
    admitted: bool
    dry_run: bool  # true for mesh.placement.fit: nothing reserved
    model: ModelRef
    architecture: str | None = None
    model_digest: str | None = None  # blake3 of the file when known (registry entries always)
    ctx: NonNegative | None = None  # the admitted context (-c)
    context_ceiling: NonNegative | None = None  # the largest context that would fit the chosen node(s)
    stamp: Stamp | None = None
    placements: tuple[NodePlacement, ...] = ()
    multi_node: bool = False
    reservation_id: str | None = None
    reason: RejectReason | None = None  # overall reason when not admitted
    message: str = ""
    rejections: tuple[NodeRejection, ...] = ()  # why each other node was not chosen (all: `explain`; see there)
    view: dict[str, int] = msgspec.field(default_factory=dict)  # node -> telemetry revision (all: `explain`)
    estimator_version: str = ""
    decided_at: float = 0.0
    request_id: str | None = None


#: reserved: booked, no instance yet (expires after its hold); starting: claimed by the node's runner for one
#: instance (compare-and-set), held until that instance is ready or ends; running: the instance is ready.
ReservationState = Literal["reserved", "starting", "running"]

#: Key of a node's ledger in the reservations bucket: `node.<node_id>`.
LEDGER_KEY_PREFIX = "node."


class SplitPart(msgspec.Struct, frozen=True, kw_only=True):
    """Which split a reservation belongs to: every node of it holds a reservation with the same id in its own
    ledger, booked together (all or none). The head's part follows the instance (claimed by the head's runner);
    each member's part is held while the head's part is, and is running once it is."""

    head: str
    members: tuple[str, ...]  # in --rpc order


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """Memory held on one node for one admitted instance (or one node's share of a multi-node one)."""

    reservation_id: str
    decision_id: str
    node_id: str
    state: ReservationState
    model_path: str  # the GGUF file the runner starts
    model_digest: str | None = None
    stamp: Stamp
    layers: tuple[int, int]
    devices: tuple[DeviceMemory, ...]  # predicted per device (what is held while reserved)
    held: dict[str, int]  # device -> bytes held now (predicted, then observed once running)
    multi_node: bool = False
    created_at: float  # the booking placement actor's clock (informational)
    # `created_at + hold_s` on the booking actor's clock, for people (expiry is measured by each placement
    # actor on its own clock, never by comparing this with another host's time); None once running.
    expires_at: float | None = None
    hold_s: float | None = None  # how long it is held unclaimed (None in ledgers written before it was kept)
    # When its instance became ready, on the node's own clock: the node's reports sent later see the memory.
    running_since: float | None = None
    node_started_at: float | None = None  # the node process that runs it (its telemetry's started_at)
    instance_id: str | None = None  # set by the runner's claim (state starting): the instance that uses it
    # The client user it was booked for (a request from the clients' account, named by nats-server), which
    # its share counts; None for the mesh's own requests (the front door, an admin).
    requester: str | None = None
    split: SplitPart | None = None  # set on every part of a split instance's booking (multi_node too)


class NodeLedger(msgspec.Struct, frozen=True, kw_only=True):
    """The value of key `node.<id>` in the reservations bucket: everything held on that node."""

    node_id: str
    reservations: tuple[Reservation, ...] = ()
