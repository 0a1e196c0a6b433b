"""Error replies: how a failure crosses the bus, and the one registry of error codes.

Every request handler that cannot answer replies with an `ErrorReply` (and the NATS service-error headers),
so clients in any language get a stable machine-readable `code`, a human `message` and `details` (for a
schema error, the offending path).

`REGISTRY` lists every code with its meaning, whether a retry can fix it, and the HTTP status the front door
answers with; the front door, `mesh.generate` clients and `docs/api.md` all read it (as nats-server's
`errors.json` does for its errors). A 503 is only for what a retry can fix.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

import msgspec

#: Stable error codes. Clients branch on these; never rename one.
BAD_REQUEST: Final = "bad_request"  # malformed JSON or a message that does not match the schema
NOT_FOUND: Final = "not_found"
BUSY: Final = "busy"  # the actor's inbox is full; retry later
UNAVAILABLE: Final = "unavailable"  # the actor is restarting or stopping
INTERNAL: Final = "internal"  # a bug: the actor crashed while handling the request
TIMEOUT: Final = "timeout"
NO_INSTANCE: Final = "no_instance"  # no ready instance serves the model a generation names
# the front door's own
INVALID_API_KEY: Final = "invalid_api_key"
MODEL_NOT_FOUND: Final = "model_not_found"
UNKNOWN_ENDPOINT: Final = "unknown_endpoint"
REQUEST_TOO_LARGE: Final = "request_too_large"
QUEUE_FULL: Final = "queue_full"
INSUFFICIENT_MEMORY: Final = "insufficient_memory"  # the model never fits: no retry helps
NOT_PLACED: Final = "not_placed"  # placement refused the model for another reason (settings, files, nodes)
RATE_LIMITED: Final = "rate_limit_exceeded"  # a key's rpm, tpm or max_concurrent (OpenAI's code for its own limits)
# the runner's `start` (worker-side admission and the instance's checks)
SETTINGS_DRIFT: Final = "settings_drift"
TELEMETRY_STALE: Final = "telemetry_stale"
UNSUPPORTED: Final = "unsupported"
MODEL_UNREADABLE: Final = "model_unreadable"
ENGINE_UNAVAILABLE: Final = "engine_unavailable"
RESERVATION_STATE: Final = "reservation_state"
TOO_MANY_INSTANCES: Final = "too_many_instances"
DATA_DIR_UNWRITABLE: Final = "data_dir_unwritable"
LEDGER_UNREADABLE: Final = "ledger_unreadable"
MODEL_MISMATCH: Final = "model_mismatch"


class ErrorCode(NamedTuple):
    code: str
    http_status: int
    retryable: bool
    meaning: str
    where: str = "any"  # who answers with it: any endpoint, the front door, the runner's `start`, …


_START = "`mesh.runner.<node>.start`"

REGISTRY: Final[dict[str, ErrorCode]] = {
    e.code: e
    for e in (
        ErrorCode(BAD_REQUEST, 400, False, "malformed JSON or not the endpoint's schema; `details.error`, and "
                  "`details.path` (e.g. `$.ctx`) when a field is at fault; or what the request asks is refused "
                  "(a prompt its slot can never hold, several completions, too many alternatives per token)"),
        ErrorCode(NOT_FOUND, 404, False, "what the request names does not exist (the runner: no such reservation "
                  "for `start`, instance for `stop`)", "runner endpoints"),
        ErrorCode(BUSY, 429, True, "the endpoint's inbox is full (`ActorContext.add_endpoint`'s `inbox`); retry "
                  "later"),
        ErrorCode(UNAVAILABLE, 503, True, "the actor is restarting or stopping, the runner cannot read a bucket, a "
                  "model file's hash is still running, the server is away, or the ledger kept changing; retry "
                  "later"),
        ErrorCode(INTERNAL, 500, False, "the handler failed on this request (a bug; the actor keeps serving, and it "
                  "never counts toward restarts), or the reply would exceed `max_payload`"),
        ErrorCode(TIMEOUT, 504, True, "the actor did not answer within its request deadline (time in the inbox "
                  "included; the handler is cancelled)"),
        ErrorCode(NO_INSTANCE, 503, True, "`generate`: no ready instance serves the model the request names, and "
                  "none that was starting became ready within the request's `timeout_s`"),
        ErrorCode(INVALID_API_KEY, 401, False, "the front door needs a valid API key", "the front door"),
        ErrorCode(MODEL_NOT_FOUND, 404, False, "the front door's catalog has no such model", "the front door"),
        ErrorCode(UNKNOWN_ENDPOINT, 404, False, "the front door serves no such path", "the front door"),
        ErrorCode(REQUEST_TOO_LARGE, 413, False, "the body is larger than the front door or the bus accepts",
                  "the front door"),
        ErrorCode(QUEUE_FULL, 429, True, "the model's queue is full", "the front door"),
        ErrorCode(INSUFFICIENT_MEMORY, 507, False, "the model never fits on any node, even with others stopped; "
                  f"from {_START} (worker-side admission: it no longer fits), `details.need_bytes` and "
                  "`details.have_bytes` per device", "the front door, runner `start`"),
        ErrorCode(NOT_PLACED, 500, False, "placement refused the model (settings, file or nodes): see the reason",
                  "the front door"),
        ErrorCode(RATE_LIMITED, 429, True, "a key's requests or tokens per minute, or concurrent requests, ran out",
                  "the front door"),
        ErrorCode(SETTINGS_DRIFT, 409, False, "the node's serving settings or llama-server build differ from the "
                  "stamp; `details.drift` is a list of [FieldDrift](#fielddrift)", _START),
        ErrorCode(TELEMETRY_STALE, 503, True, "the node has no current telemetry to check its memory against",
                  _START),
        ErrorCode(UNSUPPORTED, 400, False, "settings llama-server would refuse for this model, or a reservation "
                  "this node cannot serve", _START),
        ErrorCode(MODEL_UNREADABLE, 500, False, "the runner cannot read the model's GGUF header", _START),
        ErrorCode(ENGINE_UNAVAILABLE, 500, False, "the node has no llama-server", _START),
        ErrorCode(RESERVATION_STATE, 409, False, "the reservation is not `reserved` (already claimed or running)",
                  _START),
        ErrorCode(TOO_MANY_INSTANCES, 503, True, "the node already runs its most instances "
                  "(`RunnerLimits.max_instances`)", _START),
        ErrorCode(DATA_DIR_UNWRITABLE, 500, False, "the instance directory in the data dir cannot be created",
                  _START),
        ErrorCode(LEDGER_UNREADABLE, 500, False, "the node's reservation ledger does not decode as a NodeLedger",
                  _START),
        ErrorCode(MODEL_MISMATCH, 409, False, "the file at the reservation's path is not the one admitted (its "
                  "blake3 differs from the signed registry entry's)", _START),
    )
}  # fmt: skip


def http_status(code: str) -> int:
    """The HTTP status of an error code (502 for a code the registry does not know: a peer's newer code; every
    code this version raises is in the registry, `tests/unit/test_error_registry.py`)."""
    known = REGISTRY.get(code)
    return known.http_status if known is not None else 502


def retryable(code: str) -> bool:
    known = REGISTRY.get(code)
    return known is not None and known.retryable


#: Header names of the NATS micro protocol for service errors; we set them too so `nats req` shows them.
ERROR_HEADER: Final = "Nats-Service-Error"
ERROR_CODE_HEADER: Final = "Nats-Service-Error-Code"
#: Our own header carrying the stable string code (Nats-Service-Error-Code is numeric by convention).
MESH_ERROR_HEADER: Final = "Mesh-Error"


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True):
    """A request that failed. `details` is free-form but small (e.g. `{"path": "$.ctx"}`)."""

    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)
