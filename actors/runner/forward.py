"""Pass-through generations (runner shell): a client's own body to the instance's own endpoint, relayed back.

For a `RunnerGenerate` whose request carries `api` (an endpoint and the client's JSON body), the runner:

1. for a `generate` endpoint, takes the prompt's tokens the router sent or renders them on the instance
   (`passthrough.render_plan`: `/apply-template` and `/tokenize`, as the server itself would), acquires the
   free slot holding the longest prefix, and follows the serving plan on it (`captures.SlotRun`, as the mesh's
   own generations do): a longer prefix restored from L3, and on a model that cannot roll back, a prompt long
   enough to keep prefilled and captured one token short before the answer;
2. forwards the body with that slot pinned (`passthrough.forward_body`) to the endpoint, and relays the
   server's status, content type and body (whole, or its server-sent events as they come) to the request's
   `stream` subject, while checking that the requester still listens: when it does not, the connection to the
   server is closed (the server stops at once), the slot freed and `generate_cancelled` journaled with what was
   generated;
3. after a completed answer, as the plan says and off the reply's path: saves the whole slot and captures it
   into L3 under the tokens its state file lists (`state_file.state_tokens`), then on a model that can roll
   back cuts the slot back to the prompt less a token (one token evaluated) and captures that; the slot is
   given back holding what the plan knows it holds.

`count` and `pooled` endpoints (token counts, embeddings, rerank) are forwarded and relayed as they came.
Any HTTP answer, error statuses included, is the server's answer and is relayed as it is; only a server that
does not answer is the runner's error (`unavailable`, and evidence for health by inference). What the answer
means (completed or not, why it stopped, what a requester that left is charged) is `serving_rules`'. What this
path needs of the serving shell is `served.ServingShell`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from actors.runner import passthrough
from actors.runner import serving_rules as rules
from actors.runner.captures import SlotRun
from actors.runner.fairqueue import claim_of
from actors.runner.renders import Rendered, render_key
from actors.runner.served import ServedInstance, ServingShell, refuse_oversize, server_failed
from actors.runner.server_api import MAX_EVENT_BYTES, MAX_JSON_BYTES, ServerApiError
from actors.runner.stream import ChunkStream, ClientGone
from messages.errors import BAD_REQUEST
from messages.events import GenerateCancelled
from messages.generate import API_PATHS, GenerateResult, RunnerGenerate
from messages.l3 import PrefixSource
from runtime.actor import RequestError
from runtime.logging import get_logger

__all__ = ["Forwarder"]

_log = get_logger(component="forward")
#: How much of a relayed stream's JSON the runner parses for its token counts: only events that carry them.
_COUNTED: Final = (b'"usage"', b'"timings"')
#: A whole answer larger than this is parsed for its counts in a worker thread, not on the event loop.
_PARSE_ON_LOOP_BYTES: Final = 256 << 10


@dataclass
class _Exchange:
    status: int = 0
    answers: list[Any] | None = None  # the JSON the token counts are read from (the body, or counted events)
    cancelled: str = ""  # why the requester was found gone ("" when it was not)
    decoded: int = 0  # what the server had generated when the requester was found gone
    first_data: float | None = None
    sent: float = 0.0  # when the request went to the server
    whole: bool = False  # the answer came whole (not as server-sent events)


class Forwarder:
    """The pass-through path of one runner incarnation's serving shell."""

    def __init__(self, shell: ServingShell) -> None:
        self._shell = shell

    async def render(
        self, instance: ServedInstance, endpoint: str, body: dict[str, Any], key: bytes | None = None
    ) -> list[int] | None:
        """The prompt's tokens as the instance renders and tokenizes this body, or None (not renderable, or the
        server refused to render it: the forwarded request then gets the server's own answer). A prompt text its
        slot could never hold is refused here (`bad_request`), before the server spends time tokenizing it.
        `key`: the body's in the instance's render memo (`renders.render_key`), which answers a body sent again
        unchanged; None: the memo is not used."""
        plan = passthrough.render_plan(endpoint, body)
        if plan is None:
            return None
        if isinstance(plan, passthrough.Given):
            return list(plan.tokens)
        known = instance.renders.get(key, time.monotonic()) if key is not None else None
        if known is not None:
            refuse_oversize(instance.context, text_bytes=known.text_bytes)  # as when it was rendered
            return list(known.tokens)
        shell = self._shell
        timeout = shell.limits.tokenize_timeout_s
        try:
            text = plan.text if isinstance(plan, passthrough.PromptText) else await self._template(instance, plan)
            if text is None:
                return None
            size = len(text.encode("utf-8", errors="surrogatepass"))
            refuse_oversize(instance.context, text_bytes=size)
            tokens = await shell.api.tokenize(instance.port, text, timeout_s=timeout)
        except ServerApiError as exc:
            _log.info("render_refused", instance_id=instance.id, endpoint=endpoint, error=str(exc))
            return None
        if key is not None:
            instance.renders.put(key, Rendered(tuple(tokens), size), time.monotonic())
        return tokens

    async def _template(self, instance: ServedInstance, plan: passthrough.Template) -> str | None:
        """The prompt text the server's `/apply-template` renders from a chat body (None: it rendered none)."""
        timeout = self._shell.limits.tokenize_timeout_s
        reply = await self._shell.api.json(instance.port, "POST", "/apply-template", plan.body, timeout_s=timeout)
        prompt = reply.get("prompt") if isinstance(reply, dict) else None
        return prompt if isinstance(prompt, str) and prompt else None

    async def forward(self, instance: ServedInstance, order: RunnerGenerate, started: float) -> GenerateResult:
        shell = self._shell
        request = order.request
        call = request.api
        assert call is not None and request.stream is not None  # a pass-through names both (GenerateRequest)
        raw = bytes(call.body)
        try:
            body = passthrough.decode_body(raw)
        except ValueError as exc:
            raise RequestError(BAD_REQUEST, str(exc)) from exc
        _refuse_asks(instance, call.endpoint, body, shell.limits.asks)
        relay = ChunkStream(shell.bus, request.stream, order.request_id, shell.limits.stream_silence_s)
        path = API_PATHS[call.endpoint]
        if passthrough.endpoint_kind(call.endpoint) != "generate":
            exchange = await self._exchange(instance, path, body, relay, order, slot=None)
            return self._result(instance, order, started, exchange, relay, slot=-1)
        if order.tokens:  # the router's
            tokens: list[int] | None = list(order.tokens)
        else:  # the memo's only for this request's own cache scope (`renders`)
            tokens = await self.render(
                instance, call.endpoint, body, render_key(request.cache_scope, call.endpoint, raw)
            )
        if tokens is None:  # not rendered here: the server will, so its texts are bounded first
            _refuse_oversize_sizes(instance, call.endpoint, body)
        claim = claim_of(request, len(tokens or ()), passthrough.generation_bound(call.endpoint, body))
        grant = await shell.acquire(instance, tokens or (), claim, order.request_id, request.cache_scope)
        capture = request.capture and not passthrough.has_media(call.endpoint, body)
        with SlotRun(
            shell, instance, grant, tokens, capture=capture, request_id=order.request_id, scope=request.cache_scope
        ) as run:
            source, _ = await run.before_answer()
            exchange = await self._exchange(
                instance, path, passthrough.forward_body(body, grant.slot, grant.reuse), relay, order, slot=grant.slot
            )  # fmt: skip
            counts = passthrough.answer_tokens(exchange.answers or [])
            run.answered(
                completed=rules.relay_completed(exchange.status, cancelled=bool(exchange.cancelled)),
                prompt_counted=counts.prompt, generated=counts.generated,
            )  # fmt: skip
            return self._result(instance, order, started, exchange, relay, slot=grant.slot, source=source,
                                restored=run.plan.restored_tokens, capture=run.plan.capture_note,
                                prompt_tokens=len(tokens or ()))  # fmt: skip

    async def _exchange(
        self,
        instance: ServedInstance,
        path: str,
        body: dict[str, Any],
        relay: ChunkStream,
        order: RunnerGenerate,
        *,
        slot: int | None,
    ) -> _Exchange:
        """The request to the server, its answer relayed, while the requester is watched."""
        shell = self._shell
        exchange = _Exchange()
        data = msgspec.json.encode(body)  # what `decode_body` decoded; on a 90 kB body 0.04 ms, json.dumps 0.29

        async def relay_answer() -> None:
            exchange.sent = time.perf_counter()
            async with shell.api.exchange(
                instance.port, path, data, connect_timeout_s=shell.limits.tokenize_timeout_s,
                idle_timeout_s=shell.limits.idle_timeout_s,
            ) as response:  # fmt: skip
                exchange.status = response.status
                await relay.head(response.status, response.headers.get("Content-Type", "application/json"))
                if response.content_type == "text/event-stream":
                    exchange.answers = await self._relay_events(response.content, relay, exchange)
                else:
                    whole = await _read(response.content, MAX_JSON_BYTES, path)
                    exchange.first_data, exchange.whole = time.perf_counter(), True
                    await relay.data(whole)
                    # read for its token counts; a large answer off the event loop (other slots' relays go on)
                    large = len(whole) > _PARSE_ON_LOOP_BYTES
                    exchange.answers = [await asyncio.to_thread(_json, whole) if large else _json(whole)]

        async def gone(why: ClientGone) -> None:
            exchange.cancelled = str(why)
            exchange.decoded = await self._decoded(instance, slot)  # before the connection closes

        try:
            await relay.watched(relay_answer(), gone)
        except* ClientGone:
            self._cancelled(instance, order, exchange)
        except* ServerApiError as group:
            error = group.exceptions[0]  # a status said: relayed, then broken off
            raise server_failed(shell.outcome, instance, error, exchange.status) from error
        shell.outcome(instance.id, True, "")
        return exchange

    async def _relay_events(self, content: Any, relay: ChunkStream, exchange: _Exchange) -> list[Any]:
        cutter = passthrough.SseCutter(MAX_EVENT_BYTES)
        counted: list[Any] = []
        async for piece in content.iter_any():
            try:
                whole = cutter.feed(piece)
            except ValueError as exc:
                raise ServerApiError(str(exc)) from exc
            if whole:
                if exchange.first_data is None:
                    exchange.first_data = time.perf_counter()
                await relay.data(whole)
                if any(marker in whole for marker in _COUNTED):
                    counted += [_json(p.encode()) for p in passthrough.sse_data(whole)]
        rest = cutter.rest()
        if rest:
            await relay.data(rest)
        return counted[-4:]  # the last events carry the totals

    async def _decoded(self, instance: ServedInstance, slot: int | None) -> int:
        """How many tokens the pinned slot has generated so far (0: none pinned, or not said).

        Read while the request's connection is still open: llama-server notices a closed connection of a whole
        (not streamed) answer only once it has waited a second for results without being woken by another
        result (its `recv_with_timeout` starts the wait again on every result of any task), and it forgets the
        count when it releases the slot. A request of ours after the close would restart that wait."""
        if slot is None:
            return 0
        try:
            slots = await self._shell.api.json(instance.port, "GET", "/slots", None, timeout_s=2)
        except ServerApiError as exc:
            _log.info("cancel_count_unknown", instance_id=instance.id, error=str(exc))
            return 0
        return passthrough.slot_decoded(slots, slot)

    def _cancelled(self, instance: ServedInstance, order: RunnerGenerate, exchange: _Exchange) -> None:
        """The requester left and the connection to the server closed (the server stops): journaled with what it
        had generated."""
        counts = passthrough.answer_tokens(exchange.answers or [])
        generated = rules.relay_charge(counts, cancelled=True, prompt_tokens=0, decoded=exchange.decoded).generated
        _log.info("generate_cancelled", request_id=order.request_id, instance_id=instance.id, reason=exchange.cancelled)
        self._shell.emit(
            GenerateCancelled, request_id=order.request_id, instance_id=instance.id,
            endpoint=order.request.api.endpoint if order.request.api else "", tokens_generated=generated,
            reason=exchange.cancelled,
        )  # fmt: skip

    def _result(
        self,
        instance: ServedInstance,
        order: RunnerGenerate,
        started: float,
        exchange: _Exchange,
        relay: ChunkStream,
        *,
        slot: int,
        source: PrefixSource = "cold",
        restored: int = 0,
        capture: str = "off",
        prompt_tokens: int = 0,
    ) -> GenerateResult:
        """The result of an exchange. A requester that left is charged what the server did all the same: the
        prompt as rendered here (when the answer never said) and the tokens the slot had decoded."""
        counts = rules.relay_charge(
            passthrough.answer_tokens(exchange.answers or []), cancelled=bool(exchange.cancelled),
            prompt_tokens=prompt_tokens, decoded=exchange.decoded,
        )  # fmt: skip
        now = time.perf_counter()
        timings = next((a.get("timings") for a in reversed(exchange.answers or []) if isinstance(a, dict)
                        and isinstance(a.get("timings"), dict)), None)  # fmt: skip
        if timings is not None and counts.evaluated >= 32:
            self._shell.measured(instance, timings)
        first = exchange.first_data
        if exchange.whole and timings is not None and counts.generated:  # the server's clock: prompt, then a token
            first = exchange.sent + rules.first_token_s(timings)
        return GenerateResult(
            request_id=order.request_id,
            text="",
            tokens=[],
            prompt_tokens=counts.prompt,
            source=source,
            tokens_restored=restored,
            tokens_cached=counts.cached,
            tokens_evaluated=counts.evaluated,
            ttft_ms=order.routed_ms + ((first or now) - started) * 1000,
            total_ms=order.routed_ms + (now - started) * 1000,
            node=self._shell.node_id,
            instance=instance.id,
            slot=slot,
            stop_reason=rules.relay_stop(exchange.answers or [], cancelled=bool(exchange.cancelled)),
            tokens_exact=False,
            tokens_generated=counts.generated,
            decision_id=order.route.decision_id if order.route else "",
            capture=capture,
            status=exchange.status,
            relayed=relay.seq,
        )


def _refuse_asks(instance: ServedInstance, endpoint: str, body: dict[str, Any], limits: passthrough.AskLimits) -> None:
    """What a body may not ask of an instance (several completions, too many alternatives per token, prompts
    its slot can never hold) is a client error before the server does any work."""
    refused = passthrough.refused_asks(endpoint, body, limits)
    if refused is not None:
        raise RequestError(BAD_REQUEST, refused)
    if passthrough.endpoint_kind(endpoint) != "generate":
        _refuse_oversize_sizes(instance, endpoint, body)


def _refuse_oversize_sizes(instance: ServedInstance, endpoint: str, body: dict[str, Any]) -> None:
    try:
        sizes = passthrough.prompt_sizes(endpoint, body)
    except ValueError as exc:
        raise RequestError(BAD_REQUEST, str(exc)) from exc
    for size in sizes:
        refuse_oversize(instance.context, text_bytes=size)


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


async def _read(content: Any, max_bytes: int, path: str) -> bytes:
    data = bytearray()
    while chunk := await content.read(max_bytes + 1 - len(data)):
        data += chunk
        if len(data) > max_bytes:
            raise ServerApiError(f"POST {path}: a reply over the limit of {max_bytes} bytes")
    return bytes(data)
