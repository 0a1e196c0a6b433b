"""Model files from peers over a real nats-server: two files actors (nodes `a` and `b`, each with its own data
and models dir) and, where a peer must misbehave, a scripted peer answering `mesh.files.evil.*` by hand.

A node without the file gets it (digest verified); a fetch cut off by a peer that stops answering resumes from
the verified part without fetching it again; a peer sending wrong bytes is refused and nothing is left; a file
system that cannot take the file is a refusal before any byte moves; names outside the models dir, or not named
by the catalog, travel in neither direction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.files.actor import FilesActor, FilesLimits
from actors.placement.registry import public_key_of, sign
from messages.files import (
    FILES_BLAKE3_HEADER,
    FILES_OFFSET_HEADER,
    FILES_TOTAL_HEADER,
    ChunkRequest,
    FileFacts,
    FileHeld,
    HeldRequest,
    PullReply,
    PullRequest,
)
from runtime import buckets
from runtime.bus import Bus, RemoteError, encode
from runtime.cli.placement import _build_entry
from tests.conftest import JournalReader, NatsServer, of_type, supervised
from tests.harness.model_files import (
    S,
    answering,
    digest_of,
    evil_peer,
    hashed,
    leftovers,
    node_dirs,
    nodes,
    pull,
    refused,
    run,
)
from tests.tiny_models import write_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~21 MB: many chunks on the test server's max_payload
    return write_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", n_layer=8, n_embd=256, n_head=8, n_ff=512)


async def test_a_node_without_the_file_pulls_it_from_the_peer_that_holds_it_verified(
    bus: Bus, tmp_path: Path, model: Path, journal_reader: JournalReader
) -> None:
    async with nodes(bus, tmp_path, model) as (_, models_b):
        reply = await pull(bus, "b", "tiny", peer="a")
        size = (await asyncio.to_thread(model.stat)).st_size
        assert (reply.path, reply.peer, reply.size, reply.already) == ("tiny.gguf", "a", size, False)
        assert reply.blake3 == digest_of(model) == digest_of(models_b / "tiny.gguf")
        assert reply.moved_bytes == size and reply.resumed_from == 0
        assert leftovers(models_b) == ["tiny.gguf"]  # no part file, no journal
        again = await pull(bus, "b", "tiny")  # already there: nothing moves
        assert again.already and again.moved_bytes == 0 and again.blake3 == reply.blake3
        (event,) = await journal_reader.wait_for(of_type("model_file_pulled", node="b"))
        assert (event["name"], event["path"], event["peer"], event["blake3"]) == (
            "tiny",
            "tiny.gguf",
            "a",
            reply.blake3,
        )
        assert event["moved_bytes"] == size and event["actor"] == "files"


async def test_each_node_reports_the_named_files_it_holds_and_a_pull_adds_one_at_once(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    """What telemetry carries to placement (issue 21): each catalog name found in the models dir, with its size;
    a name that escapes the models dir or is missing is not listed; a pull lists its file without waiting."""
    data_a, models_a = node_dirs(tmp_path, "a")
    data_b, models_b = node_dirs(tmp_path, "b")
    os.link(model, models_a / "tiny.gguf")
    (tmp_path / "escape.gguf").write_bytes(b"outside")  # named by the catalog, outside the models dir
    limits = FilesLimits(holdings_every_s=60.0)  # only the first look and the pull's
    a = FilesActor("a", data_a, models_dir=models_a, limits=limits)
    b = FilesActor("b", data_b, models_dir=models_b, limits=limits)
    size = (await asyncio.to_thread(model.stat)).st_size
    async with supervised(bus, [a], node_id="a"), supervised(bus, [b], node_id="b"):
        async with asyncio.timeout(10):
            while [h[:2] for h in a.holdings.held] != [("tiny.gguf", size)]:
                await asyncio.sleep(0.02)
        before = b.holdings  # a local: narrowing `b.holdings.held` to () would outlive the pull that changes it
        assert before.held == () and before.pull_bytes_per_s is None
        await pull(bus, "b", "tiny", peer="a")
        digest = digest_of(model)  # b verified what it pulled; a hashed its file when b asked who holds it
        async with asyncio.timeout(5):
            while (a.holdings.held, b.holdings.held) != ((("tiny.gguf", size, digest),),) * 2:
                await asyncio.sleep(0.02)
        assert b.holdings.pull_bytes_per_s is not None and b.holdings.pull_bytes_per_s > 0


async def test_an_interrupted_pull_resumes_from_its_verified_part_without_starting_over(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    limits = FilesLimits(chunk_timeout_s=1.0, window=2)
    async with nodes(bus, tmp_path, model, limits) as (_, models_b):
        cut = (await asyncio.to_thread(model.stat)).st_size // 2
        # `evil` serves the first half faithfully, then stops answering (a peer that went away).
        async with evil_peer(bus, model, lambda r, piece: hashed(piece) if r.offset < cut else None):
            failed = await refused(bus, "b", "tiny", peer="evil")
        assert failed.code == "unavailable" and failed.reply.details["reason"] == "peer_failed"
        kept = [p for p in leftovers(models_b) if p.endswith(".part")]
        assert len(kept) == 1 and not (models_b / "tiny.gguf").exists()
        reply = await pull(bus, "b", "tiny", peer="a")
        size = (await asyncio.to_thread(model.stat)).st_size
        assert reply.resumed_from >= cut // 2 and reply.resumed_from + reply.moved_bytes == size
        assert reply.moved_bytes < size
        assert digest_of(models_b / "tiny.gguf") == digest_of(model)
        assert leftovers(models_b) == ["tiny.gguf"]


@pytest.mark.parametrize("lie", ["consistent", "inconsistent"])
async def test_a_peer_sending_wrong_bytes_is_refused_and_nothing_is_left(
    bus: Bus, tmp_path: Path, model: Path, lie: str, journal_reader: JournalReader
) -> None:
    def wrong(request: ChunkRequest, piece: bytes) -> tuple[bytes, str]:
        if request.offset == 0:
            return hashed(piece)
        flipped = bytes([piece[0] ^ 0xFF]) + piece[1:]
        # consistent: the chunk's hash matches the wrong bytes (only the whole-file digest can tell)
        return hashed(flipped) if lie == "consistent" else (flipped, hashed(piece)[1])

    async with nodes(bus, tmp_path, model) as (_, models_b), evil_peer(bus, model, wrong):
        failure = await refused(bus, "b", "tiny", peer="evil")
        reason = "digest_mismatch" if lie == "consistent" else "chunk_refused"
        assert failure.reply.details["reason"] == reason, failure
        assert leftovers(models_b) == []
        (event,) = await journal_reader.wait_for(of_type("model_file_pull_refused", reason=reason))
        assert (event["name"], event["path"], event["peer"]) == ("tiny", "tiny.gguf", "evil")


async def test_a_file_system_that_cannot_take_the_file_is_a_refusal_before_any_byte_moves(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    async with nodes(bus, tmp_path, model, FilesLimits(keep_free_bytes=1 << 60)) as (_, models_b):
        failure = await refused(bus, "b", "tiny", peer="a")
        assert failure.reply.details["reason"] == "no_space" and "needs" in failure.reply.message
        assert leftovers(models_b) == []  # not even an empty part


async def test_a_second_pull_does_not_count_the_bytes_a_pull_in_flight_will_write(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    """Each pull reserves the bytes it has still to write until it ends. b's file system has room for one copy
    of the model: while a first pull is writing (its peer holds its chunks back), a second is refused `no_space`
    before any byte moves (free space alone would have let both start and together overfill the disk); once the
    first ended (refused), its reservation went with it and the second pull goes through."""
    size = (await asyncio.to_thread(model.stat)).st_size
    data_a, models_a = node_dirs(tmp_path, "a")
    (data_a / "models.toml").write_text('[models.two]\npath = "two.gguf"\n')
    os.link(model, models_a / "two.gguf")
    data_b, models_b = node_dirs(tmp_path, "b")
    (data_b / "models.toml").write_text('[models.one]\npath = "one.gguf"\n\n[models.two]\npath = "two.gguf"\n')
    capacity = 2 * size - 1  # one copy fits, two do not

    def free_space(directory: Path) -> int:  # a file system of `capacity` bytes: what b's models dir holds is used
        return capacity - sum(f.stat().st_size for f in models_b.iterdir() if f.is_file())

    asked, release = asyncio.Event(), asyncio.Event()

    async def on_held(msg: Any) -> None:
        await msg.respond(encode(FileHeld(node_id="slow", path="one.gguf", size=size, blake3=digest_of(model))))

    async def on_chunk(msg: Any) -> None:  # holds the first chunk back, then answers bytes that are not it
        request = msgspec.json.decode(msg.data, type=ChunkRequest)
        asked.set()
        async with asyncio.timeout(30):
            await release.wait()
        headers = {FILES_OFFSET_HEADER: str(request.offset), FILES_TOTAL_HEADER: str(size), FILES_BLAKE3_HEADER: "0"}
        await bus.nc.publish(msg.reply, b"x" * request.length, headers=headers)

    subs = [await bus.nc.subscribe(S.files("slow", "held"), cb=on_held)]
    subs.append(await bus.nc.subscribe(S.files("slow", "chunk"), cb=on_chunk))
    limits = FilesLimits(keep_free_bytes=0)
    a = FilesActor("a", data_a, models_dir=models_a, limits=limits)
    b = FilesActor("b", data_b, models_dir=models_b, limits=limits, free_space=free_space)
    try:
        async with supervised(bus, [a], node_id="a"), supervised(bus, [b], node_id="b"):
            await answering(bus, a, b)
            first = asyncio.ensure_future(pull(bus, "b", "one", peer="slow"))
            try:
                async with asyncio.timeout(30):
                    await asked.wait()  # the first pull passed its space check and is writing
                second = await refused(bus, "b", "two", peer="a")
                assert second.reply.details["reason"] == "no_space", second
                assert "owed to pulls in flight" in second.reply.message, second.reply.message
                assert not (models_b / "two.gguf").exists()
            finally:
                release.set()
                with pytest.raises(RemoteError) as ended:
                    await first
            assert ended.value.reply.details["reason"] == "chunk_refused", ended.value
            reply = await pull(bus, "b", "two", peer="a")
            assert reply.size == size and digest_of(models_b / "two.gguf") == digest_of(model)
    finally:
        for sub in subs:
            await sub.unsubscribe()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_a_full_tmpfs_is_a_clear_refusal_not_a_half_written_file(bus: Bus, tmp_path: Path, model: Path) -> None:
    async with nodes(bus, tmp_path, model) as (_, models_b):
        if await run("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(models_b)) != 0:
            pytest.skip("cannot mount a tmpfs here")
        try:
            failure = await refused(bus, "b", "tiny", peer="a")
            assert failure.reply.details["reason"] == "no_space"
            assert not (models_b / "tiny.gguf").exists()
        finally:
            assert await run("umount", str(models_b)) == 0


async def test_names_outside_the_models_dir_or_not_in_the_catalog_travel_in_neither_direction(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    async with nodes(bus, tmp_path, model) as (models_a, models_b):
        escape = await refused(bus, "b", "escape", peer="a")  # the catalog itself names a path outside
        assert escape.reply.details["reason"] == "bad_name"
        assert not (tmp_path / "b" / "escape.gguf").exists()
        unknown = await refused(bus, "b", "nothing", peer="a")
        assert unknown.reply.details["reason"] == "not_named"
        # A peer asking `a` for files its catalog does not name learns nothing, whether they exist or not.
        (models_a / "secret.gguf").write_bytes(b"not for peers")
        digest = digest_of(models_a / "secret.gguf")
        for path in ("secret.gguf", "../models.toml", "/etc/passwd", "../../a/models/tiny.gguf"):
            for subject, request, kind in (
                (S.files("a", "held"), HeldRequest(path=path), FileHeld),
                (S.files("a", "chunk"), ChunkRequest(path=path, blake3=digest, length=100), bytes),
            ):
                with pytest.raises(RemoteError) as caught:
                    await bus.request(subject, request, kind, timeout=5)
                assert caught.value.code == "not_found", (path, subject)
        # a chunk of the catalog's file under a digest it does not have is refused too
        with pytest.raises(RemoteError) as caught:
            await bus.request(
                S.files("a", "chunk"), ChunkRequest(path="tiny.gguf", blake3=digest, length=100), bytes, timeout=5
            )
        assert caught.value.code == "not_found"
        assert leftovers(models_b) == []


async def test_a_pull_without_a_named_peer_asks_the_live_nodes(bus: Bus, tmp_path: Path, model: Path) -> None:
    from runtime import buckets
    from tests.harness.placement import report

    kv = await buckets.nodes(bus, S)
    for node in ("a", "b"):
        await kv.put(node, encode(report(node, 1 << 30)))
    async with nodes(bus, tmp_path, model) as (_, models_b):
        reply = await pull(bus, "b", "tiny")
        assert reply.peer == "a" and digest_of(models_b / "tiny.gguf") == digest_of(model)


async def test_a_registry_entry_pulls_its_signed_version_and_no_other(bus: Bus, tmp_path: Path, model: Path) -> None:
    """A registry entry names its file and signs its blake3: only that version travels (a holder of another
    version is no source), and only under a key the pulling node trusts."""
    seed = (tmp_path / "registry.nk", _seed())
    seed[0].write_bytes(seed[1])
    entry = _build_entry(model, "signed", seed[0])  # file_name "tiny.gguf", its blake3 and size
    other = msgspec.structs.replace(entry, name="other", blake3="c" * 64, signature="")
    registry = await buckets.registry(bus, S)
    await registry.put("signed", encode(entry))
    await registry.put("other", encode(sign(other, seed[1])))
    untrusted = await nodes_refusal(bus, tmp_path / "untrusted", model, (), "signed")
    assert untrusted == "not_named"  # no key trusted: the entry names nothing here
    async with nodes(bus, tmp_path / "trusted", model, trusted=(public_key_of(seed[1]),)) as (_, models_b):
        failure = await refused(bus, "b", "other", peer="a")  # a signs another version than it holds
        assert failure.reply.details["reason"] == "no_peer" and leftovers(models_b) == []
        reply = await pull(bus, "b", "signed", peer="a")
        assert reply.blake3 == entry.blake3 == digest_of(models_b / "tiny.gguf")


async def nodes_refusal(bus: Bus, root: Path, model: Path, trusted: tuple[str, ...], name: str) -> str:
    async with nodes(bus, root, model, trusted=trusted):
        return str((await refused(bus, "b", name, peer="a")).reply.details["reason"])


def _seed() -> bytes:
    import nacl.signing
    import nkeys

    return bytes(nkeys.encode_seed(bytes(nacl.signing.SigningKey.generate()), nkeys.PREFIX_BYTE_ACCOUNT))


async def test_clients_reach_no_files_subject_and_a_node_makes_no_other_node_pull(tmp_path: Path) -> None:
    """nats-server itself refuses: a client publishes on no `files` subject, a node asks other nodes only
    `held` and `chunk`, never to pull (a write into their models dir), and serves only its own."""
    from runtime.embedded import EmbeddedNats
    from runtime.roles import Role
    from tests.harness.nats_roles import connect_when_loaded, issued

    server = EmbeddedNats(tmp_path / "node", preferred_port=0, node_id="n1")
    await server.start()
    try:
        async with connect_when_loaded(issued(server, Role("client"))) as client:
            for verb in ("pull", "held", "chunk"):
                await client.nc.publish(S.files("n1", verb), b"{}")
                await client.refused(S.files("n1", verb))
        async with connect_when_loaded(issued(server, Role("node", "n2"))) as n2:
            await n2.nc.publish(S.files("n1", "pull"), b"{}")
            await n2.refused(S.files("n1", "pull"))
            await n2.nc.subscribe(S.files("n1", "chunk"))
            await n2.refused(S.files("n1", "chunk"), "subscription to")
            for allowed in (S.files("n1", "held"), S.files("n1", "chunk"), S.files("n2", "pull")):
                await n2.nc.publish(allowed, b"{}")
            await n2.nc.flush()
            assert not [e for e in n2.errors if "files.n1.held" in e or "files.n2.pull" in e], n2.errors
    finally:
        await server.stop()


async def test_placement_on_a_node_without_the_file_admits_it_from_the_facts_of_the_nodes_that_hold_it(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    """The placing node (`p1`) lacks the catalog's file: it asks the live nodes' files actors for the file's
    header facts and blake3 (`files.<node>.facts`), admits it on node b (which lacks it too: its runner fetches
    it at the stamped digest), and refuses as before when nobody holds it."""
    from actors.placement.actor import PlacementActor
    from actors.placement.geometry import geometry_from_header
    from actors.placement.gguf_header import read_header
    from messages.placement import ModelRef, PlacementDecision, PlacementRequest
    from tests.harness.placement import place, report

    empty = tmp_path / "p1-models"
    empty.mkdir()
    async with nodes(bus, tmp_path, model):
        kv = await buckets.nodes(bus, S)
        for node in ("a", "b"):
            await kv.put(node, encode(report(node, 8 << 30)))
        facts = await bus.request(S.files("a", "facts"), HeldRequest(path="tiny.gguf"), FileFacts, timeout=10)
        assert facts.blake3 == digest_of(model) and facts.geometry == geometry_from_header(read_header(model))
        actor = PlacementActor(models_dir=empty)
        async with supervised(bus, [actor], node_id="p1"):
            async with asyncio.timeout(10):
                while not {"a", "b"} <= set(actor._view):
                    await asyncio.sleep(0.02)
            request = PlacementRequest(model=ModelRef(path="tiny.gguf"), ctx=1024, nodes=("b",))
            decision = await place(bus, request)  # asks again while the actor is still registering
            assert decision.admitted and decision.placements[0].node_id == "b", decision
            assert decision.model_digest == digest_of(model) and decision.architecture == "llama"
            nobody = PlacementRequest(model=ModelRef(path="absent.gguf"), ctx=1024, nodes=("b",))
            refused = await bus.request(S.placement_request, nobody, PlacementDecision, timeout=30)
            assert not refused.admitted and refused.reason == "model_unreadable"


async def status(nats_server: NatsServer, *flags: str) -> tuple[int, str]:
    """`mesh-actor status FLAGS` in process: (exit code, what it printed)."""
    import argparse
    import io

    from runtime.cli import node as node_cli
    from tests.harness.cli import nats_flags

    parser = argparse.ArgumentParser(prog="mesh-actor")
    node_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["status", *flags, *nats_flags(nats_server)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = int(await args.func(args))
    return code, out.getvalue()


async def test_status_shows_which_nodes_hold_each_catalog_and_registry_file(
    bus: Bus, nats_server: NatsServer, tmp_path: Path, model: Path
) -> None:
    """`mesh-actor status` lists every file a front door's catalog or a registry entry names, each version with
    its size, blake3 and the live nodes holding it (asked `files.<node>.held`); a pull adds its node."""
    from messages.frontdoor import FrontDoorModel, FrontDoorReport
    from tests.harness.placement import report

    seed = (tmp_path / "registry.nk", _seed())
    seed[0].write_bytes(seed[1])
    entry = _build_entry(model, "signed", seed[0])  # names tiny.gguf too
    await (await buckets.registry(bus, S)).put("signed", encode(entry))
    kv = await buckets.nodes(bus, S)
    for node in ("a", "b"):
        await kv.put(node, encode(report(node, 1 << 30)))
    models = tuple(
        FrontDoorModel(name=name, path=path, state="stopped", instances=(), held_bytes=0, queued=0, active=0,
                       pinned=False, priority=0, idle_ttl_s=None)
        for name, path in (("tiny", "tiny.gguf"), ("gone", "gone.gguf"))
    )  # fmt: skip
    door = FrontDoorReport(node_id="a", address="http://127.0.0.1:1", auth=False, models=models, sent_at=0.0)
    await (await buckets.frontdoors(bus, S)).put("a", encode(door))
    size, digest = (await asyncio.to_thread(model.stat)).st_size, digest_of(model)
    async with nodes(bus, tmp_path, model, trusted=(public_key_of(seed[1]),)):
        code, out = await status(nats_server, "--json")
        assert code == 0
        files = {f["path"]: f for f in json.loads(out)["model_files"]}
        assert files["tiny.gguf"] == {
            "path": "tiny.gguf", "size": size, "blake3": digest, "models": ["signed", "tiny"], "nodes": ["a"]
        }  # fmt: skip
        assert files["gone.gguf"]["nodes"] == [] and files["gone.gguf"]["blake3"] == ""
        await pull(bus, "b", "tiny", peer="a")
        code, out = await status(nats_server)
        assert code == 0
        (row,) = [line for line in out.splitlines() if line.startswith("tiny.gguf ")]
        assert row.split()[-2:] == ["a,", "b"] and digest[:16] in row and "signed, tiny" in row, out
        (gone,) = [line for line in out.splitlines() if line.startswith("gone.gguf ")]
        assert gone.endswith("(no live node)"), out


def test_status_asks_no_node_with_a_clients_credentials(tmp_path: Path) -> None:
    """nats-server refuses a client's `files.<id>.held` (test_clients_reach_no_files_subject_…): status and
    models do not ask with a client's credentials (each request would wait out its deadline)."""
    import argparse

    from runtime.cli import node as node_cli
    from runtime.cli.models import asks_nodes

    parser = argparse.ArgumentParser(prog="mesh-actor")
    node_cli.register(parser.add_subparsers(dest="command", required=True))
    secret = tmp_path / "password"
    secret.write_text("x\n")
    for user, asks in (("client-0123abcd", False), ("admin", True), ("node-a", True)):
        flags = ["--nats", "nats://127.0.0.1:4222", "--nats-user", user, "--nats-password-file", str(secret)]
        assert asks_nodes(parser.parse_args(["status", *flags])) is asks, user


async def served(bus: Bus, node: str, name: str) -> bool:
    """Whether `node` answers `held` for `name` (False: `not_found`)."""
    try:
        await bus.request(S.files(node, "held"), HeldRequest(path=name), FileHeld, timeout=5)
    except RemoteError as exc:
        assert exc.reply.code == "not_found", exc
        return False
    return True


async def served_within(bus: Bus, node: str, name: str, want: bool) -> None:
    async with asyncio.timeout(10):
        while await served(bus, node, name) != want:
            await asyncio.sleep(0.1)


async def test_a_registry_entry_given_later_is_served_and_goes_with_its_record(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    """The registry is watched: a name a trusted entry gives after the node started is served within the names'
    cache time, and once the entry goes it is `not_found` again."""
    seed = (tmp_path / "registry.nk", _seed())
    seed[0].write_bytes(seed[1])
    async with nodes(bus, tmp_path, model, trusted=(public_key_of(seed[1]),)) as (models_a, _):
        os.link(model, models_a / "signed-late.gguf")
        assert not await served(bus, "a", "signed-late.gguf")
        signed_file = tmp_path / "signed-late.gguf"
        os.link(model, signed_file)
        registry = await buckets.registry(bus, S)
        await registry.put("signed-late", encode(_build_entry(signed_file, "signed-late", seed[0])))
        await served_within(bus, "a", "signed-late.gguf", True)
        await registry.delete("signed-late")
        await served_within(bus, "a", "signed-late.gguf", False)


async def test_a_peers_front_door_report_makes_no_file_travel_that_the_nodes_own_catalog_does_not_name(
    bus: Bus, tmp_path: Path, model: Path
) -> None:
    """Any node writes its own front door report (`MESH_FRONTDOORS.<id>`): one naming a file of a's models dir
    that a's catalog does not name makes a serve it to nobody (`held`, `facts`, `chunk`: `not_found`), and b
    pulls nothing by it (`not_named`). Only a node's own `models.toml` and signed registry entries name files."""
    from messages.frontdoor import FrontDoorModel, FrontDoorReport

    seed = (tmp_path / "registry.nk", _seed())
    seed[0].write_bytes(seed[1])
    async with nodes(bus, tmp_path, model, trusted=(public_key_of(seed[1]),)) as (models_a, models_b):
        os.link(model, models_a / "private.gguf")  # in a's models dir, named by no catalog of a's
        forged = FrontDoorModel(name="private", path="private.gguf", state="stopped", instances=(), held_bytes=0,
                                queued=0, active=0, pinned=False, priority=0, idle_ttl_s=None)  # fmt: skip
        report = FrontDoorReport(node_id="z", address="http://127.0.0.1:1", auth=False, models=(forged,), sent_at=0)
        await (await buckets.frontdoors(bus, S)).put("z", encode(report))
        # A registry entry written after the report: once it is served, the report was there to be read too.
        marker = tmp_path / "marker.gguf"
        os.link(model, marker)
        os.link(model, models_a / "marker.gguf")
        await (await buckets.registry(bus, S)).put("marker", encode(_build_entry(marker, "marker", seed[0])))
        await served_within(bus, "a", "marker.gguf", True)
        digest = digest_of(model)
        for subject, request, kind in (
            (S.files("a", "held"), HeldRequest(path="private.gguf"), FileHeld),
            (S.files("a", "facts"), HeldRequest(path="private.gguf"), FileFacts),
            (S.files("a", "chunk"), ChunkRequest(path="private.gguf", blake3=digest, length=100), bytes),
        ):
            with pytest.raises(RemoteError) as caught:
                await bus.request(subject, request, kind, timeout=5)
            assert caught.value.code == "not_found", subject
        for by in (PullRequest(path="private.gguf", peer="a"), PullRequest(name="private", peer="a")):
            with pytest.raises(RemoteError) as caught:
                await bus.request(S.files("b", "pull"), by, PullReply, timeout=30)
            assert caught.value.reply.details["reason"] == "not_named", by
        assert leftovers(models_b) == [] and not (models_b / "private.gguf").exists()


async def test_a_held_file_is_listed_however_many_names_sort_before_it(bus: Bus, tmp_path: Path) -> None:
    """The holdings list at most `MAX_MODEL_FILES` files: the ones held, not the first names the catalog gives."""
    from messages.telemetry import MAX_MODEL_FILES

    data, models = node_dirs(tmp_path, "a")
    names = [f"m{i:04d}.gguf" for i in range(MAX_MODEL_FILES + 50)]  # held: only the last one
    (models / names[-1]).write_bytes(b"GGUF")
    (data / "models.toml").write_text("".join(f'[models.m{i}]\npath = "{n}"\n' for i, n in enumerate(names)))
    actor = FilesActor("a", data, models_dir=models)
    async with supervised(bus, [actor], node_id="a"):
        async with asyncio.timeout(10):
            while [h[:2] for h in actor.holdings.held] != [(names[-1], 4)]:
                await asyncio.sleep(0.02)
