"""One request's trace across two real nodes: its journal events and its exported spans.

`mesh-actor run` twice on one bus (real nats-server, embedded by the first), each with `--otlp` pointing at a real
OTLP/HTTP receiver (tests/otlp_receiver.py), a real llama-server on a generated tiny model. Node A runs the front
door with too little memory for the model, so the request's model is loaded on demand on node B: its events are
recorded on both nodes (the front door's model loading on A, the routing and the generation wherever they ran),
and every one of them carries the client's trace id; the spans of the front door (A), the routing and the
generation (B) form one trace under the client's span, with the GenAI names. A NATS client calling
`mesh.generate` directly with its own `traceparent` sees it on that request's events (its capture into L3
included), and a malformed header becomes a fresh trace, never the client's text. A prefill on another node and
its handoff, and a prefix fetched from a peer's store, are hops of the same trace.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.aio.msg import Msg

from messages.generate import GenerateRequest, GenerateResult
from runtime.bus import Bus, decode
from runtime.children import free_port
from runtime.config import NatsOptions
from tests.harness.frontdoor import KEY, KEYED, QUIET, write_catalog
from tests.harness.generate import gen, wait_captured, wait_ready
from tests.harness.nodes import cli, events_of, nats_env, need, node, wait_nodes
from tests.llama_harness import require_server
from tests.otlp_receiver import ReceivedSpan, otlp_receiver
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FRONT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
FRONT_SPAN = "00f067aa0ba902b7"
NATS_TRACE = "0af7651916cd43dd8448eb211c80319c"
PROMPT = [1 + (i * 7) % 250 for i in range(300)]  # over the capture threshold: its state goes into L3
OTEL = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # the SDK's batches leave every 0.2 s, not 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_server()
    return write_llama(tmp_path_factory.mktemp("tracing-models") / "alpha.gguf")


def trace_of(event: dict[str, Any]) -> str:
    trace = str(event.get("trace", ""))
    return trace.split("-")[1] if trace.count("-") == 3 else ""


async def events_until(data_dir: Path, done: Any, timeout_s: float = 30) -> list[dict[str, Any]]:
    """The journal, read again until `done` says the events looked for are in (they are published async)."""
    async with asyncio.timeout(timeout_s):
        while True:
            events = await events_of(data_dir)
            if done(events):
                return events
            await asyncio.sleep(0.3)


async def chat(port: int, traceparent: str) -> dict[str, Any]:
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}", "traceparent": traceparent}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
        session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers) as reply,
    ):
        assert reply.status == 200, await reply.text()
        answer: dict[str, Any] = await reply.json()
        return answer


def one(spans: list[ReceivedSpan], **fields: Any) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in fields.items())]
    assert len(found) == 1, (fields, [(s.name, s.trace_id) for s in spans])
    return found[0]


async def answering_inbox(bus: Bus) -> str:
    """What a raw NATS client names as a generation's `stream`: an inbox of its own that answers the pings."""
    subject = bus.nc.new_inbox()

    async def answer(msg: Msg) -> None:
        if msg.reply:
            await msg.respond(b"")

    await bus.nc.subscribe(subject, cb=answer)
    return subject


async def test_one_requests_traceparent_is_on_each_of_its_journal_events_across_two_nodes(
    tmp_path: Path, model: Path
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    write_catalog(first, {"alpha": {"path": str(model), "ctx": 2048}})
    port = free_port()
    too_little = str(need(model, 2, 2048) // 2)  # node A cannot hold the model: it is loaded on node B
    async with otlp_receiver() as receiver:
        flags = ("--otlp", receiver.url, *QUIET)
        async with node(first, "node-a", *flags, "--http", str(port), "--memory-limit", too_little,
                        env={**KEYED, **OTEL}):  # fmt: skip
            env = await nats_env(first)
            async with node(second, "node-b", *flags, env={**env, **OTEL}):
                await wait_nodes(first, "node-a", "node-b")

                # --- through the front door, with the client's traceparent -----------------------------
                answer = await chat(port, f"00-{FRONT_TRACE}-{FRONT_SPAN}-01")
                usage = answer["usage"]
                events = await events_until(
                    first, lambda es: {"model_loaded", "generate_completed"} <= {e["type"] for e in es
                                                                                 if trace_of(e) == FRONT_TRACE},
                )  # fmt: skip
                traced = [e for e in events if trace_of(e) == FRONT_TRACE]
                (request_id,) = {e["request_id"] for e in traced if "request_id" in e}
                of_request = [e for e in events if e.get("request_id") == request_id]
                assert {e["type"] for e in of_request} >= {"generate_routed", "generate_completed"}
                assert all(trace_of(e) == FRONT_TRACE for e in of_request), of_request
                assert {e["type"] for e in traced} >= {"model_loading", "model_loaded", "placement_decided",
                                                       "generate_routed", "generate_completed"}  # fmt: skip
                assert {e["node"] for e in traced} == {"node-a", "node-b"}
                loaded = next(e for e in traced if e["type"] == "model_loaded")
                completed = next(e for e in of_request if e["type"] == "generate_completed")
                assert (loaded["node"], loaded["instance_node"], completed["node"]) == ("node-a", "node-b", "node-b")
                code, out, err = await cli("events", "--json", "--trace", FRONT_TRACE, "--data-dir", str(first))
                assert code == 0, err
                assert len(out.splitlines()) == len(traced)  # what an operator asks for: one trace's events

                # its spans: the front door on A under the client's span, then routing, then generation on B
                spans = await receiver.wait_for(
                    lambda ss: {"chat alpha", "chat alpha.gguf"} <= {s.name for s in ss if s.trace_id == FRONT_TRACE}
                )
                spans = [s for s in spans if s.trace_id == FRONT_TRACE]
                front = one(spans, name="chat alpha")
                assert (front.kind, front.parent_span_id, front.resource["service.instance.id"]) == (
                    "SERVER",
                    FRONT_SPAN,
                    "node-a",
                )
                assert front.attributes["gen_ai.operation.name"] == "chat"
                assert front.attributes["gen_ai.request.model"] == "alpha"
                assert front.attributes["gen_ai.provider.name"] == "llama.cpp"
                assert front.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
                assert front.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4
                assert front.attributes["gen_ai.response.finish_reasons"] == ["length"]
                assert front.attributes["http.response.status_code"] == 200
                routed = one(spans, name="route alpha.gguf")
                assert routed.parent_span_id == front.span_id
                generated = one(spans, name="chat alpha.gguf")
                assert (generated.kind, generated.parent_span_id) == ("CLIENT", routed.span_id)
                assert generated.resource["service.instance.id"] == "node-b"
                assert generated.attributes["gen_ai.usage.output_tokens"] == 4
                assert generated.attributes["mesh.node"] == "node-b"
                assert completed["trace"].split("-")[2] == generated.span_id  # the event names its hop

                # --- a NATS client on mesh.generate, with its own traceparent header -------------------
                options = NatsOptions(urls=(env["MESH_ACTOR_NATS"],), user=env["MESH_ACTOR_NATS_USER"],
                                      password=env["MESH_ACTOR_NATS_PASSWORD"])  # fmt: skip
                bus = await Bus.connect(options, name="tracing-test")
                try:
                    pings = await answering_inbox(bus)
                    order = GenerateRequest(
                        model="alpha", prompt=PROMPT, n_predict=4, timeout_s=60, stream=pings, chunks=False
                    )
                    reply = await bus.nc.request(
                        "mesh.generate", msgspec.json.encode(order), timeout=75,
                        headers={"traceparent": f"00-{NATS_TRACE}-b7ad6b7169203331-01"},
                    )  # fmt: skip
                    result = decode(reply.data, GenerateResult)
                    malformed = await bus.nc.request(
                        "mesh.generate", msgspec.json.encode(msgspec.structs.replace(order, prompt=PROMPT[:20])),
                        timeout=75, headers={"traceparent": f"ff-{NATS_TRACE}-b7ad6b7169203331-01"},
                    )  # fmt: skip
                    bad = decode(malformed.data, GenerateResult)
                finally:
                    await bus.close()
                assert result.node == "node-b"
                events = await events_until(
                    first, lambda es: any(e["type"] == "l3_captured" and trace_of(e) == NATS_TRACE for e in es)
                    and any(e.get("request_id") == bad.request_id and e["type"] == "generate_completed" for e in es),
                )  # fmt: skip
                of_request = [e for e in events if e.get("request_id") == result.request_id]
                assert {e["type"] for e in of_request} >= {"generate_routed", "generate_completed"}
                assert all(trace_of(e) == NATS_TRACE for e in of_request), of_request
                captured = [e for e in events if e["type"] == "l3_captured" and trace_of(e) == NATS_TRACE]
                assert {e["node"] for e in captured} == {"node-b"}
                of_bad = [e for e in events if e.get("request_id") == bad.request_id]
                fresh = {trace_of(e) for e in of_bad}
                assert len(fresh) == 1 and fresh.isdisjoint({"", NATS_TRACE, FRONT_TRACE}), of_bad
                spans = await receiver.wait_for(  # each node exports its spans in batches of its own
                    lambda ss: (
                        {"route alpha", "text_completion alpha", "l3 capture"}
                        <= {s.name for s in ss if s.trace_id == NATS_TRACE}
                    )
                )
                nats_spans = [s for s in spans if s.trace_id == NATS_TRACE]
                routed = one(nats_spans, name="route alpha")
                assert routed.parent_span_id == "b7ad6b7169203331"
                generated = one(nats_spans, name="text_completion alpha")
                assert generated.parent_span_id == routed.span_id
                assert generated.attributes["gen_ai.usage.input_tokens"] == len(PROMPT)
                assert generated.attributes["gen_ai.request.max_tokens"] == 4
                captures = [s for s in nats_spans if s.name == "l3 capture"]  # the answer's state, and the prompt's
                assert {s.resource["service.instance.id"] for s in captures} == {"node-b"}
                assert {s.parent_span_id for s in captures} == {generated.span_id}

                # --- the CLI: a trace of its own, or the one it is given ----------------------------------
                given = "00-6e0c63257de34c926f9efcd03899c6a1-1111111111111111-01"
                code, out, err = await cli("generate", "alpha", "hi", "-n", "2", "--json", "--traceparent", given,
                                           "--data-dir", str(first))  # fmt: skip
                assert code == 0, err
                reply_json = json.loads(out)
                assert reply_json["trace"] == given
                code, out, err = await cli("generate", "alpha", "hi", "-n", "2", "--data-dir", str(first))
                assert code == 0 and " trace " in err, err
                own = err.rsplit(" trace ", 1)[1].strip()
                events = await events_until(
                    first, lambda es: sum(e["type"] == "generate_completed" and trace_of(e) in (own, given[3:35])
                                          for e in es) == 2,
                )  # fmt: skip
                of_cli = [e for e in events if e.get("request_id") == reply_json["request_id"]]
                assert of_cli and all(trace_of(e) == given[3:35] for e in of_cli)
                code, _, err = await cli("generate", "alpha", "hi", "--traceparent", "ff-bad", "--data-dir", str(first))
                assert code == 2 and "traceparent" in err, err


async def test_a_prefill_elsewhere_and_its_handoff_are_hops_of_the_requests_trace(tmp_path: Path, model: Path) -> None:
    """Prefill on node B, decode on node A: B's prefill and its handoff's send, A's receive, the L3 restore and the
    generation are spans of the client's trace, and the events they record carry it."""
    first, second = tmp_path / "a", tmp_path / "b"
    handoff_trace = "5d0c0a7a1f6e4b2c9a8b7c6d5e4f3a2b"
    async with otlp_receiver() as receiver:
        flags = ("--otlp", receiver.url, *QUIET)
        async with node(first, "node-a", *flags, env=OTEL):
            env = await nats_env(first)
            async with node(second, "node-b", *flags, env={**env, **OTEL}):
                await wait_nodes(first, "node-a", "node-b")
                for node_id in ("node-a", "node-b"):
                    code, out, err = await cli(
                        "place", str(model), "-c", "2048", "--node", node_id, "--start", "--json", env=env
                    )
                    assert code == 0, err + out
                    await wait_ready(first, json.loads(out)["instance"]["instance_id"])
                options = NatsOptions(urls=(env["MESH_ACTOR_NATS"],), user=env["MESH_ACTOR_NATS_USER"],
                                      password=env["MESH_ACTOR_NATS_PASSWORD"])  # fmt: skip
                bus = await Bus.connect(options, name="tracing-test")
                try:
                    order = GenerateRequest(model="alpha", prompt=PROMPT, n_predict=4, timeout_s=60, capture=False,
                                            prefill_node="node-b", stream=await answering_inbox(bus),
                                            chunks=False)  # fmt: skip
                    reply = await bus.nc.request(
                        "mesh.generate", msgspec.json.encode(order), timeout=75,
                        headers={"traceparent": f"00-{handoff_trace}-b7ad6b7169203331-01"},
                    )  # fmt: skip
                finally:
                    await bus.close()
                result = decode(reply.data, GenerateResult)
                assert (result.path, result.node, result.prefill_node) == ("disaggregated", "node-a", "node-b")
                events = await events_until(
                    first, lambda es: any(e.get("request_id") == result.request_id and e["type"] ==
                                          "generate_completed" for e in es),
                )  # fmt: skip
                traced = [e for e in events if trace_of(e) == handoff_trace]
                assert {e["type"] for e in traced} >= {"generate_routed", "handoff_committed", "generate_completed"}
                assert all(trace_of(e) == handoff_trace for e in events if e.get("request_id") == result.request_id)
                committed = next(e for e in traced if e["type"] == "handoff_committed")
                assert (committed["node"], committed["sender_node"]) == ("node-a", "node-b")
                wanted = {"prefill", "handoff send", "handoff receive", "l3 restore", "text_completion alpha"}
                spans = await receiver.wait_for(
                    lambda ss: wanted <= {s.name for s in ss if s.trace_id == handoff_trace}
                )
                by_name = {s.name: s for s in spans if s.trace_id == handoff_trace}
                node_of = {name: by_name[name].resource["service.instance.id"] for name in wanted}
                assert node_of == {"prefill": "node-b", "handoff send": "node-b", "handoff receive": "node-a",
                                   "l3 restore": "node-a", "text_completion alpha": "node-a"}  # fmt: skip
                generation = by_name["text_completion alpha"]
                assert by_name["prefill"].parent_span_id == generation.span_id
                assert by_name["handoff send"].parent_span_id == by_name["prefill"].span_id
                assert by_name["handoff receive"].parent_span_id == by_name["handoff send"].span_id
                assert by_name["l3 restore"].parent_span_id == generation.span_id
                assert committed["trace"].split("-")[2] == by_name["handoff receive"].span_id


async def test_a_prefix_fetched_from_a_peers_store_is_a_hop_of_the_requests_trace(tmp_path: Path, model: Path) -> None:
    """A prompt whose state node A's store holds, served on node B: B's restore fetches it from A within the
    request's trace (`l3_fetched` carries it; the `l3 fetch` span is the restore's child)."""
    first, second = tmp_path / "a", tmp_path / "b"
    fetch_trace = "7a1b2c3d4e5f60718293a4b5c6d7e8f9"
    async with otlp_receiver() as receiver:
        flags = ("--otlp", receiver.url, *QUIET)
        async with node(first, "node-a", *flags, env=OTEL):
            env = await nats_env(first)
            async with node(second, "node-b", *flags, env={**env, **OTEL}):
                await wait_nodes(first, "node-a", "node-b")
                on_a = await place_on(first, model, "node-a", env)
                cold = await gen(first, model.name, PROMPT, 4)
                assert (cold["node"], cold["source"]) == ("node-a", "cold")
                await wait_captured(first, len(PROMPT) - 1)
                code, _, err = await cli("stop", on_a, "--data-dir", str(first))
                assert code == 0, err
                await place_on(first, model, "node-b", env)
                fetched = await gen(first, model.name, PROMPT, 4, "--traceparent",
                                    f"00-{fetch_trace}-2222222222222222-01")  # fmt: skip
                assert (fetched["node"], fetched["source"]) == ("node-b", "l3_peer"), fetched
                events = await events_until(
                    first, lambda es: any(e["type"] == "l3_fetched" and trace_of(e) == fetch_trace for e in es)
                )
                (l3_fetched,) = [e for e in events if e["type"] == "l3_fetched" and trace_of(e) == fetch_trace]
                assert (l3_fetched["node"], l3_fetched["peer"]) == ("node-b", "node-a")
                spans = await receiver.wait_for(
                    lambda ss: {"l3 restore", "l3 fetch"} <= {s.name for s in ss if s.trace_id == fetch_trace}
                )
                by_name = {s.name: s for s in spans if s.trace_id == fetch_trace}
                restore, fetch = by_name["l3 restore"], by_name["l3 fetch"]
                assert (fetch.kind, fetch.parent_span_id) == ("CLIENT", restore.span_id)
                assert fetch.resource["service.instance.id"] == restore.resource["service.instance.id"] == "node-b"
                assert (fetch.attributes["mesh.l3.peer"], restore.attributes["mesh.l3.source"]) == ("node-a", "l3_peer")
                assert l3_fetched["trace"].split("-")[2] == fetch.span_id


async def place_on(data_dir: Path, model: Path, node_id: str, env: dict[str, str]) -> str:
    code, out, err = await cli("place", str(model), "-c", "2048", "--node", node_id, "--start", "--json", env=env)
    assert code == 0, err + out
    instance_id = str(json.loads(out)["instance"]["instance_id"])
    await wait_ready(data_dir, instance_id)
    return instance_id
