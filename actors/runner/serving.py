"""Generations on the runner's servers (runner shell): slots, L3 restore and capture, streaming.

`mesh.runner.<node>.generate` takes the router's `RunnerGenerate`. For the instance it names (ready, on this
node) the runner:

1. tokenizes the prompt on that server (`/tokenize`, specials added as `/completion` would) unless the router
   already did;
2. takes the free slot holding the longest prefix of those tokens (`slots.SlotTable`; requests queue in
   arrival order when every slot is busy, up to the request's deadline);
3. follows the serving plan on the slot (`captures.SlotRun`, which walks the pure `plan.ServingPlan` for the
   pass-through too): when the node's L3 holds a longer prefix than the slot (at most one token short of the
   prompt: the server must compute the last position's logits), writes it into the instance's
   `--slot-save-path` and restores it into the slot (`/slots/{id}?action=restore`); on a model that cannot
   roll its state back, a prompt long enough to keep is first prefilled one token short and captured;
4. runs `/completion` with `id_slot` and `cache_prompt`, streamed from the server; with a client `stream`
   subject, publishes each piece as a `GenerateChunk` (unless the client asked for none) and checks every
   `STREAM_PING_S` that someone still listens (no responders: the generation stops and the slot is freed);
5. answers, then, off the reply's path and holding the slot, saves its state (prompt and generated tokens: the
   next turn of a conversation extends it) into L3 and, on a model that can roll back, cuts it back to the
   prompt less a token (one token evaluated) and captures that too: the same prompt again then evaluates one
   token, on every model kind.

A server error is the request's error, never the runner's; the slot's contents are then unknown (it holds
nothing), and the slot is freed whatever happens. What the route, a failure and an answer mean is decided in
`serving_rules` (pure). `Serving` is the shell the request paths are handed: the instance record, the limits
and the faces of this shell that `captures` and `forward` use live in `served`, so neither imports this module.
"""

from __future__ import annotations

import asyncio
import platform
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from actors.handoff import cost
from actors.handoff.api import HandoffAccess, HandoffFailed
from actors.l3.api import L3Access, L3Hit, L3Unavailable
from actors.l3.identity import DraftSettings, Platform, StateInputs, exact_state_identity, scoped_identity
from actors.router.prefixes import resident_prefixes
from actors.runner import captures, passthrough
from actors.runner import serving_rules as rules
from actors.runner.fairqueue import Claim, Waiter, claim_of
from actors.runner.forward import Forwarder
from actors.runner.served import ServedInstance, ServingLimits, refuse_oversize, server_failed
from actors.runner.server_api import ServerApi, ServerApiError, sampling_body
from actors.runner.slots import ANYONE, Grant, PromptLimit
from actors.runner.state_file import PAYLOAD_KIND, SaveFailed, remove_file
from actors.runner.stream import ChunkStream, ClientGone
from messages.errors import BAD_REQUEST, NOT_FOUND, TIMEOUT, UNAVAILABLE
from messages.events import (
    MAX_CANDIDATES,
    GenerateCancelled,
    GenerateCompleted,
    GenerateDequeued,
    GenerateQueued,
    QueuedWaiter,
)
from messages.generate import (
    ApiCall,
    GenerateResult,
    InstanceLoad,
    Prefill,
    PrefillResult,
    RunnerGenerate,
    ServingReport,
)
from messages.memory import ContextShape
from messages.placement import Reservation
from messages.subjects import Subjects
from runtime import tracing
from runtime.actor import RequestError
from runtime.bus import Bus, BusError, RemoteError, RequestTimeout
from runtime.logging import get_logger

__all__ = ["Serving", "ServingLimits", "state_identity"]

_log = get_logger(component="serving")
_DEFAULT_LIMITS: Final = ServingLimits()


def state_identity(
    reservation: Reservation,
    model_digest: str,
    engine_version: str | None,
    *,
    context: ContextShape,
    sliding_window: bool,
) -> str:
    """The exact-state identity of the slot states an instance of `reservation` saves. `context` is the
    context llama.cpp builds from the stamp (the prediction the runner verified against /props and the log
    before the instance was ready); `sliding_window`: the model has sliding-window layers, so a full or
    window-sized SWA cache shapes the state."""
    s = reservation.stamp.settings
    draft = None
    if s.spec_type != "none":
        draft = DraftSettings(
            spec_type=s.spec_type,
            draft_depth=s.spec_draft_n_max,
            cache_type_k=s.spec_draft_type_k,
            cache_type_v=s.spec_draft_type_v,
        )
    inputs = StateInputs(
        model_digest=model_digest,
        llama_build=engine_version,
        cache_type_k=s.cache_type_k,
        cache_type_v=s.cache_type_v,
        flash_attention=s.flash_attn == "on",
        unified_kv=s.kv_unified,
        n_ctx_seq=context.n_ctx_seq,
        n_stream=context.n_stream,
        swa_full=s.swa_full if sliding_window else None,
        draft=draft,
        payload_kind=PAYLOAD_KIND,
        platform=Platform(machine=platform.machine(), byte_order="little" if sys.byteorder == "little" else "big"),
        split=split_layout(reservation),
    )
    return exact_state_identity(inputs)


def split_layout(reservation: Reservation) -> str | None:
    """A split instance's layer layout, the head's blocks first (`0-4,4-8`); None when it runs on one node."""
    members = reservation.stamp.rpc
    if not members:
        return None
    return ",".join(f"{first}-{last}" for first, last in (reservation.layers, *(m.layers for m in members)))


@dataclass
class _Completion:
    """What a completion on the slot gave: the server's last answer (its counts, stop and timings), the generated
    token ids and text, when its first token came (None: not known here), and whether the requester left."""

    final: dict[str, Any] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    first: float | None = None
    cancelled: bool = False


class Serving:
    """The generations of one runner incarnation: the shell the request paths are handed (`served.ServingShell`)."""

    def __init__(
        self,
        node_id: str,
        bus: Bus,
        api: ServerApi,
        l3: L3Access | None,
        spawn: Callable[[Any, str], asyncio.Task[None]],
        limits: ServingLimits = _DEFAULT_LIMITS,
        handoff: HandoffAccess | None = None,
        subjects: Subjects | None = None,
        on_outcome: Callable[[str, bool, str], None] | None = None,
        emit: Callable[..., Any] | None = None,
    ) -> None:
        self.node_id = node_id
        self.bus = bus
        self.api = api
        self.l3 = l3
        self._handoff = handoff
        self._subjects = subjects or Subjects()
        self.outcome = on_outcome or (lambda instance_id, ok, why: None)  # health by inference
        self.emit = emit or (lambda event_class, **fields: None)  # a journal event from the runner
        self._forwarder = Forwarder(self)
        self.spawn = spawn
        self.limits = limits
        self._instances: dict[str, ServedInstance] = {}
        self._active = 0
        self._waited_ms: dict[str, float] = {}  # request id -> its wait for a slot, until its completion event
        self.changed = asyncio.Event()  # set on every load change: the report goes out soon after
        self._seq = 0

    # --- the instances ---------------------------------------------------------------------------------

    def set_prompt_limit(self, instance_id: str, limit: PromptLimit) -> None:
        instance = self._instances.get(instance_id)
        if instance is not None:
            instance.context = limit

    def set_state_size(self, instance_id: str, size: cost.StateSize) -> None:
        instance = self._instances.get(instance_id)
        if instance is not None:
            instance.state = size

    def measured(self, instance: ServedInstance, timings: dict[str, Any]) -> None:
        """A completion's prefill and decode rates, once it computed enough tokens to say (smoothed)."""
        if int(timings.get("prompt_n", 0) or 0) >= 32:
            instance.prefill_rate = cost.observe(instance.prefill_rate, float(timings.get("prompt_per_second", 0)))
            self.changed.set()
        if int(timings.get("predicted_n", 0) or 0) >= 8:
            rate = float(timings.get("predicted_per_second", 0) or 0)
            if rate > 0:
                instance.decode_rate = cost.observe(instance.decode_rate, rate)
                self.changed.set()

    def sync(self, ready: dict[str, tuple[int, int, Path, object, bool, bool]]) -> None:
        """The ready instances now: id -> (port, slots, slot dir, generation, rollback, prompt cache). A new
        generation (a restarted server) starts with empty slots; instances no longer ready are forgotten once
        idle."""
        for iid, (port, slots, slot_dir, generation, rollback, prompt_cache) in ready.items():
            known = self._instances.get(iid)
            if known is None or known.generation != generation or known.port != port:
                identity = known.identity if known is not None else None
                fresh = ServedInstance(iid, port, slots, slot_dir, generation, rollback, prompt_cache)
                fresh.identity = identity
                if known is not None:
                    fresh.prefill_rate, fresh.decode_rate, fresh.state = (
                        known.prefill_rate,
                        known.decode_rate,
                        known.state,
                    )
                if known is not None:  # running generations keep their own object; new ones get fresh slots
                    fresh.table = known.table
                    fresh.table.forget()
                    fresh.wakeups = known.wakeups
                self._instances[iid] = fresh
                self.changed.set()
        for iid in [i for i in self._instances if i not in ready]:
            if self._instances[iid].table.busy == 0 and self._instances[iid].table.queued == 0:
                del self._instances[iid]
                self.changed.set()

    def set_identity(self, instance_id: str, identity: str) -> None:
        instance = self._instances.get(instance_id)
        if instance is not None and instance.identity != identity:
            instance.identity = identity
            self.changed.set()

    def identity_of(self, instance_id: str) -> str | None:
        instance = self._instances.get(instance_id)
        return instance.identity if instance is not None else None

    def report(self) -> ServingReport:
        self._seq += 1
        loads = []
        for inst in self._instances.values():
            resident = resident_prefixes(inst.identity, inst.table.holdings()) if inst.identity else ()
            waiting = [w.claim for _, w in inst.table.waiters()]
            loads.append(
                InstanceLoad(
                    instance_id=inst.id,
                    slots=inst.table.n_slots,
                    busy=inst.table.busy,
                    queued=inst.table.queued,
                    identity=inst.identity,
                    resident=resident,
                    prefill_tokens_per_s=inst.prefill_rate.value if inst.prefill_rate else 0.0,
                    decode_tokens_per_s=inst.decode_rate.value if inst.decode_rate else 0.0,
                    queued_prompt_tokens=sum(c.prompt_tokens for c in waiting),
                    queued_generation_tokens=sum(c.cost - c.prompt_tokens for c in waiting),
                    state_bytes_per_token=inst.state.bytes_per_token,
                    state_floor_bytes=inst.state.floor_bytes,
                    kv_tokens=sum(len(held) for held in inst.table.holdings()),
                )
            )
        return ServingReport(
            node_id=self.node_id, seq=self._seq, ttl_s=self.limits.report_ttl_s, instances=tuple(loads)
        )

    # --- requests --------------------------------------------------------------------------------------------

    async def tokenize(self, instance_id: str, text: str) -> list[int]:
        instance = self.instance(instance_id)
        refuse_oversize(instance.context, text=text)  # before the server spends a second on it
        try:
            return await self.api.tokenize(instance.port, text, timeout_s=self.limits.tokenize_timeout_s)
        except ServerApiError as exc:
            raise RequestError(UNAVAILABLE, f"instance {instance_id}: {exc}") from exc

    async def render(self, instance_id: str, call: ApiCall) -> list[int]:
        """A pass-through body's prompt tokens as the instance renders them (none when it has no single prompt).
        Asked by the router, which does not say the request's cache scope: never from the render memo."""
        instance = self.instance(instance_id)
        try:
            body = passthrough.decode_body(bytes(call.body))
        except ValueError as exc:
            raise RequestError(BAD_REQUEST, str(exc)) from exc
        return await self._forwarder.render(instance, call.endpoint, body) or []

    def busy(self, instance_id: str) -> bool:
        """Whether a generation runs on the instance or waits for one of its slots."""
        instance = self._instances.get(instance_id)
        return instance is not None and (instance.table.busy > 0 or instance.table.queued > 0)

    def instance(self, instance_id: str) -> ServedInstance:
        instance = self._instances.get(instance_id)
        if instance is None:
            raise RequestError(
                NOT_FOUND, f"no ready instance {instance_id!r} on node {self.node_id}", {"instance_id": instance_id}
            )
        return instance

    async def generate(self, order: RunnerGenerate) -> GenerateResult:
        """The order run on its instance: the generation hop of the request's trace (the GenAI call to the
        engine), with what restores, captures and hands off for it as hops inside."""
        request = order.request
        endpoint = request.api.endpoint if request.api is not None else None
        operation = tracing.operation(endpoint)
        with tracing.hop(f"{operation} {tracing.model_name(request.model)}", kind="client") as span:
            if span.recording:
                span.update(tracing.request_attributes(endpoint, request.model))
                span.update({"mesh.node": self.node_id, "mesh.request_id": order.request_id,
                             "mesh.instance": order.instance_id, "server.address": "127.0.0.1"})  # fmt: skip
                if request.api is None:
                    span.update({"gen_ai.request.max_tokens": request.n_predict,
                                 "gen_ai.request.temperature": request.sampling.temperature})  # fmt: skip
            result = await self._generate_traced(order)
            if span.recording:
                span.update(tracing.result_attributes(result))
                span.update({"mesh.slot": result.slot, "http.response.status_code": result.status})
            return result

    async def _generate_traced(self, order: RunnerGenerate) -> GenerateResult:
        started = time.perf_counter()
        request = order.request
        instance = self.instance(order.instance_id)
        if self._active >= self.limits.max_generations:
            raise RequestError(UNAVAILABLE, f"node {self.node_id} runs {self._active} generations already; retry")
        self._active += 1
        try:
            async with asyncio.timeout(request.timeout_s):
                if request.api is not None:
                    result = await self._forwarder.forward(instance, order, started)
                else:
                    result = await self._generate(instance, order, started)
        except TimeoutError as exc:
            raise RequestError(TIMEOUT, f"the generation did not finish within {request.timeout_s:g}s") from exc
        finally:
            self._active -= 1
            waited_ms = self._waited_ms.pop(order.request_id, 0.0)
        endpoint = request.api.endpoint if request.api else ""
        self.emit(GenerateCompleted, **completed(result, endpoint), tenant=request.tenant, queued_ms=waited_ms)
        return result

    async def _generate(self, instance: ServedInstance, order: RunnerGenerate, started: float) -> GenerateResult:
        request = order.request
        tokens = await self._prompt_tokens(instance, order)
        grant = await self.acquire(
            instance, tokens, claim_of(request, len(tokens), request.n_predict), order.request_id, request.cache_scope
        )
        with captures.SlotRun(
            self, instance, grant, tokens, capture=request.capture, request_id=order.request_id,
            scope=request.cache_scope,
        ) as run:  # fmt: skip
            return await self._run(run, instance, grant, order, tokens, started)

    async def _prompt_tokens(self, instance: ServedInstance, order: RunnerGenerate) -> list[int]:
        """The prompt's tokens: the router's, else the prompt's own ids, else its text tokenized on the instance."""
        prompt = order.request.prompt
        if order.tokens is not None:
            tokens = list(order.tokens)
        elif isinstance(prompt, str):
            tokens = await self.tokenize(instance.id, prompt)
        else:
            tokens = list(prompt or ())
        if not tokens:
            raise RequestError(BAD_REQUEST, "the prompt has no tokens")
        refuse_oversize(instance.context, tokens=len(tokens))
        return tokens

    async def acquire(
        self,
        instance: ServedInstance,
        tokens: Sequence[int],
        claim: Claim = ANYONE,
        request_id: str = "",
        scope: str = "",
    ) -> Grant:
        """A slot of `instance` for `tokens`: at once when one is free and nobody waits, else in the queue's order
        (`fairqueue`: class, then fair share by cost), journaled: why it waits, and the choice that ended it."""
        table = instance.table
        grant = table.acquire(tokens, None, claim, scope)
        if grant is not None:
            self.changed.set()
            await self._clear_foreign(instance, grant)
            return grant
        ticket = Ticket(request_id)
        waiter = table.wait(ticket, claim)
        self.changed.set()
        self._journal_wait(instance, waiter, request_id)
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            # its turn with a slot free, unless a finishing slot holding much more of the prompt is worth waiting
            # for (`SlotTable.acquire` says None then): woken on every release
            while True:
                if table.my_turn(ticket):
                    candidates = table.waiters()
                    if (grant := table.acquire(tokens, ticket, scope=scope)) is not None:
                        break
                waiter_woken: asyncio.Future[None] = loop.create_future()
                instance.wakeups.append(waiter_woken)
                await waiter_woken
        except BaseException:
            table.withdraw(ticket)
            instance.wake()  # the next in line may be the head now
            self.changed.set()
            raise
        self.changed.set()
        await self._clear_foreign(instance, grant)
        waited_ms = (loop.time() - began) * 1000
        if request_id:
            self._waited_ms[request_id] = waited_ms
        recorded = tuple(queued_waiter(w, Ticket.request_of(t)) for t, w in candidates[:MAX_CANDIDATES])
        self.emit(GenerateDequeued, instance_id=instance.id, request_id=request_id, waited_ms=waited_ms,
                  candidates=recorded, more=max(0, len(candidates) - MAX_CANDIDATES))  # fmt: skip
        return grant

    async def _clear_foreign(self, instance: ServedInstance, grant: Grant) -> None:
        """A slot that may hold another cache scope's state is erased before the request uses it (llama-server's
        own `erase`): the server would reuse any prefix it shares, and say so in the answer's cached tokens."""
        if not grant.foreign:
            return
        try:
            await self.api.slot_action(
                instance.port, grant.slot, "erase", None, timeout_s=self.limits.tokenize_timeout_s
            )
        except ServerApiError as exc:
            self.release(instance, grant.slot, None)
            raise RequestError(UNAVAILABLE, f"instance {instance.id}: the slot could not be cleared: {exc}") from exc

    def _journal_wait(self, instance: ServedInstance, waiter: Waiter, request_id: str) -> None:
        ahead = [w for _, w in instance.table.waiters() if w.order < waiter.order]
        higher = sum(1 for w in ahead if w.claim.priority > waiter.claim.priority)
        busy = instance.table.busy
        reason = (
            f"{busy} of {instance.table.n_slots} slots busy" if not instance.table.free() else "a slot is finishing"
        )
        if ahead:
            reason += f"; {len(ahead)} ahead ({higher} of a higher class, {len(ahead) - higher} earlier by fair share)"
        self.emit(GenerateQueued, instance_id=instance.id, waiter=queued_waiter(waiter, request_id), busy_slots=busy,
                  ahead=len(ahead), ahead_higher_class=higher, reason=reason)  # fmt: skip

    def release(self, instance: ServedInstance, slot: int, held: Sequence[int] | None) -> None:
        instance.table.release(slot, held)
        instance.wake()
        self.changed.set()

    async def _run(
        self,
        run: captures.SlotRun,
        instance: ServedInstance,
        grant: Grant,
        order: RunnerGenerate,
        tokens: list[int],
        started: float,
    ) -> GenerateResult:
        """The generation on an acquired slot: its plan followed up to the answer, the completion, and the answer
        handed to the plan (which gives the slot back, or keeps it for the captures after the answer)."""
        asked = time.perf_counter()
        remote, fallback = await self._handed_off(instance, grant, order, tokens)
        source, evaluated = await run.before_answer()
        restored = run.plan.restored_tokens
        elapsed_ms = (time.perf_counter() - asked) * 1000
        if remote is not None and restored < remote.n_tokens:
            raise RequestError(UNAVAILABLE, f"the state prefilled on {remote.node} could not be restored here")
        done = await self._complete(instance, grant, order, tokens)
        answer = rules.generation_answer(done.final, len(done.ids), cancelled=done.cancelled)
        run.answered(
            completed=answer.completed, prompt_counted=len(tokens), generated=answer.generated,
            answer=done.ids if answer.ids_known else None,
        )  # fmt: skip
        timings = done.final.get("timings") or {}
        evaluated += int(timings.get("prompt_n", 0) or 0) + (remote.tokens_evaluated if remote is not None else 0)
        handoff_ms = 0.0
        if remote is not None:  # + the prompt's last token: a decode step of its own here, batched by a local prefill
            handoff_ms = rules.handoff_ms(
                elapsed_ms, compute_ms=remote.compute_ms, prefill_ms=remote.prefill_ms,
                last_token_ms=float(timings.get("prompt_ms", 0) or 0),
            )  # fmt: skip
        now = time.perf_counter()
        return GenerateResult(
            request_id=order.request_id,
            text="".join(done.text),
            tokens=done.ids,
            prompt_tokens=len(tokens),
            source=source,
            tokens_restored=restored,
            tokens_cached=int(timings.get("cache_n", 0) or 0),
            tokens_evaluated=evaluated,
            ttft_ms=order.routed_ms + ((done.first or now) - started) * 1000,
            total_ms=order.routed_ms + (now - started) * 1000,
            node=self.node_id,
            instance=instance.id,
            slot=grant.slot,
            stop_reason=answer.stop,
            tokens_exact=answer.exact,
            tokens_generated=answer.generated,
            path="disaggregated" if remote is not None else "local",
            prefill_node=remote.node if remote is not None else None,
            handoff_bytes=remote.bytes if remote is not None else 0,
            handoff_ms=round(handoff_ms, 3),
            prefill_fallback=fallback,
            decision_id=order.route.decision_id if order.route else "",
            capture=run.plan.capture_note,
        )

    async def _handed_off(
        self, instance: ServedInstance, grant: Grant, order: RunnerGenerate, tokens: list[int]
    ) -> tuple[PrefillResult | None, str]:
        """The prompt prefilled on the node the router named and handed into this node's L3 (None: computed
        here), and why it is computed here when the router named another node."""
        request = order.request
        route = rules.prefill_route(
            request.prefill_node, self.node_id, resident=grant.resident, n_tokens=len(tokens),
            cache_scope=request.cache_scope,
        )  # fmt: skip
        if route.node is None:
            return None, route.skipped
        try:
            return await self._remote_prefill(instance, order, tokens[:-1]), route.skipped  # lands in this node's L3
        except RequestError as exc:  # the handoff was to save time: the prompt is computed here instead
            why = rules.prefill_fallback(route.node, exc.reply.code)
            if why is None:
                raise
            _log.warning("prefill_fallback", request_id=order.request_id, node=route.node,
                         code=exc.reply.code, error=str(exc))  # fmt: skip
            return None, why

    async def _complete(
        self, instance: ServedInstance, grant: Grant, order: RunnerGenerate, tokens: list[int]
    ) -> _Completion:
        """`/completion` on the slot. With a requester's `stream` subject: its chunks published there (unless it
        asked for none) while its liveness is checked; a requester gone stops the completion (`cancelled`). A
        server's failure is the request's error (and, as `serving_rules.server_failure` says, the instance's)."""
        request = order.request
        body = {
            "prompt": tokens,
            "n_predict": request.n_predict,
            "id_slot": grant.slot,
            "cache_prompt": grant.reuse,
            "return_tokens": True,
            **sampling_body(request.sampling, request.sampling.stop),
        }
        stream = (
            ChunkStream(self.bus, request.stream, order.request_id, self.limits.stream_silence_s)
            if request.stream
            else None
        )
        done = _Completion()
        sent = time.perf_counter()
        try:
            if stream is None:
                await self._whole(instance, body, request.timeout_s, done)
            else:  # the requester's subject: chunks there (unless it asked for none), and its liveness checked
                await stream.watched(
                    self._streamed(instance, body, stream, done)
                    if request.chunks
                    else self._whole(instance, body, request.timeout_s, done)
                )
        except* ClientGone as group:
            reason = str(group.exceptions[0])
            _log.info("stream_client_gone", request_id=order.request_id, reason=reason)
            done.cancelled = True
            self.emit(
                GenerateCancelled, request_id=order.request_id, instance_id=instance.id, endpoint="",
                tokens_generated=len(done.ids), reason=reason,
            )  # fmt: skip
        except* ServerApiError as group:
            error = group.exceptions[0]
            raise server_failed(self.outcome, instance, error, getattr(error, "status", None)) from error
        self.outcome(instance.id, True, "")
        timings = done.final.get("timings") or {}
        self.measured(instance, timings)
        if stream is None and timings:  # the server's own clock: prompt time, then the first token
            done.first = sent + rules.first_token_s(timings)
        return done

    async def _streamed(
        self, instance: ServedInstance, body: dict[str, Any], stream: ChunkStream, done: _Completion
    ) -> None:
        """The completion streamed from the server, each piece published as it comes."""
        async for event in self.api.completion(
            instance.port, body, connect_timeout_s=self.limits.tokenize_timeout_s,
            idle_timeout_s=self.limits.idle_timeout_s,
        ):  # fmt: skip
            pieces = [t for t in event.get("tokens") or () if isinstance(t, int)]
            content = event.get("content") or ""
            if (pieces or content) and done.first is None:
                done.first = time.perf_counter()
            done.ids.extend(pieces)
            done.text.append(content)
            if pieces or content:
                await stream.send(content, pieces)
            if event.get("stop"):
                done.final = event

    async def _whole(self, instance: ServedInstance, body: dict[str, Any], timeout_s: float, done: _Completion) -> None:
        """The completion whole: the reply lists every token id (a stream leaves out the ids of tokens whose bytes
        it held back as incomplete UTF-8). Closing the connection (a deadline, a requester gone) stops the server."""
        done.final = await self.api.json(instance.port, "POST", "/completion", body, timeout_s=timeout_s)
        done.ids = [t for t in done.final.get("tokens") or () if isinstance(t, int)]
        done.text = [str(done.final.get("content") or "")]

    async def _remote_prefill(
        self, instance: ServedInstance, order: RunnerGenerate, prefix: list[int]
    ) -> PrefillResult:
        """Asks the prefill node to compute `prefix` and hand its state to this node's L3."""
        node = order.request.prefill_node
        assert node is not None
        if instance.identity is None or self.l3 is None:
            raise RequestError(UNAVAILABLE, f"instance {instance.id} has no L3 identity yet: no handoff into it")
        ask = Prefill(identity=instance.identity, tokens=prefix, target_node=self.node_id, request_id=order.request_id)
        try:
            return await self.bus.request(
                self._subjects.runner(node, "prefill"), ask, PrefillResult, timeout=order.request.timeout_s
            )
        except RemoteError as exc:
            raise RequestError(exc.reply.code, f"prefill on {node}: {exc.reply.message}", exc.reply.details) from exc
        except RequestTimeout as exc:
            raise RequestError(TIMEOUT, f"prefill on {node}: {exc}") from exc
        except BusError as exc:
            raise RequestError(UNAVAILABLE, f"prefill on {node}: {exc}") from exc

    async def prefill(self, order: Prefill) -> PrefillResult:
        """Computes `order.tokens` on a ready instance of its identity and hands the state off to its target
        (the prefill hop of the request's trace)."""
        with tracing.hop("prefill", kind="server") as span:
            span.update({"mesh.node": self.node_id, "mesh.request_id": order.request_id,
                         "gen_ai.usage.input_tokens": len(order.tokens),
                         "mesh.handoff.target": order.target_node})  # fmt: skip
            return await self._prefill_traced(order)

    async def _prefill_traced(self, order: Prefill) -> PrefillResult:
        started = time.perf_counter()
        if self._handoff is None:
            raise RequestError(UNAVAILABLE, f"node {self.node_id} has no handoff actor")
        instance = next((i for i in self._instances.values() if i.identity == order.identity), None)
        if instance is None:
            raise RequestError(NOT_FOUND, f"no ready instance of identity {order.identity[:16]}… on {self.node_id}")
        grant = await self.acquire(
            instance, order.tokens, Claim(cost=len(order.tokens), prompt_tokens=len(order.tokens)), order.request_id
        )
        held: list[int] | None = None
        try:
            timings = await self._prefill(instance, grant.slot, order.tokens)
            evaluated = int(timings.get("prompt_n", 0) or 0)
            self.measured(instance, timings)
            prefilled = time.perf_counter()
            path = instance.slot_dir / f"handoff-{order.request_id}-{uuid.uuid4().hex[:8]}.bin"
            try:
                n_saved = await self.save_slot(instance, grant.slot, path, len(order.tokens))
                report = await self._handoff.send(
                    order.target_node, path, identity=order.identity, n_tokens=n_saved,
                    tokens=order.tokens[:n_saved], payload_kind=PAYLOAD_KIND,
                )  # fmt: skip
            except SaveFailed as exc:
                raise RequestError(UNAVAILABLE, f"instance {instance.id}: {exc}") from exc
            except HandoffFailed as exc:
                raise RequestError(UNAVAILABLE, f"handoff to {order.target_node}: {exc}") from exc
            finally:
                await remove_file(path)
            held = order.tokens[:n_saved]
            return PrefillResult(
                node=self.node_id, instance=instance.id, n_tokens=n_saved, tokens_evaluated=evaluated,
                bytes=report.bytes, prefill_ms=(prefilled - started) * 1000, handoff_ms=report.transfer_ms,
                compute_ms=float(timings.get("prompt_ms", 0.0) or 0.0),
            )  # fmt: skip
        finally:
            self.release(instance, grant.slot, held)

    async def restore(self, instance: ServedInstance, slot: int, hit: L3Hit) -> bool:
        """Restores `hit` into the slot (fetched from its peer first when it is there): the L3 restore hop."""
        with tracing.hop("l3 restore", kind="internal") as span:
            span.update({"mesh.node": self.node_id, "mesh.instance": instance.id, "mesh.slot": slot,
                         "mesh.l3.entry": hit.entry, "mesh.l3.source": hit.source, "mesh.tokens": hit.n_tokens,
                         "mesh.l3.bytes": hit.bytes})  # fmt: skip
            restored = await self._restore(instance, slot, hit)
            span.update({"mesh.l3.restored": restored})
            return restored

    async def _restore(self, instance: ServedInstance, slot: int, hit: L3Hit) -> bool:
        assert self.l3 is not None
        name = f"restore-{uuid.uuid4().hex}.bin"
        path = instance.slot_dir / name
        try:
            await self.l3.materialize(hit, path, deadline_s=self.limits.slot_file_timeout_s)
            reply = await self.api.slot_action(
                instance.port, slot, "restore", name, timeout_s=self.limits.slot_file_timeout_s
            )
            if int(reply.get("n_restored", -1)) != hit.n_tokens:
                _log.warning("restore_mismatch", entry=hit.entry, expected=hit.n_tokens, got=reply.get("n_restored"))
                instance.table.update(slot, ())
                return False
            return True
        except (L3Unavailable, ServerApiError) as exc:
            _log.warning("restore_failed", instance_id=instance.id, entry=hit.entry, error=str(exc))
            instance.table.update(slot, ())
            return False
        finally:
            await remove_file(path)

    async def _prefill(self, instance: ServedInstance, slot: int, tokens: list[int]) -> dict[str, Any]:
        """Computes `tokens` into the slot (one token is sampled and dropped); the server's timings. Whole, not
        streamed: a long prefill sends nothing until it is done, and the request's own deadline bounds it."""
        body = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True, "temperature": 0}
        try:
            final = await self.api.json(instance.port, "POST", "/completion", body, timeout_s=3600)
        except ServerApiError as exc:
            raise RequestError(UNAVAILABLE, f"instance {instance.id}: {exc}") from exc
        instance.table.update(slot, tokens)
        return dict(final.get("timings") or {}) if isinstance(final, dict) else {}

    async def save_slot(self, instance: ServedInstance, slot: int, path: Path, known: int) -> int:
        """Saves the slot to `path` (in its `--slot-save-path`); how many tokens the state holds, at most
        `known` (the tokens the runner knows it holds). Raises `SaveFailed`, with no file left, otherwise."""
        try:
            reply = await self.api.slot_action(
                instance.port, slot, "save", path.name, timeout_s=self.limits.slot_file_timeout_s
            )
        except ServerApiError as exc:
            await remove_file(path)
            raise SaveFailed("save_failed", str(exc)) from exc
        n_saved = int(reply.get("n_saved", -1))
        if not 0 < n_saved <= known:
            await remove_file(path)
            raise SaveFailed("save_mismatch", f"the saved state holds {n_saved} tokens, not a prefix of {known}")
        return n_saved

    async def prefill_and_save(
        self, instance: ServedInstance, slot: int, prefix: list[int], request_id: str, scope: str = ""
    ) -> int:
        """Prefills `prefix` into the slot and captures it; returns the tokens the server evaluated."""
        timings = await self._prefill(instance, slot, prefix)
        assert self.l3 is not None and instance.identity is not None
        path = instance.slot_dir / f"capture-{request_id}-prefix-{uuid.uuid4().hex[:8]}.bin"
        try:
            n_saved = await self.save_slot(instance, slot, path, len(prefix))
        except SaveFailed as exc:
            _log.warning(exc.kind, instance_id=instance.id, error=str(exc))
        else:
            identity = scoped_identity(instance.identity, scope)  # the request's cache scope's own
            self.l3.capture(path, identity=identity, tokens=prefix[:n_saved], payload_kind=PAYLOAD_KIND)
        return int(timings.get("prompt_n", 0) or 0)


class Ticket:
    """A request's place in an instance's queue (compared by identity)."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    @staticmethod
    def request_of(ticket: object) -> str:
        return ticket.request_id if isinstance(ticket, Ticket) else ""


def queued_waiter(waiter: Waiter, request_id: str) -> QueuedWaiter:
    c, t = waiter.claim, waiter.tags
    return QueuedWaiter(
        request_id=request_id, tenant=c.tenant, priority=c.priority, weight=c.weight, cost=c.cost, seq=t.seq,
        virtual=t.virtual, previous=t.previous, start=t.start, finish=t.finish,
    )  # fmt: skip


def completed(result: GenerateResult, endpoint: str) -> dict[str, Any]:
    """The fields of the `generate_completed` event that records `result` (the journal keeps no text or tokens)."""
    return {
        "request_id": result.request_id, "decision_id": result.decision_id, "instance_id": result.instance,
        "endpoint": endpoint, "status": result.status, "stop_reason": result.stop_reason, "source": result.source,
        "prompt_tokens": result.prompt_tokens, "tokens_cached": result.tokens_cached,
        "tokens_restored": result.tokens_restored, "tokens_evaluated": result.tokens_evaluated,
        "tokens_generated": result.tokens_generated, "ttft_ms": result.ttft_ms, "total_ms": result.total_ms,
        "path": result.path, "prefill_node": result.prefill_node, "handoff_bytes": result.handoff_bytes,
        "handoff_ms": result.handoff_ms, "prefill_fallback": result.prefill_fallback,
    }  # fmt: skip
