"""Error replies: how a failure crosses the bus.

Every request handler that cannot answer replies with an `ErrorReply` (and the NATS service-error headers),
so clients in any language get a stable machine-readable `code`, a human `message` and `details` (for a
schema error, the offending path).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

#: Stable error codes. Clients branch on these; never rename one.
BAD_REQUEST: Final = "bad_request"  # malformed JSON or a message that does not match the schema
NOT_FOUND: Final = "not_found"
BUSY: Final = "busy"  # the actor's inbox is full; retry later
UNAVAILABLE: Final = "unavailable"  # the actor is restarting or stopping
INTERNAL: Final = "internal"  # a bug: the actor crashed while handling the request
TIMEOUT: Final = "timeout"
NO_INSTANCE: Final = "no_instance"  # no ready instance serves the model a generation names

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
