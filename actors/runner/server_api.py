"""llama-server's HTTP API as the runner uses it (runner shell: one aiohttp session per runner incarnation).

Every call has a deadline and a ceiling on what it reads; a failure is a `ServerApiError` whose message says
which call failed and why (HTTP status and the server's own error message when it sent one; no answer in time;
a reply over its ceiling; a connection refused or garbage where HTTP was expected). Completions are
always streamed from the server (server-sent events), even when the client asked for the whole reply: the
first token's time is measured, and closing the response (a client that went away, a deadline) makes the
server stop generating and free the slot.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Final

import aiohttp

from actors.runner.command import LOOPBACK

__all__ = ["MAX_EVENT_BYTES", "ServerApi", "ServerApiError"]

MAX_JSON_BYTES: Final = 64 << 20
#: Ceiling on a reply whose body only says "ok" or "loading" (/health).
MAX_STATUS_BYTES: Final = 64 << 10
#: Longest server-sent event line accepted (a chunk carries a few tokens; the last one the timings).
MAX_EVENT_BYTES: Final = 4 << 20


class ServerApiError(Exception):
    """A llama-server call failed; `status` is its HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _reason(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error", {})
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body[:300].decode(errors='replace')}"


def _failure(exc: aiohttp.ClientError) -> str:
    """An aiohttp failure in one line: refused, disconnected, or what was wrong with the reply."""
    if isinstance(exc, aiohttp.ClientResponseError):  # the reply could not be parsed ("400" is aiohttp's own)
        text = f"malformed reply: {exc.message}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


class ServerApi:
    """Calls on the llama-servers of one node (loopback), sharing one connection pool."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    @staticmethod
    def session(limit: int = 256) -> aiohttp.ClientSession:
        """The session a runner incarnation opens (and closes when it ends)."""
        # One connection per request: llama-server closes some (after a stream) while the pool would reuse them.
        connector = aiohttp.TCPConnector(limit=limit, force_close=True)
        # a line may be up to twice the read buffer: that is the event ceiling
        return aiohttp.ClientSession(connector=connector, read_bufsize=MAX_EVENT_BYTES // 2, auto_decompress=False)

    async def json(
        self,
        port: int,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        *,
        timeout_s: float,
        max_bytes: int = MAX_JSON_BYTES,
    ) -> Any:
        """The JSON of a 200 reply to `method path`, answered within `timeout_s`, at most `max_bytes`."""
        status, data = await self._call(port, method, path, body, timeout_s=timeout_s, max_bytes=max_bytes)
        if status != 200:
            raise ServerApiError(f"{method} {path}: {_reason(status, data)}", status)
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ServerApiError(f"{method} {path}: the reply is not JSON ({exc})", status) from exc

    async def status(self, port: int, path: str, *, timeout_s: float) -> int:
        """The HTTP status of `GET path` (any status: /health answers 503 while the model loads)."""
        status, _ = await self._call(port, "GET", path, None, timeout_s=timeout_s, max_bytes=MAX_STATUS_BYTES)
        return status

    async def _call(
        self, port: int, method: str, path: str, body: Mapping[str, Any] | None, *, timeout_s: float, max_bytes: int
    ) -> tuple[int, bytes]:
        """One exchange: its status and whole body. The deadline covers connecting, the head and the body."""
        url = f"http://{LOOPBACK}:{port}{path}"
        what = f"{method} {path}"
        try:
            async with self._session.request(
                method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                return response.status, await _read_bounded(response, what, max_bytes)
        except TimeoutError as exc:
            raise ServerApiError(f"{what}: no answer within {timeout_s:g}s") from exc
        except aiohttp.ClientError as exc:
            raise ServerApiError(f"{what}: {_failure(exc)}") from exc
        except RuntimeError as exc:  # "Session is closed": the runner's incarnation is ending under this call
            raise ServerApiError(f"{what}: {exc}") from exc

    async def tokenize(self, port: int, text: str, *, timeout_s: float) -> list[int]:
        """`text`'s tokens as the server tokenizes a prompt (specials added, special text parsed)."""
        body = {"content": text, "add_special": True, "parse_special": True}
        reply = await self.json(port, "POST", "/tokenize", body, timeout_s=timeout_s)
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ServerApiError("POST /tokenize: no token list in the reply")
        return tokens

    async def slot_action(
        self, port: int, slot: int, action: str, filename: str | None, *, timeout_s: float
    ) -> dict[str, Any]:
        body = {"filename": filename} if filename is not None else {}
        reply = await self.json(port, "POST", f"/slots/{slot}?action={action}", body, timeout_s=timeout_s)
        if not isinstance(reply, dict):
            raise ServerApiError(f"POST /slots/{slot}?action={action}: the reply is not an object")
        return reply

    @contextlib.asynccontextmanager
    async def exchange(
        self, port: int, path: str, body: bytes, *, connect_timeout_s: float, idle_timeout_s: float
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """`POST path` with a JSON body, as it is: the response, open for the caller to read as it comes
        (whatever its status). Leaving the block closes the connection (the server stops the request)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=idle_timeout_s)
        url = f"http://{LOOPBACK}:{port}{path}"
        try:
            async with self._session.post(
                url, data=body, headers={"Content-Type": "application/json"}, timeout=timeout
            ) as response:
                yield response
        except TimeoutError as exc:
            raise ServerApiError(f"POST {path}: the server sent nothing for {idle_timeout_s:g}s") from exc
        except aiohttp.ClientError as exc:
            raise ServerApiError(f"POST {path}: {_failure(exc)}") from exc
        except RuntimeError as exc:  # the session closed: the runner's incarnation is ending
            raise ServerApiError(f"POST {path}: {exc}") from exc

    async def completion(
        self, port: int, body: Mapping[str, Any], *, connect_timeout_s: float, idle_timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The server-sent events of one streamed `/completion`, as dicts; leaving the iteration early
        closes the connection (the server stops the generation)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=idle_timeout_s)
        url = f"http://{LOOPBACK}:{port}/completion"
        try:
            async with self._session.post(url, json={**body, "stream": True}, timeout=timeout) as response:
                if response.status != 200:
                    data = await response.content.read(MAX_JSON_BYTES)
                    raise ServerApiError(f"POST /completion: {_reason(response.status, data)}", response.status)
                async for event in _events(response.content):
                    yield event
        except TimeoutError as exc:
            raise ServerApiError(f"POST /completion: the server sent nothing for {idle_timeout_s:g}s") from exc
        except aiohttp.ClientError as exc:
            raise ServerApiError(f"POST /completion: {_failure(exc)}") from exc
        except RuntimeError as exc:  # the session closed: the runner's incarnation is ending
            raise ServerApiError(f"POST /completion: {exc}") from exc


async def _read_bounded(response: aiohttp.ClientResponse, what: str, max_bytes: int) -> bytes:
    """The whole body, refused once it is over `max_bytes` (a declared length before anything is read)."""
    declared = response.content_length
    if declared is not None and declared > max_bytes:
        raise ServerApiError(
            f"{what}: a reply of {declared} bytes is over the limit of {max_bytes} bytes", response.status
        )
    data = bytearray()
    # `read(n)` returns what has arrived (at most n), not n bytes: read until the end or one byte past the limit
    while chunk := await response.content.read(max_bytes + 1 - len(data)):
        data += chunk
        if len(data) > max_bytes:
            raise ServerApiError(f"{what}: a reply over the limit of {max_bytes} bytes", response.status)
    return bytes(data)


async def _events(stream: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """`data: {json}` lines of a server-sent event stream (comments and blank lines skipped)."""
    while True:
        try:
            line = await stream.readline()
        except ValueError as exc:  # "Chunk too big": over twice the read buffer
            raise ServerApiError(f"POST /completion: an event line over {MAX_EVENT_BYTES} bytes") from exc
        if not line:
            return
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError as exc:
            raise ServerApiError(f"POST /completion: an event that is not JSON ({exc})") from exc
        if isinstance(event, dict) and "error" in event:
            raise ServerApiError(f"POST /completion: {event['error']}")
        if isinstance(event, dict):
            yield event


def sampling_body(sampling: Any, stop: Sequence[str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "stop": list(stop),
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body
