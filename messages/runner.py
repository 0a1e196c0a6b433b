"""Runner: start and stop llama-server instances on a node (`mesh.runner.<node>.start` / `.stop`).

A start names a reservation made by placement; the runner reads it from the reservations bucket, so the
stamp it pins is the one admission decided, never one the caller sends. Instance status records live in
the `MESH_INSTANCES` KV bucket (key = instance id, refreshed with a TTL while the runner lives).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec

from messages.memory import MemoryBreakdown
from messages.placement import Stamp


class StartInstance(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    reservation_id: str


class StopInstance(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    instance_id: str


class LendRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A split's head asks a member for its part (`mesh.runner.<member>.lend`): the member serves a
    `ggml-rpc-server` of its own for that reservation, reached through its tunnel exit. Idempotent: asked
    again (each start of the head's server asks), it answers with the same exit."""

    reservation_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    head: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]  # the head node (checked against the ledger)


class Lent(msgspec.Struct, frozen=True, kw_only=True):
    """Where the head's tunnel entrance dials: the member's tunnel exit (mutual TLS under the cluster CA)."""

    node_id: str
    reservation_id: str
    host: str
    port: int
    restarts: int = 0  # how often the member's RPC server for this part was restarted


#: `stuck`: SIGKILL did not reap the server in time; it may still hold its memory (not final: the runner keeps
#: killing it, and the instance ends stopped, failed or rejected once the process is gone).
InstanceState = Literal["starting", "ready", "restarting", "stopping", "stuck", "stopped", "failed", "rejected"]


class RunnerAck(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    node_id: str
    state: InstanceState
    port: int | None = None
    message: str = ""


class FieldDrift(msgspec.Struct, frozen=True, kw_only=True):
    """One setting that differs between the stamp and what the node (or the server) has now."""

    field: str
    stamped: str
    current: str


class ObservedMemory(msgspec.Struct, frozen=True, kw_only=True):
    """What llama-server reported it allocated (parsed from its log), in bytes, keyed like `fit --json`."""

    kv_bytes: int
    recurrent_bytes: int
    draft_kv_bytes: int
    weights_bytes: int
    compute_bytes: int
    output_bytes: int
    total_bytes: int
    devices: dict[str, int] = msgspec.field(default_factory=dict)  # buffer name -> bytes
    draft_weights_bytes: int = 0  # the draft model's buffers (`--model-draft`); weights_bytes is the model's
    projector_weights_bytes: int = 0  # the multimodal projector's tensors (`--mmproj`)
    # What the server allocates only later, counted at its prediction (in total_bytes, not in devices): the
    # projector's compute buffer, reserved at the first image since the server starts without a warm-up.
    pending_bytes: int = 0


#: The most of a server's own `/v1/models` entry an instance record carries.
MAX_MODEL_INFO_BYTES: Final = 16 << 10


class InstanceStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The runner's view of one instance (value of its key in the instances bucket)."""

    id: str
    node: str
    reservation_id: str
    state: InstanceState
    port: int | None
    model_path: str
    settings: Stamp
    predicted_memory: MemoryBreakdown
    observed_memory: ObservedMemory | None = None
    restarts: int = 0
    pid: int | None = None
    message: str = ""
    updated_at: float = 0.0
    members: tuple[str, ...] = ()  # a split instance's members (the nodes lending it memory), in --rpc order
    # The server's own `/v1/models` entry of the model (its `meta`: n_ctx, n_vocab, n_ctx_train, …, and its
    # `architecture`'s modalities), as it answered once ready, at most `MAX_MODEL_INFO_BYTES`: the front door's
    # `/v1/models` passes them through.
    model_info: dict[str, Any] | None = None
