"""A real OTLP/HTTP trace receiver for tests: an aiohttp server on loopback that takes `POST /v1/traces`
(protobuf, gzip or not), decodes it with `opentelemetry-proto` (which comes with the `otlp` extra's exporter)
and keeps every span, so a test waits (with a deadline) for the spans it expects."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: str  # STATUS_CODE_UNSET, _OK, _ERROR


@dataclass
class Receiver:
    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    posts: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30) -> list[ReceivedSpan]:
        """The spans received, once `done` says they include what the test waits for."""
        async with asyncio.timeout(timeout_s):
            while not done(self.spans):
                self._changed.clear()
                await self._changed.wait()
        return list(self.spans)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind is None:
        return None
    return getattr(value, kind)


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[Receiver]:
    """A receiver listening on a free loopback port; `url` is its base (the exporter adds `/v1/traces`)."""
    trace_service = pytest.importorskip(
        "opentelemetry.proto.collector.trace.v1.trace_service_pb2", reason="the otlp extra is not installed"
    )
    from opentelemetry.proto.trace.v1 import trace_pb2

    receiver = Receiver()

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = trace_service.ExportTraceServiceRequest()
        message.ParseFromString(body)
        for resource_spans in message.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    receiver.spans.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                            attributes=_attributes(span.attributes),
                            resource=resource,
                            status=trace_pb2.Status.StatusCode.Name(span.status.code),
                        )
                    )
        receiver.posts += 1
        receiver._changed.set()
        reply = trace_service.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    sockets = getattr(getattr(site, "_server", None), "sockets", None) or []
    receiver.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
    try:
        yield receiver
    finally:
        async with asyncio.timeout(10):
            await runner.cleanup()
