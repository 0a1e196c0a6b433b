"""Two handoff actors on a real nats-server: a multi-segment transfer committed byte for byte, streamed and
from a file; the fault matrix (driven by hand through the bus), each aborting cleanly with nothing restored and
the staging freed; malformed messages answered with structured errors while the actor keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.handoff import sender as tx
from actors.handoff.actor import CommittedHandoff, HandoffActor, HandoffFailed
from actors.handoff.probe import PROBE_IDENTITY
from actors.handoff.restore import into_l3
from actors.l3 import layout
from actors.l3.actor import L3Actor
from actors.l3.layout import SegmentRef
from messages.errors import BAD_REQUEST, BUSY, NOT_FOUND
from messages.handoff import (
    CreditGrant,
    HandoffAbort,
    HandoffCommit,
    HandoffOpened,
    HandoffResult,
    LinkProbe,
    LinkProbeResult,
    SessionAborted,
)
from runtime.bus import Bus, RemoteError, encode, parse_reply
from tests.conftest import JournalReader, NatsServer, of_type, supervised
from tests.harness.handoff import FAST, IDENTITY, HandSender, S, _until


class Restores:
    """The restore hook of the receiving node: what it was given, and the bytes it saw."""

    def __init__(self) -> None:
        self.calls: list[tuple[CommittedHandoff, bytes]] = []

    async def __call__(self, state: CommittedHandoff) -> str | None:
        self.calls.append((state, state.path.read_bytes()))
        return "restored-into-test"


@contextlib.asynccontextmanager
async def two_nodes(
    bus: Bus, tmp_path: Path, **limits: Any
) -> AsyncIterator[tuple[HandoffActor, HandoffActor, Restores]]:
    restores = Restores()
    lim = dataclasses.replace(FAST, **limits) if limits else FAST
    a = HandoffActor("node-a", tmp_path / "a", limits=lim)
    b = HandoffActor("node-b", tmp_path / "b", limits=lim, restore=restores)
    async with supervised(bus, [a, b]):
        await _until(lambda: a.running and b.running)
        yield a, b, restores


def _staging_empty(actor: HandoffActor) -> bool:
    return actor.sessions == 0 and not any(actor.staging.iterdir())


async def test_multi_segment_payload_is_committed_byte_for_byte(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    data = random.Random(1).randbytes(5 * (1 << 20) + 12345)  # 6 segments of 1 MiB, each several chunks
    source = tmp_path / "slot.bin"
    source.write_bytes(data)
    async with two_nodes(bus, tmp_path) as (a, b, restores):
        report = await a.send("node-b", source, identity=IDENTITY, n_tokens=3, tokens=(1, 2, 3), continuation_token=4)
        assert (report.bytes, report.segments, report.restored) == (len(data), 6, "restored-into-test")
        [(state, seen)] = restores.calls
        assert seen == data and state.tokens == (1, 2, 3) and state.continuation_token == 4
        assert state.payload_digest == report.payload_digest == layout.payload_root(state.segments)
        [event] = await journal_reader.wait_for(of_type("handoff_committed"))
        assert (event["bytes"], event["segments"], event["sender_node"]) == (len(data), 6, "node-a")
        await _until(lambda: _staging_empty(b))

        async def produced() -> AsyncIterator[bytes]:  # segments handed over while a prefill still runs
            for i in range(0, len(data), 3 << 20):
                await asyncio.sleep(0.01)
                yield data[i : i + (3 << 20)]

        report = await a.send("node-b", produced(), identity=IDENTITY, n_tokens=3, max_bytes=len(data) + 100)
        assert restores.calls[-1][1] == data and report.segments == 2
        await _until(lambda: _staging_empty(b))


def _segments() -> list[bytes]:
    rng = random.Random(7)
    return [rng.randbytes(n) for n in (200_000, 1_500_000, 90_000)]  # the middle one is two chunks


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("drop", "segment_count"),
        ("duplicate", "duplicate"),
        ("reorder", "out_of_order"),
        ("corrupt", "digest_mismatch"),
        ("gap", "gap"),
        ("stall", "stalled"),
        ("sender_death", "stalled"),
        ("digest_lie", "payload_digest"),
        ("tiling_lie", "total"),
    ],
)
async def test_fault_aborts_cleanly_with_nothing_restored(
    bus: Bus, nats_server: NatsServer, journal_reader: JournalReader, tmp_path: Path, fault: str, reason: str
) -> None:
    segs = _segments()
    async with two_nodes(bus, tmp_path) as (_, b, restores):
        own = await Bus.connect(nats_server.options, name="hand sender") if fault == "sender_death" else bus
        hand = HandSender(own, segs)
        await hand.open()
        r = hand.refs
        result: HandoffResult | None = None
        if fault == "drop":
            await hand.segment(0)
            await hand.segment(1)
            result = await hand.commit()
        elif fault == "duplicate":
            await hand.segment(0)
            await hand.segment(0)
        elif fault == "reorder":
            await hand.segment(1)
            await hand.segment(0)
        elif fault == "corrupt":
            bad = bytearray(segs[1])
            bad[1_200_000] ^= 0xFF
            await hand.segment(0)
            await hand.segment(1, data=bytes(bad))
        elif fault == "gap":
            await hand.segment(0)
            await hand.segment(1, ref=SegmentRef(1, r[1].offset + 10, r[1].length, r[1].digest))
        elif fault == "stall":
            await hand.segment(0)
            await hand.chunk(r[1], segs[1][:1000])
        elif fault == "sender_death":
            await hand.segment(0)
            await own.close()
        elif fault in ("digest_lie", "tiling_lie"):
            for i in range(3):
                await hand.segment(i)
            lie = {"payload_digest": "cd" * 32} if fault == "digest_lie" else {"total_bytes": hand.total + 1}
            result = await hand.commit(**lie)
        if result is not None:
            assert not result.committed and result.reason == reason
        [event] = await journal_reader.wait_for(of_type("handoff_aborted", role="receiver"), timeout=10)
        assert (event["reason"], event["role"]) == (reason, "receiver")
        await _until(lambda: _staging_empty(b))
        assert restores.calls == []
        if fault not in ("sender_death",):
            await _until(lambda: any(isinstance(c, SessionAborted) and c.reason == reason for c in hand.controls))
        # the actor keeps serving: a clean transfer right after
        again = HandSender(bus, segs)
        await again.open()
        for i in range(3):
            await again.segment(i)
        assert (await again.commit()).committed
        assert restores.calls[0][1] == b"".join(segs)


async def test_receiver_death_fails_the_send_and_frees_its_staging(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    a = HandoffActor("node-a", tmp_path / "a", limits=FAST)
    b = HandoffActor("node-b", tmp_path / "b", limits=dataclasses.replace(FAST, window_bytes=2 << 20))
    data = random.Random(3).randbytes(8 << 20)

    async def slow() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i : i + (1 << 20)]
            await asyncio.sleep(0.05)

    async with supervised(bus, [a]):
        await _until(lambda: a.running)
        receiver = supervised(bus, [b], node_id="node-b")
        await receiver.__aenter__()
        await _until(lambda: b.running)
        send = asyncio.create_task(a.send("node-b", slow(), identity=IDENTITY, n_tokens=1, max_bytes=len(data)))
        await _until(lambda: b.sessions == 1)
        await receiver.__aexit__(None, None, None)  # the receiving node goes away mid-transfer
        with pytest.raises(HandoffFailed) as failed:
            await asyncio.wait_for(send, 10)
        assert failed.value.reason == tx.SendReason.RECEIVER_STALLED.value
        assert not any(b.staging.iterdir())
        [event] = await journal_reader.wait_for(of_type("handoff_aborted", node="test-node", role="sender"))
        assert event["reason"] == "receiver_stalled"


async def test_malformed_messages_get_structured_errors_and_the_actor_keeps_serving(bus: Bus, tmp_path: Path) -> None:
    async with two_nodes(bus, tmp_path) as (a, b, restores):
        open_subject = S.handoff("node-b", "open")
        with pytest.raises(RemoteError) as bad:
            await bus.request(open_subject, {"sender_node": "x", "identity": "nope"}, HandoffOpened, timeout=5)
        assert bad.value.code == BAD_REQUEST and bad.value.reply.details["path"] == "$.identity"
        with pytest.raises(RemoteError) as bad:
            await bus.request(open_subject, {"max_bytes": -1}, HandoffOpened, timeout=5)
        assert bad.value.code == BAD_REQUEST and "path" in bad.value.reply.details
        msg = await bus.request_raw(open_subject, b"{not json", timeout=5)
        with pytest.raises(RemoteError) as bad:
            parse_reply(open_subject, msg, HandoffOpened)
        assert bad.value.code == BAD_REQUEST
        hand = HandSender(bus, _segments())
        opened = await hand.open()
        msg = await bus.request_raw(opened.subject + ".commit", b'{"session": 5}', timeout=5)
        with pytest.raises(RemoteError) as bad:
            parse_reply("commit", msg, HandoffResult)
        assert bad.value.code == BAD_REQUEST and bad.value.reply.details["path"] == "$.session"
        stranger = S.handoff_session("node-b", "ab" * 16, "commit")
        commit = HandoffCommit(session="ab" * 16, n_segments=0, total_bytes=0, n_tokens=0, payload_digest="cd" * 32)
        with pytest.raises(RemoteError) as bad:
            parse_reply("commit", await bus.request_raw(stranger, encode(commit), timeout=5), HandoffResult)
        assert bad.value.code == NOT_FOUND
        await bus.nc.publish(opened.subject + ".data", b"x", headers={"Handoff-Session": "junk"})  # bad headers
        await _until(lambda: any(isinstance(c, SessionAborted) and c.reason == "bad_chunk" for c in hand.controls))
        await _until(lambda: _staging_empty(b))
        data = random.Random(9).randbytes(300_000)
        source = tmp_path / "ok.bin"
        source.write_bytes(data)
        report = await a.send("node-b", source, identity=IDENTITY, n_tokens=1)
        assert report.bytes == len(data) and restores.calls[-1][1] == data


async def test_a_commit_and_every_refusal_are_answered_only_on_an_inbox(bus: Bus, tmp_path: Path) -> None:
    # A commit names where its result goes; answered anywhere, the receiving node would write its result (or a
    # refusal) into a ledger, an instance record or the journal with its own rights (issue 17).
    forged = (
        f"$KV.{S.reservations_bucket}.node.node-b",
        f"$KV.{S.instances_bucket}.{S.instance_key('node-b', 'x')}",
        S.event("handoff", "forged", "node-b"),
    )
    landed: list[str] = []

    async def record(msg: Any) -> None:
        landed.append(msg.subject)

    for subject in forged:
        await bus.nc.subscribe(subject, cb=record)
    async with two_nodes(bus, tmp_path) as (_, b, restores):
        hand = HandSender(bus, _segments())
        opened = await hand.open()
        for i in range(len(hand.segments)):
            await hand.segment(i)
        commit = HandoffCommit(
            session=opened.session, n_segments=len(hand.refs), total_bytes=hand.total, n_tokens=2,
            payload_digest=layout.payload_root(hand.refs),
        )  # fmt: skip
        for reply in forged:
            await bus.nc.publish(opened.subject + ".commit", encode(commit), reply=reply)  # a valid commit
            await bus.nc.publish(opened.subject + ".commit", b"{not json", reply=reply)  # a refusal
            await bus.nc.publish(opened.subject + ".nonsense", b"{}", reply=reply)  # an unknown verb
        # Dropped before any work: the session still takes the commit it may answer.
        result = await hand.commit()
        assert result.committed and result.bytes == hand.total and len(restores.calls) == 1
        await _until(lambda: _staging_empty(b))
        await bus.nc.flush(timeout=5)
        await asyncio.sleep(0)  # let the callbacks of anything delivered run
        assert landed == []


async def test_concurrent_sessions_all_commit_and_opens_past_the_bound_are_refused_busy(
    bus: Bus, tmp_path: Path
) -> None:
    rng = random.Random(11)
    payloads = [rng.randbytes(3 * (1 << 20) + i) for i in range(3)]

    async def stream(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i : i + (1 << 20)]

    limits = {"max_sessions": 3, "idle_timeout_s": 30.0, "first_chunk_timeout_s": 30.0}  # the held ones stay
    async with two_nodes(bus, tmp_path, **limits) as (a, b, restores):
        reports = await asyncio.gather(
            *(
                a.send("node-b", stream(p), identity=IDENTITY, n_tokens=i, max_bytes=len(p))
                for i, p in enumerate(payloads)
            )
        )
        assert sorted(r.bytes for r in reports) == sorted(len(p) for p in payloads)
        assert sorted(seen for _, seen in restores.calls) == sorted(payloads)
        await _until(lambda: _staging_empty(b))
        held = [HandSender(bus, _segments()) for _ in range(3)]
        for hand in held:
            await hand.open()
        with pytest.raises(RemoteError) as refused:  # its share: every place, and no more
            await HandSender(bus, _segments()).open()
        assert refused.value.code == BUSY and refused.value.reply.details["reason"] == "busy"
        # Another node's open takes the place of the newest empty one (a node over its share of 1 place of 3).
        report = await a.send("node-b", stream(payloads[0]), identity=IDENTITY, n_tokens=1, max_bytes=len(payloads[0]))
        assert report.bytes == len(payloads[0])
        await _until(lambda: any(isinstance(c, SessionAborted) and c.reason == "preempted" for c in held[2].controls))
        assert not any(c for hand in held[:2] for c in hand.controls if isinstance(c, SessionAborted))


@pytest.mark.parametrize("hook", [True, False], ids=["on_committed", "l3_only"])
async def test_committed_handoff_lands_in_the_receivers_l3_store_and_its_hook(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path, hook: bool
) -> None:
    seen: list[bytes] = []

    async def on_committed(state: CommittedHandoff) -> str | None:
        seen.append(state.path.read_bytes())  # valid while the hook runs (the runner restores from it)
        return None

    l3 = L3Actor("node-b", tmp_path / "b", budget_bytes=64 << 20, segment_bytes=layout.MIN_SEGMENT_BYTES)
    a = HandoffActor("node-a", tmp_path / "a", limits=FAST)
    restore = into_l3(l3, on_committed=on_committed if hook else None)
    b = HandoffActor("node-b", tmp_path / "b", limits=FAST, restore=restore)
    data = random.Random(5).randbytes(2 * (1 << 20) + 3)
    source = tmp_path / "slot.bin"
    source.write_bytes(data)
    tokens = (7, 8, 9, 10)
    async with supervised(bus, [a, b, l3]):
        await _until(lambda: a.running and b.running and l3.running)
        report = await a.send("node-b", source, identity=IDENTITY, n_tokens=len(tokens), tokens=tokens)
        assert seen == ([data] if hook else []) and report.restored == layout.entry_id(IDENTITY, tokens)
        if not hook:  # L3 is the restore: committed means the node's store holds it
            assert await l3.lookup(IDENTITY, tokens, max_tokens=4) is not None
        [captured] = await journal_reader.wait_for(of_type("l3_captured"))
        assert (captured["entry"], captured["bytes"]) == (report.restored, len(data))
        hit = await l3.lookup(IDENTITY, [*tokens, 11], max_tokens=4)
        assert hit is not None and hit.source == "l3_local"
        dest = tmp_path / "restored.bin"
        await l3.materialize(hit, dest, deadline_s=10)
        assert dest.read_bytes() == data
        await _until(lambda: _staging_empty(b))


async def test_a_source_that_stops_producing_is_aborted_by_the_receiver_and_the_send_fails_promptly(
    bus: Bus, tmp_path: Path
) -> None:
    hung = asyncio.Event()

    async def prefill_that_hangs() -> AsyncIterator[bytes]:
        yield random.Random(2).randbytes(300_000)
        await hung.wait()  # the prefill never produces the next segment
        yield b""

    async with two_nodes(bus, tmp_path) as (a, b, restores):
        async with asyncio.timeout(5):  # the receiver's idle timeout (0.6 s), not the send's overall deadline
            with pytest.raises(HandoffFailed) as failed:
                await a.send("node-b", prefill_that_hangs(), identity=IDENTITY, n_tokens=1, max_bytes=1 << 20)
        assert failed.value.reason == "receiver_aborted" and "stalled" in failed.value.detail
        await _until(lambda: _staging_empty(b))
        assert restores.calls == []


async def test_a_link_probe_measures_real_handoffs_never_restores_them_and_is_journaled(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    async with two_nodes(bus, tmp_path) as (_, b, restores):
        probe = LinkProbe(peer="node-b", bytes=4 << 20, small_bytes=64 << 10, rounds=2)
        result = await bus.request(S.handoff("node-a", "probe"), probe, LinkProbeResult, timeout=30)
        assert (result.src, result.dst) == ("node-a", "node-b")
        assert [size for size, _ in result.samples] == [64 << 10, 4 << 20] * 2
        assert all(seconds > 0 for _, seconds in result.samples)
        assert result.bytes_per_s > 0 and result.fixed_s >= 0
        assert restores.calls == []  # verified by the receiver, then thrown away
        committed = await journal_reader.wait_for(of_type("handoff_committed"), count=5)  # with the warm-up
        assert {e["identity"] for e in committed} == {PROBE_IDENTITY} and {e["restored"] for e in committed} == {None}
        [measured] = await journal_reader.wait_for(of_type("link_measured"))
        assert (measured["src"], measured["dst"]) == ("node-a", "node-b")
        assert measured["bytes_per_s"] == result.bytes_per_s
        await _until(lambda: _staging_empty(b))
        # Bad probes: an error naming why, and the actor keeps serving.
        for bad, code in (
            ({"peer": "node-a"}, BAD_REQUEST),  # itself
            ({"peer": "node-b", "bytes": 1}, BAD_REQUEST),  # under the smallest large probe
            ({"peer": "../x"}, BAD_REQUEST),
            ({"peer": "node-b", "extra": 1}, BAD_REQUEST),
            ({"peer": "node-c", "bytes": 4 << 20, "rounds": 1}, "unavailable"),  # nobody there
        ):
            reply = await bus.nc.request(S.handoff("node-a", "probe"), msgspec.json.encode(bad), timeout=30)
            with pytest.raises(RemoteError) as refused:
                parse_reply("probe", reply, LinkProbeResult)
            assert refused.value.reply.code == code, (bad, refused.value.reply)
        again = await bus.request(S.handoff("node-a", "probe"), probe, LinkProbeResult, timeout=30)
        assert len(again.samples) == 4


async def test_sessions_open_at_once_share_the_credit_budget(bus: Bus, tmp_path: Path) -> None:
    """The receiving connection's buffer must hold what every session may have in flight: a session opened while
    others hold the budget gets what is left (two chunks at least, and two kept for each session that could
    still open), and the whole window at its next grant once the others are gone."""
    rng = random.Random(5)
    big = [rng.randbytes(3 << 20) for _ in range(3)]
    budget = 8 << 20
    # none idles out here
    limits = {"max_sessions": 3, "credit_budget_bytes": budget, "idle_timeout_s": 60.0, "first_chunk_timeout_s": 60.0}
    async with two_nodes(bus, tmp_path, **limits) as (_, b, _):
        held = [HandSender(bus, big) for _ in range(3)]
        opened = [await hand.open() for hand in held]
        chunk = opened[0].chunk_bytes
        credits = [o.credit for o in opened]
        assert credits == [4 << 20, budget - (4 << 20) - 2 * chunk, 2 * chunk]
        for o in opened[:2]:  # two senders give up: their reservations are freed
            await bus.nc.publish(o.subject + ".abort", encode(HandoffAbort(session=o.session, reason="test")))
        await _until(lambda: b.sessions == 1)
        last = held[2]
        await last.chunk(last.refs[0], last.segments[0][:chunk])
        grant = await _until(lambda: [c for c in last.controls if isinstance(c, CreditGrant)])
        assert grant[0].limit == chunk + (4 << 20)  # the whole window ahead of what it staged
