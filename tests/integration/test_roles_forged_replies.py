"""Issue 30 (F1, F16): a node's credential against the rest of the mesh, on a real nats-server.

A node named reply subjects of its own choosing on JetStream's calls (an API call, a publish's acknowledgement,
a direct get), and JetStream answered there, in its own account: a reply of `$KV.MESH_KEYS.<id>` overwrote a
tenant's key, others wrote another node's records and journal subjects. A push consumer's deliver subject did
the same. And a node could rewrite (or drain) placement's durable consumer, which every node shared. JetStream
now lives in an account of no user (`runtime.roles`): whatever a node names, nothing of it is stored where the
node may not write, and each node's placement follows the journal through a consumer only it may touch.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable

import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from docs.generate_roles import SAMPLES, verdict
from messages.subjects import Subjects
from runtime import buckets
from runtime.actor import Actor, ActorContext
from runtime.bus import Bus
from runtime.embedded import EmbeddedNats
from runtime.journal import ensure_events_stream
from runtime.roles import Role, inbox_prefix, placement_consumer
from tests.conftest import supervised
from tests.harness.nats_roles import connect_when_loaded, issued, server

__all__ = ["server"]  # the fixture, shared with test_roles

S = Subjects()
KEY_ID = "0123456789abcdef"
TARGETS = (  # what the attacker, node n2, may not write: a tenant's key, n1's records, n1's journal subjects
    f"$KV.{S.keys_bucket}.{KEY_ID}",
    f"$KV.{S.nodes_bucket}.n1",
    f"$KV.{S.instances_bucket}.{S.instance_key('n1', 'forged')}",
    S.event("runner", "instance_ready", "n1"),
)
STREAMS = {  # the stream each target would land in
    TARGETS[0]: f"KV_{S.keys_bucket}",
    TARGETS[1]: f"KV_{S.nodes_bucket}",
    TARGETS[2]: f"KV_{S.instances_bucket}",
    TARGETS[3]: S.events_stream,
}


@pytest.fixture
async def admin(server: EmbeddedNats) -> AsyncIterator[Bus]:
    assert server.credentials is not None
    bus = await Bus.connect(server.credentials.options(), name="admin")
    await ensure_events_stream(bus, S, max_age_s=3600, max_bytes=64 << 20)
    for bucket in (buckets.keys, buckets.nodes, buckets.instances, buckets.reservations):
        await bucket(bus, S)
    try:
        yield bus
    finally:
        await bus.close()


def _last(subject: str) -> bytes:
    return json.dumps({"last_by_subj": subject}).encode()


async def _stored(admin: Bus) -> dict[str, int]:
    """How many messages each target holds, once every stream took in what was sent to it before: a marker
    published afterwards to the same stream is acknowledged only after what came first is stored."""
    for stream in STREAMS.values():
        marker = f"$KV.{stream.removeprefix('KV_')}.marker" if stream.startswith("KV_") else S.event("t", "m", "x")
        ack = await admin.js.publish(marker, b"marker", timeout=5)
        assert ack.stream == stream
    counts = {}
    for target, stream in STREAMS.items():
        info = await admin.js.stream_info(stream, subjects_filter=target)
        counts[target] = (info.state.subjects or {}).get(target, 0)
    return counts


async def test_a_nodes_forged_reply_and_deliver_subjects_make_jetstream_store_nothing(
    server: EmbeddedNats, admin: Bus
) -> None:
    keys = await buckets.keys(admin, S)
    revision = await keys.put(KEY_ID, b'{"tenant": "t1"}')
    heard: Counter[str] = Counter()

    async def on_target(msg: Msg) -> None:
        heard[msg.subject] += 1

    for target in TARGETS:  # the admin hears each answer go out, wherever it is stored
        await admin.nc.subscribe(target, cb=on_target)
    await admin.nc.flush(timeout=5)
    creds = issued(server, Role("node", "n2"))
    async with connect_when_loaded(creds) as n2:
        js = n2.nc.jetstream()
        await js.publish(f"$KV.{S.nodes_bucket}.n2", b'{"node_id": "n1"}', timeout=5)  # its own record
        await js.publish(S.event("runner", "instance_ready", "n2"), b'{"node": "n1"}', timeout=5)  # its own event
        calls = (  # JetStream's calls a node may make, each answered once
            ("$JS.API.INFO", b""),
            (f"$JS.API.STREAM.INFO.KV_{S.nodes_bucket}", b""),
            (f"$JS.API.STREAM.CREATE.KV_{S.nodes_bucket}", json.dumps({"name": f"KV_{S.nodes_bucket}"}).encode()),
            (f"$JS.API.STREAM.MSG.GET.KV_{S.nodes_bucket}", _last(f"$KV.{S.nodes_bucket}.n2")),
            # a direct get answers with a stored message: bytes of the requester's choosing
            (f"$JS.API.DIRECT.GET.{S.events_stream}", _last(S.event("runner", "instance_ready", "n2"))),
            (f"$KV.{S.nodes_bucket}.n2", b'{"node_id": "n1"}'),  # a put of its own record: the acknowledgement
            (f"$KV.{S.reservations_bucket}.node.n1", b"{}"),  # a ledger it may book on
            (S.event("runner", "instance_ready", "n2"), b"{}"),  # an event of its own
        )  # fmt: skip
        for subject, body in calls:
            for target in TARGETS:
                await n2.nc.publish(subject, body, reply=target)
        # A push consumer delivering into the targets; and one delivering to n2's inbox, which is what does arrive.
        control = await n2.nc.subscribe(f"{inbox_prefix(creds.user)}.control")
        forged = []
        for deliver in (*TARGETS, control.subject):
            config = ConsumerConfig(
                deliver_subject=deliver, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE
            )
            forged.append(await js.add_consumer(f"KV_{S.reservations_bucket}", config))
        delivered = await control.next_msg(timeout=10)
        assert delivered.subject == f"$KV.{S.reservations_bucket}.node.n1"
        async with asyncio.timeout(10):  # every answer went out (live subscribers hear it: nothing is stored)
            while any(heard[target] < len(calls) for target in TARGETS):
                await asyncio.sleep(0.02)
        assert not n2.errors  # nothing of it was refused: the server let every call through
    assert await _stored(admin) == {**dict.fromkeys(TARGETS, 0), TARGETS[0]: 1}  # the key as the admin issued it
    for info in forged[:-1]:
        consumer = await admin.js.consumer_info(f"KV_{S.reservations_bucket}", info.name)
        assert consumer.delivered.consumer_seq == 0, info.config.deliver_subject  # no one to deliver to
    entry = await keys.get(KEY_ID)
    assert (entry.revision, entry.value) == (revision, b'{"tenant": "t1"}')  # the tenant's key is as issued


async def test_a_node_cannot_change_pull_or_acknowledge_another_nodes_placement_consumer(
    server: EmbeddedNats, admin: Bus
) -> None:
    """F16: every node could rewrite placement's one shared durable (a peer set its filter to
    `mesh.events.nothing.>`). Each node's placement has its own, and only that node's user may touch it."""
    assert server.node_credentials is not None
    n1 = await Bus.connect(server.node_credentials.options(), name="n1")
    stream, theirs = S.events_stream, placement_consumer("n1")
    config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    try:
        await n1.js.pull_subscribe(S.events_of("runner"), durable=theirs, stream=stream, config=config)
        rewrite = {"durable_name": theirs, "name": theirs, "filter_subject": f"{S.prefix}.events.nothing.>",
                   "ack_policy": "explicit"}  # fmt: skip
        attempts = (
            (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{theirs}", rewrite),
            (f"$JS.API.CONSUMER.CREATE.{stream}.{theirs}.{S.prefix}.events.nothing.>", rewrite),
            (f"$JS.API.CONSUMER.CREATE.{stream}.{theirs}", rewrite),
            (f"$JS.API.CONSUMER.CREATE.{stream}", {**rewrite, "durable_name": None}),  # named in the body only
            (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{theirs}", {"batch": 16, "expires": 1_000_000_000}),
            (f"$JS.ACK.{stream}.{theirs}.1.1.1.0.0", None),
        )
        creds = issued(server, Role("node", "n2"))
        async with connect_when_loaded(creds) as n2:
            for subject, body in attempts:
                payload = json.dumps({"stream_name": stream, "config": body} if "CREATE" in subject else body or {})
                await n2.nc.publish(subject, payload.encode(), reply=f"{inbox_prefix(creds.user)}.x")
                await n2.refused(subject)
            # Its own placement's consumer is its to create and pull from.
            n2_bus = n2.nc.jetstream()
            own = await n2_bus.pull_subscribe(
                S.events_of("runner"), durable=placement_consumer("n2"), stream=stream, config=config
            )
            await n2_bus.publish(S.event("runner", "instance_stopped", "n2"), b"{}", timeout=5)
            (event,) = await own.fetch(1, timeout=5)
            await event.ack_sync(timeout=5)
        kept = await admin.js.consumer_info(stream, theirs)
        assert kept.config.filter_subject == S.events_of("runner")
        assert kept.num_waiting == 0 and kept.num_pending == 1  # n2's event waits for n1, undrained
    finally:
        await n1.close()


async def test_a_nodes_forged_reply_cannot_acknowledge_another_nodes_delivery(server: EmbeddedNats, admin: Bus) -> None:
    """A reply subject is a publish target too: a node that names another node's acknowledgement subject as the
    reply of a call it may make (JetStream would answer there, and any answer acknowledges) is refused by the
    server, and the delivery stays unacknowledged for its owner."""
    assert server.node_credentials is not None
    n1 = await Bus.connect(server.node_credentials.options(), name="n1")
    stream, theirs = S.events_stream, placement_consumer("n1")
    config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    try:
        pulled = await n1.js.pull_subscribe(S.events_of("runner"), durable=theirs, stream=stream, config=config)
        await n1.js.publish(S.event("runner", "instance_stopped", "n1"), b"{}", timeout=5)
        (delivery,) = await pulled.fetch(1, timeout=5)
        assert delivery.reply.startswith(f"$JS.ACK.{stream}.{theirs}.")
        async with connect_when_loaded(issued(server, Role("node", "n2"))) as n2:
            for call in ("$JS.API.INFO", f"$JS.API.STREAM.INFO.KV_{S.nodes_bucket}"):
                await n2.nc.publish(call, b"", reply=delivery.reply)
            await n2.refused(delivery.reply, "publish with reply of")
        kept = await admin.js.consumer_info(stream, theirs)
        assert kept.num_ack_pending == 1 and kept.ack_floor.stream_seq == 0  # still n1's to acknowledge
        await delivery.ack_sync(timeout=5)
        assert (await admin.js.consumer_info(stream, theirs)).num_ack_pending == 0
    finally:
        await n1.close()


async def test_the_old_shared_placement_consumer_is_no_nodes_to_touch(server: EmbeddedNats, admin: Bus) -> None:
    """The durable every placement shared before (`placement-reservations`) may still exist: no node may change
    or pull it any more."""
    stream = S.events_stream
    async with connect_when_loaded(issued(server, Role("node", "n2"))) as n2:
        for subject in (
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.placement-reservations",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.placement-reservations",
        ):
            with pytest.raises(nats.errors.Error):
                await n2.nc.request(subject, b"{}", timeout=1)
            await n2.refused(subject)


async def test_the_sample_verdicts_of_docs_roles_md_are_the_servers(server: EmbeddedNats) -> None:
    """docs/roles.md shows a sample of each role's denials (and allowances), derived from `runtime.roles`; the
    server refuses each denial and none of the allowances."""
    assert server.node_credentials is not None and server.node_credentials.user == "node-n1"  # as the file shows
    for role, creds in (("node:n1", server.node_credentials), ("client", issued(server, Role("client")))):
        samples = [(right, subject) for named, right, subject in SAMPLES if named == role]
        denied = [(right, subject) for right, subject in samples if not verdict(role, right, subject)]
        assert denied and len(denied) < len(samples)
        async with connect_when_loaded(creds) as session:
            for right, subject in sorted(samples, key=lambda sample: sample in denied):  # the allowed ones first
                if right == "publish":
                    await session.nc.publish(subject, b"{}")
                else:
                    await session.nc.subscribe(subject)
            for right, subject in denied:  # the server answers in order: the allowed ones passed before these
                await session.refused(subject, "publish to" if right == "publish" else "subscription to")
            assert len(session.errors) == len(denied), session.errors


async def test_a_live_subscriber_drops_jetstreams_answer_a_node_aimed_at_its_subject(
    server: EmbeddedNats, admin: Bus
) -> None:
    """What nats-server still lets through: a node's direct get with the reply subject `events.…n1` makes the
    answer (a stored message of the node's choosing) reach that subject's live subscribers, though nothing is
    stored. An actor's subscription drops such an answer (it carries JetStream's `Nats-Stream` header, no publish
    does) and hears the real publishes."""
    subject = S.event("runner", "instance_ready", "n1")
    heard: list[bytes] = []
    raw: list[Msg] = []

    class Listener(Actor):
        name = "listener"

        async def run(self, ctx: ActorContext) -> None:
            async def on_event(message: msgspec.Raw, msg: Msg) -> None:
                heard.append(bytes(message))

            await ctx.subscribe(subject, msgspec.Raw, on_event)

    async def until(done: Callable[[], bool], publish: bytes | None = None) -> None:
        async with asyncio.timeout(10):
            while not done():
                if publish is not None:
                    await admin.nc.publish(subject, publish)
                await asyncio.sleep(0.02)

    async def on_raw(msg: Msg) -> None:
        raw.append(msg)

    await admin.nc.subscribe(subject, cb=on_raw)
    creds = issued(server, Role("node", "n2"))
    async with supervised(admin, [Listener()], node_id="n1"), connect_when_loaded(creds) as n2:
        await until(lambda: bool(heard), b'{"genuine": 0}')  # the listener hears its subject
        await n2.nc.jetstream().publish(S.event("runner", "instance_ready", "n2"), b'{"forged": 1}', timeout=5)
        await n2.nc.publish(
            f"$JS.API.DIRECT.GET.{S.events_stream}", _last(S.event("runner", "instance_ready", "n2")), reply=subject
        )
        await until(lambda: any(m.data == b'{"forged": 1}' for m in raw))  # the answer went out to the subject
        await admin.nc.publish(subject, b'{"genuine": 1}')  # after it, on the same subject
        await until(lambda: b'{"genuine": 1}' in heard)
    assert b'{"forged": 1}' not in heard and heard[-1] == b'{"genuine": 1}', heard
