"""Each request to the front door's API, accounted (front-door shell): its key's limits checked before it is served
and settled after it, and one `request_usage` journal event for it, whatever its outcome.

The front door calls three things: `account` around the whole request (it opens the request's ticket, and at the
end, however it ends, releases what was admitted and journals the request), `admit` once the request's model is
known (a refusal is a 429 naming the limit, with Retry-After; a limits store out of reach is a 503), and
`answered` with the mesh's result (its token counts are what the key is charged and what the journal says).
The limits themselves are `limits_shared`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from actors.frontdoor import limits, shapes
from actors.frontdoor.limits_shared import LimitsUnavailable, SharedLimits
from messages.errors import RATE_LIMITED, UNAVAILABLE
from messages.events import RequestUsage
from messages.generate import GenerateResult
from messages.subjects import Subjects
from messages.tenants import TenantKey
from runtime.bus import Bus

__all__ = ["CLIENT_LEFT", "Accounting"]

#: The status journaled for a request whose client left before its answer (nginx's "client closed request").
CLIENT_LEFT: Final = 499


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

    async def run(self) -> None:
        """The shared limits' flusher, for as long as the front door runs."""
        await self.limits.run()

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
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_LEFT
            raise
        finally:
            result = ticket.result
            prompt, generated = (result.prompt_tokens, result.tokens_generated) if result is not None else (0, 0)
            if ticket.admitted and key is not None:
                self.limits.release(key, prompt + generated)
            self._emit(
                RequestUsage, tenant=key.tenant if key else "", key_id=key.key_id if key else "", model=ticket.model,
                endpoint=endpoint, status=status, prompt_tokens=prompt, generated_tokens=generated,
                cached_tokens=result.tokens_cached if result is not None else 0,
                duration_ms=(self._clock() - started) * 1000, refused=ticket.refused,
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
