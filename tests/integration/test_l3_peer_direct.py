"""L3 peer fetch over the direct data path, on a real nats-server, real sockets and real TLS.

The manifest is fetched over NATS as before; each segment this store lacks is asked on `mesh.l3.<peer>.offer`
for a one-shot ticket and arrives on a TCP stream, each chunk checked against its blake3 and the segment against
its digest before anything is committed. A peer that cannot be reached directly serves the segments over NATS,
and the `l3_fetched` event says which path they took.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from actors.l3.actor import L3Actor
from actors.l3.api import L3Hit
from messages.datapath import DataAnswer, DataHello, DirectOffer
from messages.l3 import SegmentOfferRequest
from messages.subjects import Subjects
from runtime.bus import Bus, RemoteError
from runtime.datapath import DataLimits, DataPathConfig
from runtime.tls import TlsFiles, ensure_route_certificates
from tests.conftest import JournalReader, of_type
from tests.harness.handoff import raw_push
from tests.harness.l3 import IDENTITY, KIND, SEG, _slot_file, _until, l3_node

S = Subjects()
LIMITS = DataLimits(stall_s=2.0, rate_grace_s=60.0)
NAMES = ["127.0.0.1", "localhost"]


async def captured_on_a(bus: Bus, a_dir: Path, journal_reader: JournalReader, a: L3Actor, size: int) -> bytes:
    source, data = _slot_file(a_dir / "slots", size, seed=9)
    a.capture(source, identity=IDENTITY, tokens=list(range(1, 201)), payload_kind=KIND)
    await journal_reader.wait_for(of_type("l3_captured", node="node-a"))
    return data


async def fetched_by_b(b: L3Actor, tmp_path: Path) -> bytes:
    async def from_a() -> L3Hit | None:
        found = await b.lookup(IDENTITY, [*range(1, 201), 1], max_tokens=201)
        return found if found is not None and found.node == "node-a" else None

    hit = await _until(from_a)
    await b.materialize(hit, tmp_path / "b.bin", deadline_s=20)
    return (tmp_path / "b.bin").read_bytes()


def certificates(root: Path, *secrets: str) -> tuple[TlsFiles, TlsFiles]:
    a, b = (ensure_route_certificates(root / f"t{i}", secret, NAMES) for i, secret in enumerate(secrets))
    return a, b


@pytest.mark.parametrize("tls", ["plain", "mutual_tls", "other_cluster", "holder_without"])
async def test_a_peer_entry_arrives_over_the_direct_path_or_nats_byte_for_byte(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path, tls: str
) -> None:
    ta, tb = certificates(tmp_path, "s", "x" if tls == "other_cluster" else "s")
    with_tls = tls in ("mutual_tls", "other_cluster")
    path_a = None if tls == "holder_without" else DataPathConfig(tls=ta if with_tls else None, limits=LIMITS)
    path_b = DataPathConfig(tls=tb if with_tls else None, limits=LIMITS)
    async with (
        l3_node(bus, tmp_path / "a", "node-a", datapath=path_a) as a,
        l3_node(bus, tmp_path / "b", "node-b", datapath=path_b) as b,
    ):
        data = await captured_on_a(bus, tmp_path, journal_reader, a, 9 * SEG + 5)
        assert await fetched_by_b(b, tmp_path) == data
        [fetched] = await journal_reader.wait_for(of_type("l3_fetched", node="node-b"))
        expected = {"plain": "direct", "mutual_tls": "direct_tls"}.get(tls, "nats")
        assert (fetched["transport"], fetched["moved_bytes"]) == (expected, len(data))


async def test_a_closed_port_leaves_the_segments_to_nats(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    config = DataPathConfig(limits=LIMITS)
    async with (
        l3_node(bus, tmp_path / "a", "node-a", datapath=config) as a,
        l3_node(bus, tmp_path / "b", "node-b", datapath=config) as b,
    ):
        listener = a._endpoints.listener
        assert listener is not None and listener._server is not None
        listener._server.close()  # tickets still issued, nothing connects (as behind a firewall)
        await listener._server.wait_closed()
        data = await captured_on_a(bus, tmp_path, journal_reader, a, 3 * SEG + 7)
        assert await fetched_by_b(b, tmp_path) == data
        [fetched] = await journal_reader.wait_for(of_type("l3_fetched", node="node-b"))
        assert fetched["transport"] == "nats"


async def test_a_segment_ticket_is_for_that_segment_and_receiver_once(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path
) -> None:
    async with l3_node(bus, tmp_path / "a", "node-a", datapath=DataPathConfig(limits=LIMITS)) as a:
        await captured_on_a(bus, tmp_path, journal_reader, a, 2 * SEG)
        store = a._keeper.require_store()
        digest = next(p.name for p in (store.root / "segments").rglob("*") if p.is_file())
        ask = SegmentOfferRequest(digest=digest, length=SEG, chunk=SEG, receiver="node-b")
        with pytest.raises(RemoteError) as unknown:  # a segment it does not hold
            unknown_digest = msgspec.structs.replace(ask, digest="0" * 64)
            await bus.request(S.l3("node-a", "offer"), unknown_digest, DirectOffer, timeout=5)
        assert unknown.value.code == "not_found"
        offer = await bus.request(S.l3("node-a", "offer"), ask, DirectOffer, timeout=5)
        hello = DataHello(ticket=offer.ticket, receiver="node-x", digest=digest, offset=0, length=SEG, chunk=SEG)
        answer = await raw_push(offer, hello, b"")
        assert msgspec.json.decode(answer[4:], type=DataAnswer).reason == "ticket_foreign"
        answer = await raw_push(offer, msgspec.structs.replace(hello, receiver="node-b"), b"")
        assert msgspec.json.decode(answer[4:], type=DataAnswer).reason == "ticket_used"
