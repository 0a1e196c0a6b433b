"""The HTTP surface of the front door (front-door core, pure): its paths, keys, error shapes, and the one change
made to a relayed answer.

Rules this module keeps:

* Every llama-server endpoint the front door serves is named once (`ENDPOINTS`: HTTP path -> the mesh's name).
  Bodies are the client's own; the only fields read here are `model` (which catalog model) and `stream`.
* Errors have the endpoint's shape: Anthropic's (`{"type": "error", "error": {"type", "message"}}`) on the
  Messages endpoints, OpenAI's (`{"error": {"message", "type", "param", "code"}}`) everywhere else. The mesh's
  own errors take their HTTP status and retryability from `messages.errors.REGISTRY`; a server's error answer
  keeps its status and fields (only its shape changes on the Messages endpoints). Headers tell SDKs whether a
  retry can help (`x-should-retry`, and `Retry-After` on a retryable one), so a refusal no retry can fix is
  sent once.
* A relayed answer changes in one way: the model the server names (its file) becomes the catalog name the
  client asked for, in the answer and in every streamed event (`message.model` and `response.model` too).
* Keys: `Authorization: Bearer <key>` (the scheme in any case) or `x-api-key: <key>`, compared in constant time.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from typing import Any, Final, Literal

from messages.errors import http_status, retryable

__all__ = [
    "ENDPOINTS",
    "NOT_PASSED",
    "ApiError",
    "ModelRenamer",
    "Shape",
    "error_body",
    "error_headers",
    "key_matches",
    "presented_key",
    "rename_events",
    "rename_json",
    "server_error_body",
    "shape_of",
]

Shape = Literal["openai", "anthropic"]

#: HTTP path -> the mesh's name of the llama-server endpoint it forwards to (`messages.generate.API_PATHS`).
ENDPOINTS: Final[dict[str, str]] = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/responses": "responses",
    "/v1/responses/input_tokens": "responses_input_tokens",
    "/responses/input_tokens": "responses_input_tokens",
    "/v1/chat/completions/input_tokens": "chat_input_tokens",
    "/chat/completions/input_tokens": "chat_input_tokens",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/reranking": "rerank",
    "/rerank": "rerank",
    "/reranking": "rerank",
    # llama-server's own shapes
    "/completion": "completion",
    "/completions": "completion",
    "/infill": "infill",
    "/embedding": "embedding",
    "/embeddings": "embedding",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/apply-template": "apply_template",
}
#: llama-server's paths the front door does not serve, and why (`tests/e2e/test_passthrough.py` lists the pinned
#: build's routes: each is in `ENDPOINTS` or here).
NOT_PASSED: Final[dict[str, str]] = {
    "/health": "the mesh's health is its own (`mesh-actor status`)",
    "/v1/health": "the mesh's health is its own (`mesh-actor status`)",
    "/metrics": "the front door's own `/metrics` (with every instance's figures)",
    "/props": "an instance's settings are the mesh's (the stamp); POST would change them",
    "/models": "the front door's catalog is `/v1/models`",
    "/v1/models": "the front door's catalog (served, not passed)",
    "/slots": "the mesh owns the slots (saves, restores, pins)",
    "/slots/:id_slot": "the mesh owns the slots (saves, restores, pins)",
    "/lora-adapters": "adapters would change an instance under every tenant",
    "/v1/chat/completions/control": "acts on one running completion of one instance: not routable by model",
    "/v1/systemone": "a decision model's endpoint: no catalog kind serves it",
    "/v1/audio/transcriptions": "multipart audio: no catalog kind serves it",
    "/audio/transcriptions": "multipart audio: no catalog kind serves it",
    "/v1/stream": "resumable streams are one instance's sessions: not routable by model",
}
_ANTHROPIC_ENDPOINTS: Final = frozenset({"messages", "count_tokens"})


def shape_of(path: str) -> Shape:
    return "anthropic" if ENDPOINTS.get(path) in _ANTHROPIC_ENDPOINTS else "openai"


class ApiError(Exception):
    """One of the mesh's own errors for an HTTP client: a registry code, a message, the offending field."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        extra: Mapping[str, Any] | None = None,
        retry_after_s: int = 1,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.status = http_status(code)
        self.param = param
        self.extra = dict(extra or {})
        self.retry_after_s = retry_after_s  # the Retry-After of a retryable code


def _openai_type(status: int) -> str:
    return {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )


def _anthropic_type(status: int) -> str:
    types = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
             429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
    return types.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(error: ApiError, shape: Shape) -> dict[str, Any]:
    if shape == "anthropic":
        return {"type": "error", "error": {"type": _anthropic_type(error.status), "message": str(error)}}
    return {"error": {"message": str(error), "type": _openai_type(error.status), "param": error.param,
                      "code": error.code, **error.extra}}  # fmt: skip


def error_headers(code: str, retry_after_s: int = 1) -> dict[str, str]:
    if retryable(code):
        return {"x-should-retry": "true", "Retry-After": str(retry_after_s)}
    return {"x-should-retry": "false"}


def server_error_body(status: int, body: bytes, shape: Shape) -> bytes:
    """A server's error answer for the client: unchanged in OpenAI's shape; in Anthropic's, its message and
    fields carried into that shape."""
    if shape != "anthropic":
        return body
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(parsed, dict) and parsed.get("type") != "error":
        fields = {k: v for k, v in error.items() if k not in ("type", "message", "code")}
        out = {"type": "error", "error": {"type": _anthropic_type(status), "message": str(error.get("message", "")),
                                          **fields}}  # fmt: skip
        return json.dumps(out, ensure_ascii=False).encode()
    return body


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: a Bearer token (any case of the scheme) or `x-api-key`."""
    authorization = headers.get("Authorization", "")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


def key_matches(presented: str | None, key: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), key.encode())


def _rename(value: Any, name: str) -> bool:
    changed = False
    if isinstance(value, dict):
        if isinstance(value.get("model"), str):
            value["model"] = name
            changed = True
        for inner in ("message", "response"):  # Anthropic's message_start, the Responses events
            held = value.get(inner)
            if isinstance(held, dict) and isinstance(held.get("model"), str):
                held["model"] = name
                changed = True
    return changed


def rename_json(body: bytes, name: str) -> bytes:
    """A whole JSON answer with the catalog name as its model (unchanged when it names none, or is not JSON)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if not _rename(parsed, name):
        return body
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()


def rename_events(events: bytes, name: str) -> bytes:
    """Whole server-sent events with the catalog name as their model (other lines as they came)."""
    out = []
    for line in events.split(b"\n"):
        if line.startswith(b"data:") and b'"model"' in line:
            payload = line[5:].lstrip(b" ")
            renamed = rename_json(payload, name)
            if renamed is not payload:
                line = b"data: " + renamed
        out.append(line)
    return b"\n".join(out)


class ModelRenamer:
    """Renames the model in a stream's events, parsing JSON only until it has seen the name the server writes:
    from then on the server's own `"model":"NAME"` bytes are replaced as they are (llama-server writes compact
    JSON), which keeps a streamed token's relay free of JSON work. An event naming the model some other way
    is parsed as before."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._to = json.dumps({"model": name}, ensure_ascii=False, separators=(",", ":"))[1:-1].encode()
        self._from: bytes | None = None

    def events(self, data: bytes) -> bytes:
        if b'"model"' not in data:
            return data
        if self._from is not None and self._from in data:
            replaced = data.replace(self._from, self._to)
            if replaced.count(b'"model"') == replaced.count(self._to):
                return replaced
        self._learn(data)
        return rename_events(data, self._name)

    def _learn(self, data: bytes) -> None:
        for line in data.split(b"\n"):
            if line.startswith(b"data:") and b'"model"' in line:
                try:
                    parsed = json.loads(line[5:])
                except ValueError:
                    continue
                model = parsed.get("model") if isinstance(parsed, dict) else None
                if isinstance(model, str):
                    self._from = json.dumps({"model": model}, ensure_ascii=False, separators=(",", ":"))[1:-1].encode()
                    return
