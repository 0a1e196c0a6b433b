"""A client's answer relayed from the mesh (front-door shell): the instance's own answer as it streams over the
bus (events written as they come, a whole answer once complete, its model renamed to the client's name), and the
mesh's own errors in the shape the client's API uses (OpenAI's, or Anthropic's), naming no part of the mesh."""

from __future__ import annotations

import asyncio
import json
from typing import Final

from aiohttp import web

from actors.frontdoor import shapes
from messages.generate import RelayHead
from runtime.bus import BusError, NoResponders, RequestTimeout
from runtime.generate_client import StreamGap

__all__ = ["MAX_ANSWER_BYTES", "PARSE_ON_LOOP_BYTES", "Relay", "bus_failure", "error_response"]

#: Largest whole (not streamed) answer the front door buffers to rename its model.
MAX_ANSWER_BYTES: Final = 64 << 20
#: A whole answer larger than this is parsed in a worker thread, not on the event loop.
PARSE_ON_LOOP_BYTES: Final = 256 << 10


def error_response(error: shapes.ApiError, shape: shapes.Shape, *, status: int | None = None) -> web.Response:
    headers = shapes.error_headers(error.code, error.retry_after_s)
    return web.json_response(shapes.error_body(error, shape), status=status or error.status, headers=headers)


class Relay:
    """A relayed answer to one HTTP request: streamed events as they come, a whole answer once complete."""

    def __init__(self, request: web.Request, name: str, shape: shapes.Shape) -> None:
        self._request = request
        self._name = name
        self._shape = shape
        self._head: RelayHead | None = None
        self._stream: web.StreamResponse | None = None
        self._whole = bytearray()
        self._renamer = shapes.ModelRenamer(name)

    async def head(self, head: RelayHead) -> None:
        self._head = head
        if head.content_type.startswith("text/event-stream"):
            headers = {"Content-Type": head.content_type, "Cache-Control": "no-cache"}
            self._stream = web.StreamResponse(status=head.status, headers=headers)
            await self._stream.prepare(self._request)

    async def data(self, data: bytes) -> None:
        if self._stream is not None:
            await self._stream.write(self._renamer.events(data))
            return
        if len(self._whole) + len(data) > MAX_ANSWER_BYTES:
            raise StreamGap(f"an answer over {MAX_ANSWER_BYTES} bytes")
        self._whole += data

    async def finish(self) -> web.StreamResponse:
        if self._stream is not None:
            await self._stream.write_eof()
            return self._stream
        head = self._head or RelayHead(status=502, content_type="application/json")
        body = bytes(self._whole)
        if head.status >= 400:
            body = shapes.server_error_body(head.status, body, self._shape)
        elif len(body) > PARSE_ON_LOOP_BYTES:  # parsed off the event loop: other requests go on meanwhile
            body = await asyncio.to_thread(shapes.rename_json, body, self._name)
        else:
            body = shapes.rename_json(body, self._name)
        return web.Response(body=body, status=head.status, headers={"Content-Type": head.content_type})

    async def failed(self, error: shapes.ApiError) -> web.StreamResponse:
        """The mesh's own error: the whole answer when nothing was sent yet, else the last event of the stream."""
        if self._stream is None:
            return error_response(error, self._shape)
        body = json.dumps(shapes.error_body(error, self._shape), ensure_ascii=False)
        event = f"event: error\ndata: {body}\n\n" if self._shape == "anthropic" else f"data: {body}\n\n"
        await self._stream.write(event.encode())
        await self._stream.write_eof()
        return self._stream


def bus_failure(exc: BusError) -> str:
    """What failed on the bus, for a client: no subject or module of the mesh named."""
    if isinstance(exc, NoResponders):
        return "no such service is running in the mesh"
    if isinstance(exc, RequestTimeout):
        return f"no answer within {exc.timeout:g}s"
    return "the mesh's bus failed"
