"""Trace context: the W3C `traceparent` of the request being served, carried across the mesh, and its spans.

A request's trace context enters at the front door (the HTTP `traceparent` header) or on any endpoint (the NATS
`traceparent` header of the request); one that is absent or malformed is replaced by a fresh trace, never
passed on. It lives in a `ContextVar` (`current`), so everything a request handler does runs within it without
an argument threaded through: asyncio tasks spawned there inherit it, `Bus.request`/`publish` add it to the
headers of what they send (`inject`), and the journal records it on every event (`Event.trace`).

Each hop of a request (front door, routing, runner generation, L3 restore and fetch, handoff) runs inside
`hop(name)`: a child span of the context it found (a new span id in the same trace) that becomes the current
context for what the hop does, so the next hop's parent is this one. Without an exporter (`install`), a hop is a
random span id and nothing else: no SDK is imported, nothing is recorded or sent. With one (`mesh-actor run
--otlp URL`, `runtime/otlp.py`), the hop is an OpenTelemetry span exported with its attributes (the GenAI
semantic-convention names where they apply) and ended when the hop ends.

Parsing and formatting are OpenTelemetry's own W3C propagator (`opentelemetry-api`); `tracestate` is not carried.
A traceparent longer than the propagator's limit is refused before it sees it (it would log a warning for
each: a client could fill the log).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from opentelemetry import trace as otel_trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "PROVIDER",
    "TRACEPARENT",
    "Hop",
    "SpanExporter",
    "TraceContext",
    "child",
    "context",
    "current",
    "enter",
    "exporting",
    "fresh",
    "hop",
    "incoming",
    "inject",
    "install",
    "leave",
    "model_name",
    "operation",
    "parse",
    "request_attributes",
    "result_attributes",
    "set_enabled",
    "traceparent",
    "uninstall",
    "use",
]

#: The W3C header, on HTTP and on NATS alike.
TRACEPARENT: Final = "traceparent"
#: The longest traceparent looked at (the propagator's own limit; version 00 is 55 characters).
MAX_TRACEPARENT: Final = 512

SpanKind = Literal["server", "client", "internal"]

_PROPAGATOR: Final = TraceContextTextMapPropagator()
_SAMPLED: Final = 0x01


@dataclass(frozen=True, slots=True)
class TraceContext:
    """One position in a trace: its trace id, the current span's id, the trace flags (bit 0: sampled) and the
    W3C header value naming them. Make one with `context`, `parse`, `fresh` or `child`."""

    trace_id: int
    span_id: int
    flags: int
    traceparent: str  # `00-<trace id>-<span id>-<flags>`, formatted once by OpenTelemetry's propagator
    origin: bool = False  # made here for a request that came without one: no span has this span id

    @property
    def trace_hex(self) -> str:
        return f"{self.trace_id:032x}"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & _SAMPLED)


def context(trace_id: int, span_id: int, flags: int = _SAMPLED, *, origin: bool = False) -> TraceContext:
    """The context of these ids (both nonzero: a zero id is invalid in W3C trace context)."""
    if not (0 < trace_id < 1 << 128 and 0 < span_id < 1 << 64 and 0 <= flags < 256):
        raise ValueError("a trace id is 128 bits, a span id 64 bits, neither zero; the flags 8 bits")
    span = otel_trace.NonRecordingSpan(
        otel_trace.SpanContext(
            trace_id=trace_id, span_id=span_id, is_remote=True, trace_flags=otel_trace.TraceFlags(flags)
        )
    )
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=otel_trace.set_span_in_context(span))
    return TraceContext(
        trace_id=trace_id, span_id=span_id, flags=flags, traceparent=carrier[TRACEPARENT], origin=origin
    )


def parse(value: object) -> TraceContext | None:
    """The context a traceparent header names, or None when it is absent or malformed (wrong version, all-zero
    ids, not lowercase hex, too long: the W3C rules, as OpenTelemetry's propagator applies them)."""
    if not isinstance(value, str) or not value or len(value) > MAX_TRACEPARENT:
        return None
    extracted = _PROPAGATOR.extract({TRACEPARENT: value})
    span = otel_trace.get_current_span(extracted).get_span_context()
    if not span.is_valid:
        return None
    return context(span.trace_id, span.span_id, int(span.trace_flags))


def fresh() -> TraceContext:
    """A new trace (sampled), for a request that came without a valid one: its first hop is the trace's root."""
    return context(_nonzero(128), _nonzero(64), origin=True)


def child(parent: TraceContext) -> TraceContext:
    """The next hop in `parent`'s trace: a new span id, the same trace and flags."""
    return context(parent.trace_id, _nonzero(64), parent.flags)


def incoming(headers: Mapping[str, str] | None) -> TraceContext | None:
    """The trace context a request arrives with (its `traceparent` header), or a fresh one (None: tracing is
    off, see `set_enabled`)."""
    if not _ENABLED:
        return None
    found = parse(headers.get(TRACEPARENT)) if headers else None
    return found if found is not None else fresh()


_ENABLED = True


def set_enabled(on: bool) -> None:
    """Turns trace context off (`mesh-actor run --no-trace`, for benchmarks' baselines) or on again: off,
    requests start no trace, hops are spans of nothing and events carry none."""
    global _ENABLED
    _ENABLED = on


def _nonzero(bits: int) -> int:
    while True:  # an all-zero id is invalid; one in 2**64 draws
        value = random.getrandbits(bits)
        if value:
            return value


# --- the current context --------------------------------------------------------------------------------

_CURRENT: ContextVar[TraceContext | None] = ContextVar("trace_context", default=None)


def current() -> TraceContext | None:
    """The trace context of the request this code runs for (None outside any)."""
    return _CURRENT.get()


def traceparent() -> str:
    """The current context as a traceparent header value ("" outside any request)."""
    ctx = _CURRENT.get()
    return ctx.traceparent if ctx is not None else ""


@contextlib.contextmanager
def use(ctx: TraceContext | None) -> Iterator[None]:
    """Runs the block within `ctx` (None: outside any trace, e.g. a long-lived task started by a request)."""
    token = _CURRENT.set(ctx)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def enter(ctx: TraceContext | None) -> Token[TraceContext | None]:
    """Makes `ctx` current until `leave` (for code that cannot wrap a block in `use`)."""
    return _CURRENT.set(ctx)


def leave(token: Token[TraceContext | None]) -> None:
    _CURRENT.reset(token)


def inject(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """`headers` with the current context's traceparent added (unchanged outside a request; a traceparent
    already there is kept: the sender chose it)."""
    ctx = _CURRENT.get()
    if ctx is None or (headers is not None and TRACEPARENT in headers):
        return dict(headers) if headers is not None else None
    out = dict(headers) if headers is not None else {}
    out[TRACEPARENT] = ctx.traceparent
    return out


# --- spans -------------------------------------------------------------------------------------------------


class ExportedSpan(Protocol):
    """A span an exporter records: its own context (the next hop's parent), attributes, an error, its end."""

    @property
    def context(self) -> TraceContext: ...

    def set(self, key: str, value: Any) -> None: ...

    def fail(self, error: str) -> None: ...

    def rename(self, name: str) -> None: ...

    def end(self) -> None: ...


class SpanExporter(Protocol):
    """What `install` takes: starts spans (runtime/otlp.py: the OpenTelemetry SDK and its OTLP exporter)."""

    def start(
        self, name: str, parent: TraceContext | None, kind: SpanKind, attributes: Mapping[str, Any]
    ) -> ExportedSpan: ...

    def shutdown(self, timeout_s: float) -> None: ...


_EXPORTER: SpanExporter | None = None


def install(exporter: SpanExporter) -> None:
    """Exports every hop's span from now on (one exporter per process: the node's)."""
    global _EXPORTER
    _EXPORTER = exporter


def uninstall() -> SpanExporter | None:
    """Stops exporting; returns the exporter that was installed (for its shutdown)."""
    global _EXPORTER
    exporter, _EXPORTER = _EXPORTER, None
    return exporter


def exporting() -> bool:
    return _EXPORTER is not None


class Hop:
    """The span of one hop, as its code sees it: attributes to add (kept only when exported) and a failure."""

    __slots__ = ("_span", "context")

    def __init__(self, context: TraceContext | None, span: ExportedSpan | None) -> None:
        self.context = context
        self._span = span

    @property
    def recording(self) -> bool:
        """Whether attributes are kept (compute costly ones only then)."""
        return self._span is not None

    def update(self, attributes: Mapping[str, Any]) -> None:
        """Adds attributes to the span (None values left out; sequences as lists of strings)."""
        if self._span is not None:
            for key, value in attributes.items():
                self._set(key, value)

    def _set(self, key: str, value: Any) -> None:
        assert self._span is not None
        if value is None:
            return
        if isinstance(value, list | tuple):
            value = [str(v) for v in value]
        elif not isinstance(value, str | bool | int | float):
            value = str(value)
        self._span.set(key, value)

    def fail(self, error: str) -> None:
        if self._span is not None:
            self._span.fail(error)

    def rename(self, name: str) -> None:
        """The span's name, once the hop knows it (the model a request names is in its body)."""
        if self._span is not None:
            self._span.rename(name)


_NOTHING: Final = Hop(None, None)  # the hop of work outside any trace


@contextlib.contextmanager
def hop(name: str, *, kind: SpanKind = "server", attributes: Mapping[str, Any] | None = None) -> Iterator[Hop]:
    """Runs the block as one hop of the current trace: a child span, the current context inside. Exported when
    an exporter is installed; an exception escaping the block marks it failed. Outside any trace (work no
    request asked for, or tracing off) the block runs as it is."""
    parent = _CURRENT.get()
    if parent is None:  # outside any request (or tracing is off): no trace to add a hop to
        yield _NOTHING
        return
    exporter = _EXPORTER
    span = exporter.start(name, parent, kind, attributes or {}) if exporter is not None else None
    ctx = span.context if span is not None else child(parent)
    token = _CURRENT.set(ctx)
    handle = Hop(ctx, span)
    try:
        yield handle
    except BaseException as exc:
        handle.fail(f"{type(exc).__name__}: {exc}"[:500])
        raise
    finally:
        _CURRENT.reset(token)
        if span is not None:
            span.end()


# --- GenAI semantic-convention names (OpenTelemetry semconv, gen_ai.*) ---------------------------------------

#: What the mesh's spans call the engine (`gen_ai.provider.name`).
PROVIDER: Final = "llama.cpp"

_OPERATIONS: Final = {
    "chat": "chat",
    "messages": "chat",
    "responses": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}

_FINISH: Final = {"eos": "stop", "stop_word": "stop", "limit": "length", "cancelled": "cancelled"}


def operation(endpoint: str | None) -> str:
    """`gen_ai.operation.name` of a pass-through endpoint (None: a prompt generation, a text completion)."""
    if endpoint is None:
        return "text_completion"
    return _OPERATIONS.get(endpoint, endpoint)


def model_name(model: str) -> str:
    """How spans name a model: as the client named it, or a model file by its file name (not its path)."""
    return model.rsplit("/", 1)[-1]


def request_attributes(endpoint: str | None, model: str) -> dict[str, Any]:
    """The GenAI attributes known when a request arrives; the span's name is `{operation} {model}`."""
    return {
        "gen_ai.operation.name": operation(endpoint),
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": model_name(model),
    }


def result_attributes(result: Any) -> dict[str, Any]:
    """The GenAI attributes of a `GenerateResult` (usage, finish reason, the instance that answered), with the
    mesh's own (`mesh.*`: where the prefix came from, what was restored, how it was routed)."""
    return {
        "gen_ai.response.id": result.request_id,
        "gen_ai.usage.input_tokens": result.prompt_tokens,
        "gen_ai.usage.output_tokens": result.tokens_generated,
        "gen_ai.response.finish_reasons": [_FINISH.get(result.stop_reason, str(result.stop_reason))],
        "mesh.node": result.node,
        "mesh.instance": result.instance,
        "mesh.prefix.source": result.source,
        "mesh.tokens.cached": result.tokens_cached,
        "mesh.tokens.restored": result.tokens_restored,
        "mesh.path": result.path,
    }
