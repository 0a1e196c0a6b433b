"""A responder answers only inboxes: the second wall against the confused deputy of issue 17.

A requester chooses the reply subject of its request. An actor that answered any reply subject would write
its answer, with its own rights, wherever the requester pointed: a bucket key, an event subject. Clients are
kept out of the mesh's subjects by their account (tests/integration/test_roles.py); this is the wall between
the mesh's own users, on every kind of responder: an endpoint (answer and error reply), a subscription's
`bad_request` reply, the micro service's discovery verbs, and a streaming client answering its pings.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg

from messages.generate import STREAM_PING_HEADER, GenerateChunk, GenerateRequest, GenerateResult
from messages.subjects import Subjects
from runtime.actor import Actor, ActorContext
from runtime.bus import Bus, encode, reply_allowed
from runtime.generate_client import generate
from tests.conftest import JournalReader, of_type, supervised

S = Subjects()
ECHO = f"{S.prefix}.test.echo"
NOTES = f"{S.prefix}.test.notes"


class Ping(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    n: int


class Pong(msgspec.Struct, frozen=True, kw_only=True):
    n: int


class Echo(Actor):
    name = "echo"

    def __init__(self) -> None:
        self.handled: list[int] = []

    async def run(self, ctx: ActorContext) -> None:
        await ctx.add_endpoint("echo", ECHO, Ping, self.echo)
        await ctx.subscribe(NOTES, Ping, self.note)

    async def echo(self, ping: Ping) -> Pong:
        self.handled.append(ping.n)
        return Pong(n=ping.n)

    async def note(self, ping: Ping, msg: object) -> None:
        self.handled.append(ping.n)


FORGED = (
    f"$KV.{S.reservations_bucket}.node.n1",  # a ledger
    f"$KV.{S.instances_bucket}.{S.instance_key('n1', 'forged')}",  # an instance record
    S.event("echo", "forged", "n1"),  # the journal
    S.telemetry("n1"),
    "_INBOXX.x",  # a prefix that only looks like an inbox
)


def test_only_inboxes_and_cross_account_replies_are_answerable() -> None:
    for reply in ("_INBOX.client-1.abc.1", "_INBOX.x", "_R_.abc.def"):
        assert reply_allowed(reply), reply
    assert not reply_allowed(None)
    for refused in ("", *FORGED, "_INBOX", "_R_", "_GR_.a.b._INBOX.x", "$JS.ACK.MESH_EVENTS.x"):
        assert not reply_allowed(refused), refused


async def _until_served(bus: Bus) -> None:
    async with asyncio.timeout(10):
        while True:
            try:
                await bus.nc.request(ECHO, encode(Ping(n=0)), timeout=1)
                return
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)


async def test_a_responder_never_answers_a_reply_subject_that_is_not_an_inbox(
    bus: Bus, journal_reader: JournalReader, capfd: pytest.CaptureFixture[str]
) -> None:
    landed: list[str] = []

    async def record(msg: Msg) -> None:
        landed.append(msg.subject)

    for subject in FORGED:
        await bus.nc.subscribe(subject, cb=record)
    actor = Echo()
    async with supervised(bus, [actor]):
        await _until_served(bus)
        for reply in FORGED:
            await bus.nc.publish(ECHO, encode(Ping(n=1)), reply=reply)  # an answer
            await bus.nc.publish(ECHO, b"{not json", reply=reply)  # an error reply
            await bus.nc.publish(NOTES, b"{not json", reply=reply)  # a subscription's bad_request
            for verb in ("PING", "INFO", "STATS"):  # the micro service's discovery
                await bus.nc.publish(f"$SRV.{verb}", b"", reply=reply)
        await bus.nc.publish(ECHO, encode(Ping(n=2)))  # no reply subject at all
        # One worker answers the endpoint in order: once a later request is answered, every one above was handled.
        answer = await bus.nc.request(ECHO, encode(Ping(n=3)), timeout=5)
        assert msgspec.json.decode(answer.data, type=Pong) == Pong(n=3)
        discovered = await bus.nc.request("$SRV.PING.mesh-echo", b"", timeout=5)  # discovery still answers inboxes
        assert b"mesh-echo" in discovered.data
        await bus.nc.flush(timeout=5)
        await asyncio.sleep(0)  # let the callbacks of anything delivered run
        assert landed == []
        # Dropped before any work: the forged and the reply-less requests never reached the handler.
        assert actor.handled == [0, 3]
    events = await journal_reader.wait_for(of_type("actor_stopped", actor="echo"))
    crashes = [e for e in journal_reader.events if e.get("type") in ("actor_crashed", "actor_gave_up")]
    assert not crashes, events
    err = capfd.readouterr().err
    assert err.count('"reply_refused"') >= len(FORGED) * 5, err[-2000:]


async def test_a_streaming_client_answers_its_pings_only_on_inboxes(bus: Bus) -> None:
    """The client side of a streamed generate answers the runner's pings: a pinger that named a bucket key as
    the ping's reply would have had the client write there with the client's rights (an admin's, here)."""
    landed: list[str] = []

    async def record(msg: Msg) -> None:
        landed.append(msg.subject)

    await bus.nc.subscribe(FORGED[0], cb=record)

    async def serve(msg: Msg) -> None:
        stream = json.loads(msg.data)["stream"]
        await bus.nc.publish(stream, b"{}", reply=FORGED[0], headers={STREAM_PING_HEADER: "1"})
        await bus.nc.request(stream, b"{}", timeout=5, headers={STREAM_PING_HEADER: "1"})  # an inbox: answered
        result = GenerateResult(
            request_id="r", text="", tokens=[], prompt_tokens=1, source="cold", tokens_restored=0, tokens_cached=0,
            tokens_evaluated=1, ttft_ms=1.0, total_ms=1.0, node="n1", instance="i", slot=0, stop_reason="limit",
        )  # fmt: skip
        await msg.respond(encode(result))

    await bus.nc.subscribe(S.generate, cb=serve)

    async def on_chunk(chunk: GenerateChunk) -> None:
        return None

    await generate(bus, S, GenerateRequest(model="m", prompt="hi", timeout_s=10), on_chunk)
    await bus.nc.flush(timeout=5)
    await asyncio.sleep(0)
    assert landed == []
