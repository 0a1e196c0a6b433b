"""Trace context over a real nats-server: a client's `traceparent` header reaches every actor its request passes
through (two nodes' supervisors on one bus) and every event they record for it; a malformed one is replaced by a
fresh trace; with an OTLP exporter (the real SDK, a real OTLP/HTTP receiver) each hop is a span of that trace;
`--otlp` without the extra is a clear error at startup."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import msgspec
import pytest

from messages.events import NodeStopped
from runtime import otlp, tracing
from runtime.actor import Actor, ActorContext
from runtime.bus import Bus, decode
from tests.conftest import JournalReader, supervised
from tests.otlp_receiver import otlp_receiver

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


class Ask(msgspec.Struct, frozen=True, kw_only=True):
    tag: str


class Done(msgspec.Struct, frozen=True, kw_only=True):
    traceparent: str


class FrontActor(Actor):
    """Records an event, records another from a task it spawns, and asks the back actor (on another node)."""

    name = "front"

    async def run(self, ctx: ActorContext) -> None:
        async def handle(ask: Ask) -> Done:
            ctx.emit(NodeStopped, reason=f"{ask.tag}:front")
            spawned = asyncio.Event()

            async def later() -> None:
                ctx.emit(NodeStopped, reason=f"{ask.tag}:front-task")
                spawned.set()

            ctx.spawn(later(), "later")
            async with asyncio.timeout(5):
                await spawned.wait()
            with tracing.hop("front hop"):
                return await ctx.bus.request("test.trace.back", ask, Done, timeout=5)

        await ctx.add_endpoint("front", "test.trace.front", Ask, handle, workers=4)


class BackActor(Actor):
    name = "back"

    async def run(self, ctx: ActorContext) -> None:
        async def handle(ask: Ask) -> Done:
            with tracing.hop("back hop", kind="internal"):
                ctx.emit(NodeStopped, reason=f"{ask.tag}:back")
                return Done(traceparent=tracing.traceparent())

        await ctx.add_endpoint("back", "test.trace.back", Ask, handle, workers=4)


async def ask(bus: Bus, tag: str, headers: dict[str, str] | None) -> Done:
    """What any NATS client sends: its own headers (nats-py directly, not our bus)."""
    async with asyncio.timeout(10):
        while True:
            try:
                msg = await bus.nc.request("test.trace.front", msgspec.json.encode(Ask(tag=tag)), timeout=5,
                                           headers=headers)  # fmt: skip
            except Exception:  # not serving yet (no responders)
                await asyncio.sleep(0.05)
                continue
            if not (msg.headers or {}).get("Nats-Service-Error"):
                return decode(msg.data, Done)
            await asyncio.sleep(0.05)


def trace_id(traceparent: str) -> str:
    return traceparent.split("-")[1]


async def events_of(journal_reader: JournalReader, tag: str) -> dict[str, dict[str, object]]:
    found = await journal_reader.wait_for(
        lambda e: e.get("type") == "node_stopped" and str(e.get("reason", "")).startswith(f"{tag}:"), count=3
    )
    return {str(e["reason"]).split(":", 1)[1]: e for e in found}


async def test_a_clients_traceparent_is_on_every_event_of_its_request_across_two_nodes(
    bus: Bus, journal_reader: JournalReader
) -> None:
    async with supervised(bus, [FrontActor()], node_id="node-a"), supervised(bus, [BackActor()], node_id="node-b"):
        done = await ask(bus, "given", {tracing.TRACEPARENT: CLIENT})
        assert trace_id(done.traceparent) == CLIENT_TRACE
        events = await events_of(journal_reader, "given")
        assert {e["node"] for e in events.values()} == {"node-a", "node-b"}
        for where, event in events.items():
            assert trace_id(str(event["trace"])) == CLIENT_TRACE, where
        assert events["front"]["trace"] == events["front-task"]["trace"] == CLIENT  # no hop there: the client's span
        assert events["back"]["trace"] == done.traceparent != CLIENT  # recorded inside the back actor's hop

        for n, hostile in enumerate(["ff" + CLIENT[2:], "x" * 5000, f"00-{'0' * 32}-00f067aa0ba902b7-01", "00-zz"]):
            done = await ask(bus, f"hostile{n}", {tracing.TRACEPARENT: hostile})
            events = await events_of(journal_reader, f"hostile{n}")
            fresh = {trace_id(str(e["trace"])) for e in events.values()}
            assert fresh == {trace_id(done.traceparent)}  # one fresh trace, carried to both nodes
            assert fresh.isdisjoint({CLIENT_TRACE, "0" * 32}) and tracing.parse(done.traceparent) is not None

        done = await ask(bus, "none", None)
        events = await events_of(journal_reader, "none")
        assert {trace_id(str(e["trace"])) for e in events.values()} == {trace_id(done.traceparent)}


async def test_each_hop_is_exported_as_a_span_of_the_clients_trace() -> None:
    async with otlp_receiver() as receiver:
        exporter = otlp.start_exporter(receiver.url, node_id="node-a", version="test")
        tracing.install(exporter)
        try:
            with tracing.use(tracing.parse(CLIENT)), tracing.hop("chat alpha") as front:
                front.update(tracing.request_attributes("chat", "alpha"))
                front.update({"gen_ai.usage.input_tokens": 12, "gen_ai.response.finish_reasons": ["stop"]})
                with tracing.hop("l3 restore", kind="internal"):
                    pass
            origin = tracing.incoming(None)  # a request that came without one: its first hop is the trace's root
            assert origin is not None
            with tracing.use(origin), tracing.hop("route alpha"):
                pass
            with tracing.use(tracing.parse(CLIENT[:-2] + "00")), tracing.hop("unsampled"):
                pass  # the client asked for no sampling: nothing exported
            with pytest.raises(RuntimeError), tracing.use(tracing.parse(CLIENT)), tracing.hop("failing"):
                raise RuntimeError("boom")
        finally:
            assert tracing.uninstall() is exporter
            await asyncio.to_thread(exporter.shutdown, 5.0)
        spans = await receiver.wait_for(lambda spans: len(spans) >= 4)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"chat alpha", "l3 restore", "route alpha", "failing"}
    chat, restore, route = by_name["chat alpha"], by_name["l3 restore"], by_name["route alpha"]
    assert chat.trace_id == restore.trace_id == CLIENT_TRACE
    assert chat.parent_span_id == "00f067aa0ba902b7" and restore.parent_span_id == chat.span_id
    assert (chat.kind, restore.kind) == ("SERVER", "INTERNAL")
    assert chat.attributes == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "llama.cpp", "gen_ai.request.model": "alpha",
        "gen_ai.usage.input_tokens": 12, "gen_ai.response.finish_reasons": ["stop"],
    }  # fmt: skip
    assert chat.resource["service.name"] == "mesh-actor" and chat.resource["service.instance.id"] == "node-a"
    assert route.trace_id == origin.trace_hex and route.parent_span_id == ""  # the root, in the trace events carry
    assert by_name["failing"].status == "STATUS_CODE_ERROR"
    assert by_name["failing"].attributes["error.type"] == "RuntimeError"


def test_otlp_without_the_extra_is_a_clear_error_at_startup(tmp_path: object) -> None:
    """`mesh-actor run --otlp URL` where the SDK is not installed (hidden from this interpreter) stops before
    anything starts, naming the extra to install."""
    code = (
        "import sys\n"
        "sys.modules['opentelemetry.sdk'] = None\n"  # what an environment without the extra looks like to import
        "sys.modules['opentelemetry.exporter'] = None\n"
        "from runtime.cli import main\n"
        f"sys.exit(main(['run', '--data-dir', {str(tmp_path)!r}, '--otlp', 'http://127.0.0.1:4318']))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    assert "mesh-actor[otlp]" in result.stderr and "--otlp" in result.stderr, result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "run", "--data-dir", str(tmp_path), "--otlp", "ftp://collector"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2 and "not an http(s) URL" in result.stderr, result.stderr
