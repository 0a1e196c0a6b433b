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


class ErrorCode(NamedTuple):
    code: str
    http_status: int
    retryable: bool
    meaning: str


REGISTRY: Final[dict[str, ErrorCode]] = {
    e.code: e
    for e in (
        ErrorCode(BAD_REQUEST, 400, False, "the request is malformed or does not match the schema"),
        ErrorCode(NOT_FOUND, 404, False, "what the request names does not exist"),
        ErrorCode(BUSY, 429, True, "the actor's inbox is full"),
        ErrorCode(UNAVAILABLE, 503, True, "the actor, the runner or the server is restarting, stopping or away"),
        ErrorCode(INTERNAL, 500, False, "a bug: the actor failed while handling the request"),
        ErrorCode(TIMEOUT, 504, True, "the request's deadline passed before it was done"),
        ErrorCode(NO_INSTANCE, 503, True, "no ready instance serves the model (one may be starting)"),
        ErrorCode(INVALID_API_KEY, 401, False, "the front door needs a valid API key"),
        ErrorCode(MODEL_NOT_FOUND, 404, False, "the front door's catalog has no such model"),
        ErrorCode(UNKNOWN_ENDPOINT, 404, False, "the front door serves no such path"),
        ErrorCode(REQUEST_TOO_LARGE, 413, False, "the body is larger than the front door or the bus accepts"),
        ErrorCode(QUEUE_FULL, 429, True, "the model's queue is full"),
        ErrorCode(INSUFFICIENT_MEMORY, 507, False, "the model never fits on any node, even with others stopped"),
        ErrorCode(NOT_PLACED, 500, False, "placement refused the model (settings, file or nodes): see the reason"),
        ErrorCode(RATE_LIMITED, 429, True, "a key's requests or tokens per minute, or concurrent requests, ran out"),
    )
}


def http_status(code: str) -> int:
    """The HTTP status of an error code (502 for a code the registry does not know: a peer's newer code)."""
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
