"""Each request to the front door's API, accounted (front-door shell): its key's limits checked before it is served
and settled after it, and one `request_usage` journal event for it, whatever its outcome.

The front door calls three things: `account` around the whole request (it opens the request's ticket, and at the
end, however it ends, releases what was admitted and journals the request), `admit` once the request's model is
known (a refusal is a 429 naming the limit, with Retry-After; a limits store out of reach is a 503), and
`answered` with the mesh's result (its token counts are what the key is charged and what the journal says).
The limits themselves are `runtime.shared_limits`' (shared with the router, which counts NATS clients).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from actors.frontdoor import shapes
from messages.errors import RATE_LIMITED, UNAVAILABLE
from messages.events import RequestUsage
from messages.generate import GenerateResult
from messages.subjects import Subjects
from messages.tenants import TenantKey
from runtime import key_limits as limits
from runtime.bus import Bus
from runtime.shared_limits import LimitsUnavailable, SharedLimits

__all__ = ["CLIENT_LEFT", "Accounting"]

#: The status journaled for a request whose client left before its answer (nginx's "client closed request").
CLIENT_LEFT: Final = 499
#: Requests refused before they were served are journaled together, one event per kind, this often.
REFUSALS_WINDOW_S: Final = 5.0
#: The most kinds of refusal (key, model, endpoint, status, limit) told apart within a window; past it, the
#: rest are counted under the key alone (model and endpoint "").
MAX_REFUSAL_KINDS: Final = 256

_RefusalKind = tuple[str, str, str, str, int, str]  # tenant, key id, model, endpoint, status, limit


class _Ticket:
    __slots__ = ("admitted", "key", "model", "refused", "result")

    def __init__(self, key: TenantKey | None) -> None:
        self.key = key
        self.model = ""
        self.admitted = False
        self.refused = ""
        self.result: GenerateResult | None = None


_TICKET: Final = web.RequestKey("mesh_accounting", _Ticket)


class Accounting:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        node: str,
        *,
        emit: Callable[..., Any],
        log: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = SharedLimits(bus, subjects, node, log=log)
        self._emit = emit
        self._log = log
        self._clock = clock
        self._unavailable = False  # the limits store failed the last admission (logged once until it answers)
        self._refusals: dict[_RefusalKind, list[float]] = {}  # requests refused this window: count, duration
        self._refused = asyncio.Event()

    async def run(self) -> None:
        """The shared limits' flusher and the refusals' journal, for as long as the front door runs."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.limits.run(), name="limits-flusher")
            tg.create_task(self._journal_refusals(), name="refusals-journal")

    async def _journal_refusals(self) -> None:
        """Each window's refusals as one `request_usage` event per kind (`count` of them), and the last ones at
        the end."""
        try:
            while True:
                await self._refused.wait()
                await asyncio.sleep(REFUSALS_WINDOW_S)
                self._refused.clear()
                self.flush_refusals()
        finally:
            self.flush_refusals()

    def flush_refusals(self) -> None:
        refusals, self._refusals = self._refusals, {}
        for (tenant, key_id, model, endpoint, status, refused), (count, duration_ms) in refusals.items():
            self._emit(
                RequestUsage, tenant=tenant, key_id=key_id, model=model, endpoint=endpoint, status=status,
                duration_ms=duration_ms, refused=refused, count=int(count),
            )  # fmt: skip

    def _count_refusal(self, kind: _RefusalKind, duration_ms: float) -> None:
        if kind not in self._refusals and len(self._refusals) >= MAX_REFUSAL_KINDS:
            tenant, key_id, _, _, status, refused = kind
            kind = (tenant, key_id, "", "", status, refused)
        entry = self._refusals.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += duration_ms
        self._refused.set()

    async def account(
        self, request: web.Request, key: TenantKey | None, endpoint: str, answer: Awaitable[web.StreamResponse]
    ) -> web.StreamResponse:
        """`answer` (the request's handling), then what it used: the key's admission released with the tokens
        the answer reports, and the request journaled (its status, or the error's, or 499 when cancelled)."""
        ticket = request[_TICKET] = _Ticket(key)
        started = self._clock()
        status = 500
        try:
            response = await answer
            status = response.status
            return response
        except shapes.ApiError as exc:
            status = exc.status
            raise
        except web.HTTPException as exc:  # aiohttp's own (a body over the limit: 413)
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionError):  # the client left (charged what the server did)
            status = CLIENT_LEFT
            raise
        finally:
            result = ticket.result
            prompt, generated = (result.prompt_tokens, result.tokens_generated) if result is not None else (0, 0)
            if ticket.admitted and key is not None:
                self.limits.release(key, prompt + generated)
            duration_ms = (self._clock() - started) * 1000
            tenant, key_id = (key.tenant, key.key_id) if key is not None else ("", "")
            if result is None and 400 <= status < 500 and status != CLIENT_LEFT:
                # journaled with the window's other refusals of its kind
                self._count_refusal((tenant, key_id, ticket.model, endpoint, status, ticket.refused), duration_ms)
            else:
                self._emit(
                    RequestUsage, tenant=tenant, key_id=key_id, model=ticket.model, endpoint=endpoint,
                    status=status, prompt_tokens=prompt, generated_tokens=generated,
                    cached_tokens=result.tokens_cached if result is not None else 0, duration_ms=duration_ms,
                    refused=ticket.refused,
                )  # fmt: skip

    async def admit(self, request: web.Request, model: str) -> None:
        """Counts the request against its key's limits (none for the admin key or an open door), for `model` (the
        catalog name). Raises the client's error: 429 `rate_limit_exceeded` naming the limit, with Retry-After;
        503 when the limits cannot be checked."""
        ticket = request.get(_TICKET)
        if ticket is None:
            return
        ticket.model = model
        key = ticket.key
        if key is None or not limits.limited(key):
            return
        try:
            refused = await self.limits.admit(key)
        except LimitsUnavailable as exc:
            if not self._unavailable:
                self._log.warning("frontdoor_limits_unavailable", key_id=key.key_id, error=str(exc))
            self._unavailable = True
            raise shapes.ApiError(UNAVAILABLE, f"this key's limits cannot be checked now: {exc}") from exc
        if self._unavailable:
            self._log.info("frontdoor_limits_available")
            self._unavailable = False
        if refused is not None:
            ticket.refused = refused.limit
            raise shapes.ApiError(
                RATE_LIMITED, refused.message, extra={"limit": refused.limit}, retry_after_s=refused.retry_after_s
            )
        ticket.admitted = True

    def answered(self, request: web.Request, result: GenerateResult) -> None:
        """The mesh's result for the request: the tokens its key is charged and its usage says."""
        ticket = request.get(_TICKET)
        if ticket is not None:
            ticket.result = result
