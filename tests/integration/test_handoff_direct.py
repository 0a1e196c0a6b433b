"""KV handoff over the direct data path, on a real nats-server, real sockets and real TLS.

The open, the credits, the commit and the aborts stay on NATS; the chunks go on a stream to the receiver's data
listener (its ticket in `HandoffOpened.direct`), each with the headers it would have had on NATS and judged by
the same receiver core (order, credit, segment digests). A receiver that cannot be reached directly gets the
chunks over NATS, and the report says which path they took and why.
"""

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

from actors.handoff.actor import CommittedHandoff, HandoffActor, HandoffFailed
from messages.datapath import DataAnswer, DataHello
from messages.handoff import HandoffOpen, HandoffOpened, LinkProbe, LinkProbeResult
from runtime.bus import Bus
from runtime.datapath import PUSHED, DataLimits, DataPathConfig
from runtime.tls import TlsFiles, ensure_route_certificates
from tests.conftest import JournalReader, of_type, supervised
from tests.harness.handoff import FAST, IDENTITY, S, _until, raw_push

LIMITS = DataLimits(stall_s=2.0, rate_grace_s=60.0)
NAMES = ["127.0.0.1", "localhost"]


class Restores:
    def __init__(self) -> None:
        self.calls: list[tuple[CommittedHandoff, bytes]] = []

    async def __call__(self, state: CommittedHandoff) -> str | None:
        self.calls.append((state, state.path.read_bytes()))
        return "restored"


@contextlib.asynccontextmanager
async def two_nodes(
    bus: Bus,
    root: Path,
    *,
    sender: DataPathConfig | None = None,
    receiver: DataPathConfig | None = None,
    **limits: Any,
) -> AsyncIterator[tuple[HandoffActor, HandoffActor, Restores]]:
    restores = Restores()
    lim = dataclasses.replace(FAST, **limits) if limits else FAST
    a = HandoffActor("node-a", root / "a", limits=lim, datapath=sender)
    b = HandoffActor("node-b", root / "b", limits=lim, restore=restores, datapath=receiver)
    async with supervised(bus, [a, b]):
        await _until(lambda: a.running and b.running)
        yield a, b, restores


def payload(tmp_path: Path, size: int = 5 * (1 << 20) + 12345) -> tuple[Path, bytes]:
    data = random.Random(1).randbytes(size)
    source = tmp_path / "slot.bin"
    source.write_bytes(data)
    return source, data


async def test_a_handoff_moves_its_chunks_on_the_direct_stream_byte_for_byte(
    bus: Bus, tmp_path: Path, journal_reader: JournalReader
) -> None:
    source, data = payload(tmp_path)
    config = DataPathConfig(limits=LIMITS)
    async with two_nodes(bus, tmp_path, sender=config, receiver=config) as (a, b, restores):
        report = await a.send("node-b", source, identity=IDENTITY, n_tokens=3, tokens=(1, 2, 3))
        assert (report.transport, report.fallback, report.bytes, report.segments) == ("direct", "", len(data), 6)
        [(state, seen)] = restores.calls
        assert seen == data and state.payload_digest == report.payload_digest
        [event] = await journal_reader.wait_for(of_type("handoff_committed"))
        assert (event["transport"], event["bytes"]) == ("direct", len(data))

        async def produced() -> AsyncIterator[bytes]:  # segments handed over while a prefill still runs
            for i in range(0, len(data), 3 << 20):
                await asyncio.sleep(0.01)
                yield data[i : i + (3 << 20)]

        report = await a.send("node-b", produced(), identity=IDENTITY, n_tokens=3, max_bytes=len(data) + 100)
        assert report.transport == "direct" and restores.calls[-1][1] == data
        assert b.listener is not None and b.listener.refused == 0


def certificates(root: Path, *secrets: str) -> tuple[TlsFiles, TlsFiles]:
    a, b = (ensure_route_certificates(root / f"t{i}", secret, NAMES) for i, secret in enumerate(secrets))
    return a, b


async def test_with_cluster_certificates_the_chunks_travel_inside_mutual_tls(bus: Bus, tmp_path: Path) -> None:
    source, data = payload(tmp_path)
    ta, tb = certificates(tmp_path, "s", "s")
    sender, receiver = DataPathConfig(tls=ta, limits=LIMITS), DataPathConfig(tls=tb, limits=LIMITS)
    async with two_nodes(bus, tmp_path, sender=sender, receiver=receiver) as (a, _, restores):
        report = await a.send("node-b", source, identity=IDENTITY, n_tokens=3)
        assert report.transport == "direct_tls" and restores.calls[-1][1] == data


async def test_a_sender_of_another_cluster_reaches_nothing_directly_and_nats_carries_the_chunks(
    bus: Bus, tmp_path: Path
) -> None:
    source, data = payload(tmp_path)
    ta, tb = certificates(tmp_path, "x", "s")
    sender, receiver = DataPathConfig(tls=ta, limits=LIMITS), DataPathConfig(tls=tb, limits=LIMITS)
    async with two_nodes(bus, tmp_path, sender=sender, receiver=receiver) as (a, _, restores):
        report = await a.send("node-b", source, identity=IDENTITY, n_tokens=3)
        assert report.transport == "nats" and "CERTIFICATE_VERIFY_FAILED" in report.fallback, report
        assert restores.calls[-1][1] == data


async def test_a_closed_port_falls_back_to_nats_and_the_report_says_why(bus: Bus, tmp_path: Path) -> None:
    source, data = payload(tmp_path)
    config = DataPathConfig(limits=LIMITS)
    async with two_nodes(bus, tmp_path, sender=config, receiver=config) as (a, b, restores):
        assert b.listener is not None and b.listener._server is not None
        b.listener._server.close()  # its tickets are still issued; nothing connects (as behind a firewall)
        await b.listener._server.wait_closed()
        report = await a.send("node-b", source, identity=IDENTITY, n_tokens=3)
        assert report.transport == "nats" and "no direct stream" in report.fallback, report
        assert restores.calls[-1][1] == data


async def test_a_receiver_without_the_direct_path_takes_the_chunks_over_nats(bus: Bus, tmp_path: Path) -> None:
    source, data = payload(tmp_path)
    async with two_nodes(bus, tmp_path, sender=DataPathConfig(limits=LIMITS)) as (a, _, restores):
        report = await a.send("node-b", source, identity=IDENTITY, n_tokens=3)
        assert report.transport == "nats" and "offered no direct stream" in report.fallback
        assert restores.calls[-1][1] == data


async def opened_session(bus: Bus, max_bytes: int) -> HandoffOpened:
    """A session opened by hand on node-b (as a sender would), asking for the direct path."""
    request = HandoffOpen(
        sender_node="node-a", identity=IDENTITY, n_tokens=1, max_bytes=max_bytes,
        credit_subject=bus.nc.new_inbox(), direct=True,
    )  # fmt: skip
    return await bus.request(S.handoff("node-b", "open"), request, HandoffOpened, timeout=5)


async def test_a_ticket_for_another_session_or_a_replayed_one_takes_no_chunk(bus: Bus, tmp_path: Path) -> None:
    config = DataPathConfig(limits=LIMITS)
    async with two_nodes(bus, tmp_path, receiver=config) as (_, b, _):
        opened = await opened_session(bus, 1 << 20)
        assert opened.direct is not None
        hello = DataHello(ticket=opened.direct.ticket, receiver="node-a", digest=IDENTITY, offset=0,
                          length=1 << 20, chunk=opened.chunk_bytes)  # fmt: skip
        foreign = msgspec.structs.replace(hello, receiver="node-x")  # another sender: refused, the ticket used up
        answer = await raw_push(opened.direct, foreign, b"")
        assert msgspec.json.decode(answer[4:], type=DataAnswer).reason == "ticket_foreign"
        replay = await raw_push(opened.direct, hello, b"")
        assert msgspec.json.decode(replay[4:], type=DataAnswer).reason == "ticket_used"
        assert b.listener is not None and b.listener.refused == 2


async def test_a_pushed_message_over_its_ceiling_aborts_the_session_before_it_is_read(bus: Bus, tmp_path: Path) -> None:
    config = DataPathConfig(limits=LIMITS)
    async with two_nodes(bus, tmp_path, receiver=config, first_chunk_timeout_s=30.0) as (_, b, _):
        opened = await opened_session(bus, 1 << 20)
        assert opened.direct is not None
        hello = DataHello(ticket=opened.direct.ticket, receiver="node-a", digest=IDENTITY, offset=0,
                          length=1 << 20, chunk=opened.chunk_bytes)  # fmt: skip
        lie = PUSHED.pack(2, 1 << 31) + b"{}"  # a payload of 2 GiB announced: nothing is allocated for it
        answer = await raw_push(opened.direct, hello, lie)
        assert msgspec.json.decode(answer[4:], type=DataAnswer).ok
        await _until(lambda: b.sessions == 0)  # aborted (bad_chunk), its staging freed


async def test_a_direct_stream_that_breaks_mid_session_fails_the_send_with_a_clear_reason(
    bus: Bus, tmp_path: Path
) -> None:
    config = DataPathConfig(limits=LIMITS)
    async with two_nodes(bus, tmp_path, sender=config, receiver=config) as (a, b, restores):

        async def produced() -> AsyncIterator[bytes]:
            yield random.Random(2).randbytes(1 << 20)
            # once the receiver took bytes on the stream, its listener goes away with the stream on it
            await _until(lambda: any(s.direct and s.core.received for s in b._sessions.values()))
            assert b.listener is not None
            await b.listener.close()
            yield random.Random(3).randbytes(1 << 20)

        with pytest.raises(HandoffFailed) as failed:
            await a.send("node-b", produced(), identity=IDENTITY, n_tokens=3, max_bytes=4 << 20)
        assert failed.value.reason in ("bus_error", "receiver_aborted"), failed.value
        assert restores.calls == []


async def test_a_link_probe_measures_the_path_the_handoffs_take(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    """What the handoff cost model learns is the rate of the path actually used (here the direct one)."""
    config = DataPathConfig(limits=LIMITS)
    async with two_nodes(bus, tmp_path, sender=config, receiver=config):
        probe = LinkProbe(peer="node-b", bytes=4 << 20, small_bytes=64 << 10, rounds=1)
        result = await bus.request(S.handoff("node-a", "probe"), probe, LinkProbeResult, timeout=30)
        assert result.transport == "direct" and result.bytes_per_s > 0
        [measured] = await journal_reader.wait_for(of_type("link_measured"))
        assert (measured["transport"], measured["bytes_per_s"]) == ("direct", result.bytes_per_s)
    async with two_nodes(bus, tmp_path / "nats") as _:
        result = await bus.request(S.handoff("node-a", "probe"), probe, LinkProbeResult, timeout=30)
        assert result.transport == "nats"
