"""Pass-through requests (runner core, pure): what the mesh does around a client's own body, and nothing more.

Rules this module keeps:

* An endpoint is of one of three kinds. `generate` (chat, completions, responses, messages) decodes a prompt in
  a slot: the prompt is rendered and tokenized by the instance itself, routed by prefix, restored from L3, its
  slot pinned, its state captured. `count` (responses/input_tokens, messages/count_tokens) renders only: it
  is forwarded as it came. `pooled` (embeddings, rerank) runs no decode the mesh can reuse: forwarded as it
  came, no slot pinned, nothing captured.
* The forwarded body is the client's own; the mesh sets only `id_slot` (the slot it chose and restored into)
  and `cache_prompt` (true unless the client said otherwise; false where no cached prompt may be reused:
  `slots.Grant.reuse`). Every other field (tools, grammars, schemas, samplers, `n`, logprobs, stream options,
  reasoning fields) reaches the server unchanged.
* A body is rendered the way the server renders it for that endpoint: a chat through its `/apply-template`
  (same body: tools and template arguments count), a Messages or Responses body likewise once converted to the
  chat body the server converts it to (`chat_shapes`), a completion's single text through `/tokenize` with the
  specials the server adds, token ids as given. Anything else (several prompts, a body the server refuses) is
  not rendered: it is routed by load and decoded cold, which costs time, never correctness (the server itself
  reuses only what a slot's tokens share with the prompt it renders).
* Server-sent events are relayed whole: `SseCutter` cuts a byte stream only after an event's blank line.
* What an answer says of its tokens (`usage`, `timings`) is read for the journal and the result, never changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeGuard

import msgspec

from actors.runner import chat_shapes
from messages.generate import GENERATING_ENDPOINTS, StopReason

__all__ = [
    "AnswerTokens",
    "AskLimits",
    "EndpointKind",
    "Given",
    "PromptText",
    "SseCutter",
    "Template",
    "answer_stop",
    "answer_tokens",
    "decode_body",
    "endpoint_kind",
    "forward_body",
    "generation_bound",
    "has_media",
    "prompt_sizes",
    "refused_asks",
    "render_plan",
    "slot_decoded",
    "sse_data",
    "streamed",
]

EndpointKind = Literal["generate", "count", "pooled"]
_KINDS: Final[dict[str, EndpointKind]] = {
    "responses_input_tokens": "count", "count_tokens": "count", "chat_input_tokens": "count", "tokenize": "count",
    "detokenize": "count", "apply_template": "count",
}  # fmt: skip


def endpoint_kind(endpoint: str) -> EndpointKind:
    if endpoint in GENERATING_ENDPOINTS:
        return "generate"
    return _KINDS.get(endpoint, "pooled")


@dataclass(frozen=True)
class Template:
    """Render `body` with the instance's `/apply-template`, then tokenize the prompt. `body` is a chat body: the
    client's own, or the one the server converts a Messages or Responses body to."""

    body: Mapping[str, Any]


@dataclass(frozen=True)
class PromptText:
    """Tokenize `text` as the server tokenizes a completion's prompt (specials added and parsed)."""

    text: str


@dataclass(frozen=True)
class Given:
    """The prompt is these token ids."""

    tokens: tuple[int, ...]


def decode_body(data: bytes) -> dict[str, Any]:
    """A client's body as a JSON object; ValueError saying what is wrong with it otherwise (not JSON, not an
    object, nested deeper than a decoder's recursion allows)."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"the body is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise ValueError("the body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise ValueError("the body is a JSON object")
    return body


#: Endpoints whose bodies the server converts to a chat body before rendering (their token counts too).
_CHAT_SHAPES: Final = {
    "messages": chat_shapes.anthropic_to_chat,
    "count_tokens": chat_shapes.anthropic_to_chat,
    "responses": chat_shapes.responses_to_chat,
    "responses_input_tokens": chat_shapes.responses_to_chat,
}


def render_plan(endpoint: str, body: Mapping[str, Any]) -> Template | PromptText | Given | None:
    """How the instance renders this body's prompt, or None when it has no single prompt the mesh can render."""
    if endpoint in _CHAT_SHAPES:
        try:
            body = _CHAT_SHAPES[endpoint](body)
        except chat_shapes.ShapeError:
            return None  # the server refuses it too, and says why
        endpoint = "chat"
    if endpoint == "chat":
        return Template(body) if isinstance(body.get("messages"), list) and body["messages"] else None
    if endpoint not in ("completions", "completion"):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list: the server runs it as one
    if isinstance(prompt, str) and prompt:
        return PromptText(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 1 << 31 for t in prompt):
        return Given(tuple(prompt))
    return None


def streamed(body: Mapping[str, Any]) -> bool:
    return body.get("stream") is True


#: The fields that bound a generation, in the order llama-server reads them (`n_predict`, else its aliases
#: `max_completion_tokens`, then `max_tokens`); the Responses shape's `max_output_tokens` is converted to
#: `max_tokens` first, and Anthropic's Messages take `max_tokens` alone (4096 when absent).
_GENERATION_BOUNDS: Final = ("n_predict", "max_completion_tokens", "max_tokens")
_MESSAGES_DEFAULT_MAX_TOKENS: Final = 4096


def generation_bound(endpoint: str, body: Mapping[str, Any]) -> int | None:
    """The most tokens the server will generate for this body, read as the server reads it (the queue's cost
    and the bound the request is charged by are the one the engine obeys); None when it is unbounded (-1, or no
    bound: until the context ends)."""
    if endpoint in ("messages", "count_tokens"):
        value: Any = body.get("max_tokens", _MESSAGES_DEFAULT_MAX_TOKENS)
    else:
        fields = dict(body)
        if endpoint in ("responses", "responses_input_tokens") and "max_output_tokens" in fields:
            fields["max_tokens"] = fields["max_output_tokens"]
        value = next((fields[f] for f in _GENERATION_BOUNDS if fields.get(f) is not None), None)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


@dataclass(frozen=True)
class AskLimits:
    """What one request may ask of an instance beyond its prompt: the answer's size grows with these, and the
    mesh books (and charges) one slot per request."""

    max_top_logprobs: int = 20  # OpenAI's own bound on `top_logprobs`; llama-server's `n_probs` has none


#: The fields that ask for several completions (llama-server's `n_cmpl`, and its alias `n`).
_CHOICES: Final = ("n_cmpl", "n")
#: The fields that ask for each token's most likely alternatives (`logprobs` is an alias of `n_probs` when it
#: is a number; a boolean `logprobs` is OpenAI's chat switch, whose count is `top_logprobs`, 20 by default).
_ALTERNATIVES: Final = ("n_probs", "top_logprobs", "logprobs")


def refused_asks(endpoint: str, body: Mapping[str, Any], limits: AskLimits) -> str | None:
    """Why the body asks more than one request may (a client error naming the field), or None. Checked on the
    raw body before any work: a 79-byte body asking 32,000 alternatives per token makes a server answer 62 MB."""
    if endpoint_kind(endpoint) != "generate":
        return None
    prompt = body.get("prompt")
    if (
        endpoint in ("completions", "completion")
        and isinstance(prompt, list)
        and len(prompt) > 1
        and not all(type(t) is int for t in prompt)
    ):
        return f"{len(prompt)} prompts: the mesh serves one prompt per request (it books one slot); send each alone"
    for field in _CHOICES:
        value = body.get(field)
        if _number(value) and value != 1:
            return (f"`{field}` = {value}: the mesh serves one completion per request (it books and charges one "
                    "slot); send several requests instead")  # fmt: skip
    for field in _ALTERNATIVES:
        value = body.get(field)
        if _number(value) and float(value) > limits.max_top_logprobs:
            return f"`{field}` = {value}: at most {limits.max_top_logprobs} alternatives per token"
    return None


#: The fields a generation's or a count's prompt is rendered from (its messages, system text, tools, input).
_PROMPT_FIELDS: Final = (
    "messages", "prompt", "input", "system", "instructions", "tools", "content", "input_prefix", "input_suffix",
    "input_extra",
)  # fmt: skip
#: The most inputs one embeddings or rerank request may carry (OpenAI's bound on an embeddings `input`).
MAX_POOLED_INPUTS: Final = 2048


def prompt_sizes(endpoint: str, body: Mapping[str, Any]) -> list[int]:
    """Upper bounds, in UTF-8 bytes, of each prompt the server would tokenize for this body: one for a
    generation or a count (every text its prompt is rendered from), one per input of an embeddings request,
    the query with each document of a rerank. Checked against the slot's context before the server tokenizes
    anything (`slots.oversize`); ValueError past `MAX_POOLED_INPUTS` inputs."""
    if endpoint_kind(endpoint) != "pooled":
        return [sum(_text_bytes(body.get(field)) for field in _PROMPT_FIELDS)]
    if endpoint == "rerank":
        documents = body.get("documents", body.get("texts"))
        items = documents if isinstance(documents, list) else [documents]
        query = _text_bytes(body.get("query"))
        sizes = [query + _text_bytes(d) for d in items]
    else:
        given = body.get("input", body.get("content"))
        items = given if isinstance(given, list) and not all(type(t) is int for t in given) else [given]
        sizes = [_text_bytes(item) for item in items]
    if len(sizes) > MAX_POOLED_INPUTS:
        raise ValueError(f"{len(sizes)} inputs: at most {MAX_POOLED_INPUTS} in one request")
    return sizes


def _text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string in `value` (token ids count 1 byte each: a lower bound of their text)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", errors="surrogatepass"))
        elif isinstance(item, int) and not isinstance(item, bool):
            total += 1
        elif isinstance(item, dict) and item.get("type") not in _MEDIA_PARTS:  # media is not tokenized as text
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


#: Content parts that are not text, in OpenAI's chat, Anthropic's and the Responses shapes.
_MEDIA_PARTS: Final = frozenset({"image_url", "input_audio", "file", "image", "document", "input_image", "input_file"})


def has_media(endpoint: str, body: Mapping[str, Any]) -> bool:
    """Whether the prompt holds media (images, audio, files): its state is then not captured (a slot state
    holding media cannot be indexed by token ids alone)."""
    if endpoint not in ("chat", "responses", "messages", "completions"):
        return False
    stack: list[Any] = [body.get("messages"), body.get("input"), body.get("prompt")]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("type") in _MEDIA_PARTS or "multimodal_data" in item:
                return True
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))
    return False


def _slot(slots: Any, slot: int) -> dict[str, Any]:
    for entry in slots if isinstance(slots, list) else []:
        if isinstance(entry, dict) and entry.get("id") == slot:
            return entry
    return {}


def slot_decoded(slots: Any, slot: int) -> int:
    """How many tokens slot `slot` decoded in its last task, from llama-server's `/slots` (0: not said)."""
    next_tokens = _slot(slots, slot).get("next_token")
    if isinstance(next_tokens, list) and next_tokens and isinstance(next_tokens[0], dict):
        return _int(next_tokens[0].get("n_decoded"))
    return 0


def forward_body(body: Mapping[str, Any], slot: int | None, reuse: bool = True) -> dict[str, Any]:
    """The body to forward: the client's, with the slot the mesh chose (None: the server chooses). `reuse`
    false: the server may reuse no cached prompt for it (`slots.Grant.reuse`), whatever the client asked."""
    out = dict(body)
    out.pop("id_slot", None)  # the mesh owns the slots: a client's pin would bypass restore and accounting
    if slot is not None:
        out["id_slot"] = slot
        out.setdefault("cache_prompt", True)
    if not reuse:
        out["cache_prompt"] = False
    return out


class SseCutter:
    """Cuts a server-sent event stream into runs of whole events (each run ends with an event's blank line)."""

    def __init__(self, max_pending: int) -> None:
        self._pending = bytearray()
        self._max_pending = max_pending

    def feed(self, data: bytes) -> bytes:
        """The whole events completed by `data` (possibly none: b""). Raises ValueError past `max_pending`."""
        self._pending += data
        normalized = self._pending.replace(b"\r\n", b"\n")
        end = normalized.rfind(b"\n\n")
        if end < 0:
            if len(self._pending) > self._max_pending:
                raise ValueError(f"a server-sent event over {self._max_pending} bytes")
            return b""
        whole, rest = bytes(normalized[: end + 2]), normalized[end + 2 :]
        self._pending = bytearray(rest)
        return whole

    def rest(self) -> bytes:
        """What is left when the stream ends (a last event without its blank line)."""
        rest, self._pending = bytes(self._pending), bytearray()
        return rest


def sse_data(events: bytes) -> list[str]:
    """The `data:` payloads of whole events (one per event; multi-line data joined by newlines)."""
    payloads = []
    for event in events.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            payloads.append(b"\n".join(lines).decode("utf-8", errors="replace"))
    return payloads


@dataclass(frozen=True)
class AnswerTokens:
    """What an answer says of its tokens (0 where it says nothing)."""

    prompt: int = 0
    cached: int = 0  # prompt tokens the server reused (its cache, a restored state)
    evaluated: int = 0  # prompt tokens it computed
    generated: int = 0


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0


def answer_tokens(answers: Sequence[Any]) -> AnswerTokens:
    """The token counts of an answer (the whole JSON, or every event's JSON of a stream): llama-server's
    `timings` where present, else the `usage` of OpenAI's, Anthropic's or the Responses shape."""
    prompt = cached = evaluated = generated = 0
    for answer in answers:
        if not isinstance(answer, dict):
            continue
        for holder in (answer, answer.get("response"), answer.get("message")):
            if not isinstance(holder, dict):
                continue
            timings = holder.get("timings")
            if isinstance(timings, dict):
                cached = _int(timings.get("cache_n")) or cached
                evaluated = _int(timings.get("prompt_n")) or evaluated
                generated = _int(timings.get("predicted_n")) or generated
            usage = holder.get("usage")
            if isinstance(usage, dict):
                generated = _int(usage.get("completion_tokens")) or _int(usage.get("output_tokens")) or generated
                details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
                if isinstance(details, dict):
                    cached = _int(details.get("cached_tokens")) or cached
                if "cache_read_input_tokens" in usage:  # Anthropic's: input_tokens are the ones not read from cache
                    cached = _int(usage.get("cache_read_input_tokens")) or cached
                    prompt = (_int(usage.get("input_tokens")) + cached) or prompt
                else:
                    prompt = _int(usage.get("prompt_tokens")) or _int(usage.get("input_tokens")) or prompt
    if prompt == 0 and (cached or evaluated):
        prompt = cached + evaluated
    return AnswerTokens(prompt=prompt, cached=cached, evaluated=evaluated, generated=generated)


#: Why generation stopped, as each API says it (and llama-server's own `stop_type`), as a `StopReason`.
_STOPS: Final[dict[str, StopReason]] = {
    "length": "limit", "max_tokens": "limit", "max_output_tokens": "limit", "limit": "limit",
    "stop": "eos", "end_turn": "eos", "eos": "eos", "tool_calls": "eos", "tool_use": "eos",
    "stop_sequence": "stop_word", "word": "stop_word",
}  # fmt: skip


def answer_stop(answers: Sequence[Any]) -> StopReason:
    """Why an answer's generation stopped, by its last word on it (the whole JSON, or a stream's counted events):
    OpenAI's `finish_reason`, Anthropic's `stop_reason`, the Responses shape's `incomplete_details.reason`, or
    llama-server's `stop_type`; `eos` when it says nothing."""
    stop: StopReason = "eos"
    for answer in answers:
        if not isinstance(answer, dict):
            continue
        said: list[Any] = [c.get("finish_reason") for c in answer.get("choices") or () if isinstance(c, dict)]
        for holder in (answer, answer.get("delta"), answer.get("message"), answer.get("response")):
            if isinstance(holder, dict):
                said += [holder.get("stop_reason"), holder.get("stop_type")]
                details = holder.get("incomplete_details")
                if isinstance(details, dict):
                    said.append(details.get("reason"))
        for reason in said:
            if isinstance(reason, str) and reason in _STOPS:
                stop = _STOPS[reason]
    return stop
