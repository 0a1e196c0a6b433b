"""Trace context (runtime/tracing.py): W3C traceparent parsed and formatted by OpenTelemetry's propagator, the
current context of a request, what requests carry, and each hop's span id; hostile headers never pass on."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from messages.events import ActorStarted, AnyEvent, Event
from messages.subjects import Subjects
from runtime import otlp, tracing
from runtime.bus import encode
from runtime.config import ConfigError, load_config
from runtime.journal import Journal

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
W3C = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def test_a_valid_traceparent_is_parsed_and_formatted_back_the_same() -> None:
    ctx = tracing.parse(CLIENT)
    assert ctx is not None
    assert ctx.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736 and ctx.span_id == 0x00F067AA0BA902B7
    assert ctx.sampled and not ctx.origin
    assert ctx.traceparent == CLIENT
    assert ctx.trace_hex == "4bf92f3577b34da6a3ce929d0e0e4736"
    unsampled = tracing.parse(CLIENT[:-2] + "00")
    assert unsampled is not None and not unsampled.sampled


HOSTILE = [
    "",
    "x" * 10_000,  # too long (refused before the propagator, which would log each one)
    CLIENT + "-" + "a" * 600,
    "ff" + CLIENT[2:],  # version ff is invalid
    "0g" + CLIENT[2:],  # not hex
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero span id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # uppercase
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 has exactly four fields
    "00-zzf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
    "\x00\n" + CLIENT,
]


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_a_malformed_traceparent_is_refused_and_replaced_by_a_fresh_trace(value: str) -> None:
    assert tracing.parse(value) is None
    ctx = tracing.incoming({tracing.TRACEPARENT: value})
    assert ctx is not None and ctx.origin and W3C.match(ctx.traceparent)
    assert not value or value not in ctx.traceparent


def test_an_absent_traceparent_starts_a_fresh_trace_each_time() -> None:
    first, second = tracing.incoming(None), tracing.incoming({})
    assert first is not None and second is not None
    assert first.trace_id != second.trace_id and first.origin and first.sampled
    given_ctx = tracing.incoming({tracing.TRACEPARENT: CLIENT})
    assert given_ctx is not None and given_ctx.traceparent == CLIENT


@given(st.text(max_size=120) | st.from_regex(r"\A[0-9a-fA-F-]{50,60}\Z"))
def test_no_header_value_crashes_the_parser_and_what_it_accepts_is_w3c(value: str) -> None:
    ctx = tracing.parse(value)
    if ctx is not None:
        assert W3C.match(ctx.traceparent)
        assert tracing.parse(ctx.traceparent) == ctx


def test_ids_must_be_nonzero_and_in_range() -> None:
    for trace_id, span_id in ((0, 1), (1, 0), (1 << 128, 1), (1, 1 << 64)):
        with pytest.raises(ValueError):
            tracing.context(trace_id, span_id)


def test_requests_carry_the_current_context_and_nothing_outside_one() -> None:
    assert tracing.current() is None and tracing.traceparent() == ""
    assert tracing.inject(None) is None
    assert tracing.inject({"a": "b"}) == {"a": "b"}
    ctx = tracing.parse(CLIENT)
    with tracing.use(ctx):
        assert tracing.current() is ctx and tracing.traceparent() == CLIENT
        assert tracing.inject(None) == {tracing.TRACEPARENT: CLIENT}
        assert tracing.inject({"a": "b"}) == {"a": "b", tracing.TRACEPARENT: CLIENT}
        chosen = {tracing.TRACEPARENT: "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
        assert tracing.inject(chosen) == chosen  # the sender's own is kept
        with tracing.use(None):
            assert tracing.inject(None) is None
    assert tracing.current() is None


def test_a_hop_is_a_child_span_of_its_trace_and_ends_with_its_block() -> None:
    parent = tracing.parse(CLIENT)
    with tracing.use(parent):
        with tracing.hop("route alpha") as span:
            inner = tracing.current()
            assert inner is not None and inner is span.context
            assert inner.trace_id == parent.trace_id if parent else False
            assert inner.span_id != parent.span_id if parent else False
            assert inner.flags == 1 and not span.recording  # no exporter: nothing kept
            span.update({"gen_ai.request.model": "alpha"})  # a no-op, never an error
            with tracing.hop("l3 restore", kind="internal"):
                nested = tracing.current()
                assert nested is not None and nested.trace_id == inner.trace_id and nested.span_id != inner.span_id
            assert tracing.current() is inner
        assert tracing.current() is parent
        with pytest.raises(KeyError), tracing.hop("failing"):
            raise KeyError("x")
        assert tracing.current() is parent


def test_a_hop_outside_any_trace_adds_nothing() -> None:
    with tracing.hop("probe") as span:
        assert tracing.current() is None and span.context is None


def test_a_node_with_tracing_off_starts_no_trace() -> None:
    tracing.set_enabled(False)
    try:
        assert tracing.incoming({tracing.TRACEPARENT: CLIENT}) is None
    finally:
        tracing.set_enabled(True)


async def test_tasks_spawned_within_a_request_inherit_its_trace() -> None:
    ctx = tracing.parse(CLIENT)
    seen: list[str] = []

    async def later() -> None:
        await asyncio.sleep(0)
        seen.append(tracing.traceparent())

    with tracing.use(ctx):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(later())
    async with asyncio.TaskGroup() as tg:
        tg.create_task(later())
    assert seen == [CLIENT, ""]


def test_events_record_the_trace_of_the_request_they_are_recorded_for() -> None:
    journal = Journal(None, Subjects(), "node-a")  # type: ignore[arg-type]  # `new` never touches the bus
    assert journal.new(ActorStarted, "router", attempt=1).trace == ""
    with tracing.use(tracing.parse(CLIENT)):
        event = journal.new(ActorStarted, "router", attempt=1)
    assert event.trace == CLIENT
    decoded = msgspec.json.decode(encode(event), type=AnyEvent)
    assert isinstance(decoded, Event) and decoded.trace == CLIENT


def test_an_event_written_before_trace_existed_reads_with_no_trace() -> None:
    old = b'{"type":"actor_started","id":"e1","time":1.0,"node":"n","actor":"router","attempt":1}'
    event = msgspec.json.decode(old, type=AnyEvent)
    assert isinstance(event, ActorStarted) and event.trace == ""


def test_genai_names_of_the_pass_through_endpoints() -> None:
    assert tracing.operation("chat") == tracing.operation("messages") == "chat"
    assert tracing.operation("completions") == tracing.operation(None) == "text_completion"
    assert tracing.operation("embeddings") == "embeddings"
    attributes = tracing.request_attributes("chat", "alpha")
    assert attributes == {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "llama.cpp",
                          "gen_ai.request.model": "alpha"}  # fmt: skip


def test_without_otlp_no_sdk_is_imported() -> None:
    """The node's own modules, a request's context and its hops load no OpenTelemetry SDK (only the API's
    propagator); the SDK is imported by `runtime/otlp.start_exporter` alone."""
    code = (
        "import sys, runtime.cli, runtime.launcher, runtime.otlp\n"
        "from runtime import tracing\n"
        "with tracing.use(tracing.incoming(None)), tracing.hop('x') as h: assert not h.recording\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_otlp_and_metrics_options_are_checked_when_the_node_starts(tmp_path: Path) -> None:
    config = load_config({"data_dir": str(tmp_path), "otlp": "http://127.0.0.1:4318"}, env={})
    assert (config.otlp, config.metrics_on, config.trace_on) == ("http://127.0.0.1:4318", True, True)
    assert load_config({"data_dir": str(tmp_path)}, env={"MESH_ACTOR_OTLP": "https://c:4318"}).otlp == "https://c:4318"
    assert load_config({"data_dir": str(tmp_path)}, env={}).otlp is None
    for bad in ("ftp://collector", "collector:4318", "http://"):
        with pytest.raises(ConfigError, match="OTLP"):
            load_config({"data_dir": str(tmp_path), "otlp": bad}, env={})
    with pytest.raises(ConfigError, match="--no-metrics"):
        load_config({"data_dir": str(tmp_path), "metrics": "9100", "metrics_on": False}, env={})
    assert not load_config({"data_dir": str(tmp_path), "metrics_on": False}, env={}).metrics_on


def test_the_collectors_traces_endpoint_from_its_base_url_or_itself() -> None:
    assert otlp.traces_endpoint("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp.traces_endpoint("http://c:4318/") == "http://c:4318/v1/traces"
    assert otlp.traces_endpoint("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError):
        otlp.traces_endpoint("c:4318")
