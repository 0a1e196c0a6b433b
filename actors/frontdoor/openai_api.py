"""OpenAI's HTTP shapes and how they map onto `mesh.generate` (front-door core, pure).

Rules this module keeps:

* Requests are decoded leniently where OpenAI clients send fields we do not use (`user`, `logprobs: null`,
  `stream_options`, …: ignored), strictly where a value changes the answer: `n` other than 1, a prompt that
  is neither text nor token ids, a negative `max_tokens`, an unknown `role`: each is a 400 naming the field.
* Sampling not given is llama-server's default, as its own OpenAI endpoints apply it (temperature 0.8,
  top_k 40, top_p 0.95, min_p 0.05), so a client sees the same behaviour through the front door as from the
  server directly; `max_tokens` is 16 for completions, as in OpenAI's API; `seed` and `stop` pass through.
* `finish_reason`: `stop` for an end-of-sequence token or a stop word, `length` for the token limit.
* `usage` counts prompt and completion tokens, and `prompt_tokens_details.cached_tokens`: the prompt tokens
  not evaluated (restored from L3 or resident in the slot).
* Errors have OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from messages.generate import GenerateRequest, GenerateResult, Sampling

__all__ = [
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "chat_chunk",
    "chat_completion",
    "completion",
    "completion_chunk",
    "error_body",
    "to_generate",
    "usage",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class ApiError(Exception):
    """An error for the HTTP client, in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *, param: str | None = None,
                 code: str | None = None, extra: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.type = type_
        self.param = param
        self.code = code
        self.extra = extra or {}


def error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": str(error), "type": error.type, "param": error.param, "code": error.code,
                      **error.extra}}  # fmt: skip


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)] | None = None
    stop: str | list[Annotated[str, msgspec.Meta(min_length=1)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[str | Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]]  # text, [text], or token ids
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = 16


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content parts of type {part.type!r} are not supported", param="messages")
            parts.append(part.text)
        return "".join(parts)


class ChatRequest(_Common, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=4096)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None


def decode(body: bytes, kind: type[CompletionRequest] | type[ChatRequest]) -> Any:
    """A request body, or a 400 that names the offending field."""
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("`$.", 1)[-1].rstrip("`").split("[")[0] if "`$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from exc
    if request.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    return request


def chat_messages(request: ChatRequest) -> list[dict[str, str]]:
    """The messages as llama-server's chat template takes them."""
    return [{"role": m.role, "content": m.text()} for m in request.messages]


def to_generate(
    request: CompletionRequest | ChatRequest, prompt: str | list[int], *, timeout_s: float, request_id: str
) -> GenerateRequest:
    if isinstance(request, ChatRequest):
        max_tokens = request.max_completion_tokens or request.max_tokens or 4096
    else:
        max_tokens = request.max_tokens or 16
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > 16:
        raise ApiError(400, "at most 16 stop sequences", param="stop")
    defaults = Sampling()  # llama-server's own, as its /v1 endpoints apply them
    sampling = Sampling(
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        seed=request.seed,
        stop=tuple(stop),
    )
    return GenerateRequest(
        model=request.model,
        prompt=prompt,
        n_predict=max_tokens,
        sampling=sampling,
        timeout_s=timeout_s,
        request_id=request_id,
    )


def finish_reason(result: GenerateResult) -> str:
    return "length" if result.stop_reason == "limit" else "stop"


def usage(result: GenerateResult) -> dict[str, Any]:
    cached = max(0, result.prompt_tokens - result.tokens_evaluated)
    generated = max(result.tokens_generated, len(result.tokens))
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": result.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion(result: GenerateResult, *, model: str, created: int) -> dict[str, Any]:
    return {
        "id": f"cmpl-{result.request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": result.text, "index": 0, "logprobs": None, "finish_reason": finish_reason(result)}],
        "usage": usage(result),
    }


def chat_completion(result: GenerateResult, *, model: str, created: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{result.request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": finish_reason(result),
            }
        ],
        "usage": usage(result),
    }


def completion_chunk(
    request_id: str, *, model: str, created: int, text: str, finish: str | None, usage_: dict[str, Any] | None = None
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": []
        if usage_ is not None
        else [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(
    request_id: str,
    *,
    model: str,
    created: int,
    delta: dict[str, str],
    finish: str | None,
    usage_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if usage_ is not None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk
