"""OTLP export of the hops' spans (`mesh-actor run --otlp URL`): the OpenTelemetry SDK and its OTLP/HTTP exporter.

Imported only when `--otlp` is given: without it no SDK is loaded (the `otlp` extra need not be installed), and a
hop costs a random span id (`runtime/tracing.py`). With it, each hop is an SDK span whose parent is the context
the hop found, so the spans of one request form one trace across nodes; the SDK's default sampler follows the
parent's sampled flag (a client that sent `-00` gets nothing exported) and samples the traces the mesh starts.
Spans are batched and sent from the SDK's own thread (`BatchSpanProcessor`: its `OTEL_BSP_*` variables apply),
so a slow or absent collector never holds a request; what the collector cannot take is dropped by the SDK.

The URL is the collector's OTLP/HTTP base (`http://collector:4318`) or its traces endpoint (`…/v1/traces`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, Final
from urllib.parse import urlsplit

from runtime import tracing

__all__ = ["OtlpUnavailable", "start_exporter", "traces_endpoint"]

EXTRA: Final = "otlp"
TRACES_PATH: Final = "/v1/traces"


class OtlpUnavailable(RuntimeError):
    """--otlp was given, but the SDK and exporter (the `otlp` extra) are not installed."""


def traces_endpoint(url: str) -> str:
    """The traces endpoint of an OTLP/HTTP collector given by its base URL or by that endpoint itself."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL of an OTLP collector (e.g. http://127.0.0.1:4318)")
    if parts.path.rstrip("/").endswith(TRACES_PATH):
        return url
    return url.rstrip("/") + TRACES_PATH


def start_exporter(url: str, *, node_id: str, version: str) -> tracing.SpanExporter:
    """An exporter sending spans to the collector at `url`. Raises `OtlpUnavailable` without the extra."""
    endpoint = traces_endpoint(url)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise OtlpUnavailable(
            f"--otlp needs the OpenTelemetry SDK and its OTLP exporter: pip install 'mesh-actor[{EXTRA}]' "
            f"({exc.name or exc} is missing)"
        ) from exc
    resource = Resource.create(
        {"service.name": "mesh-actor", "service.version": version, "service.instance.id": node_id}
    )
    # Not the global provider: the node's spans are the node's, and nothing else in the process reports through it.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False, id_generator=_ids())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return _SdkExporter(provider)


#: The trace id a root span about to start must keep: a trace the mesh began for a request that came without one
#: (its events already carry that id), set only around `start_span`.
_ROOT_TRACE: ContextVar[int | None] = ContextVar("otlp_root_trace", default=None)


def _ids() -> Any:
    """The SDK's random ids, but a root span's trace id from `_ROOT_TRACE` when set."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    random_ids = RandomIdGenerator()

    class _Ids:
        def generate_span_id(self) -> int:
            return int(random_ids.generate_span_id())

        def generate_trace_id(self) -> int:
            wanted = _ROOT_TRACE.get()
            return wanted if wanted is not None else int(random_ids.generate_trace_id())

        def is_trace_id_random(self) -> bool:
            return True  # the mesh's own trace ids are random too (`tracing.fresh`)

        def __getattr__(self, name: str) -> Any:  # whatever else a later SDK asks of its id generator
            return getattr(random_ids, name)

    return _Ids()


class _SdkSpan:
    def __init__(self, span: Any) -> None:
        self._span = span
        own = span.get_span_context()
        self.context = tracing.context(own.trace_id, own.span_id, int(own.trace_flags))

    def set(self, key: str, value: Any) -> None:
        self._span.set_attribute(key, value)

    def fail(self, error: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("error.type", error.split(":", 1)[0])
        self._span.set_status(Status(StatusCode.ERROR, error))

    def rename(self, name: str) -> None:
        self._span.update_name(name)

    def end(self) -> None:
        self._span.end()


class _SdkExporter:
    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.context import Context

        self._provider = provider
        self._tracer = provider.get_tracer("mesh-actor")
        self._trace = trace
        self._kinds = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT,
                       "internal": trace.SpanKind.INTERNAL}  # fmt: skip
        self._root = Context()

    def start(
        self, name: str, parent: tracing.TraceContext | None, kind: tracing.SpanKind, attributes: Mapping[str, Any]
    ) -> _SdkSpan:
        trace = self._trace
        context = self._root
        if parent is not None and parent.origin:  # the trace's root span, in the trace the request runs in
            token = _ROOT_TRACE.set(parent.trace_id)
            try:
                return _SdkSpan(
                    self._tracer.start_span(name, context=context, kind=self._kinds[kind], attributes=dict(attributes))
                )
            finally:
                _ROOT_TRACE.reset(token)
        if parent is not None:
            remote = trace.SpanContext(
                trace_id=parent.trace_id, span_id=parent.span_id, is_remote=True,
                trace_flags=trace.TraceFlags(parent.flags),
            )  # fmt: skip
            context = trace.set_span_in_context(trace.NonRecordingSpan(remote), self._root)
        span = self._tracer.start_span(name, context=context, kind=self._kinds[kind], attributes=dict(attributes))
        return _SdkSpan(span)

    def shutdown(self, timeout_s: float) -> None:
        """Sends what is batched (at most `timeout_s`), then stops the SDK's thread."""
        self._provider.force_flush(timeout_millis=int(timeout_s * 1000))
        self._provider.shutdown()
