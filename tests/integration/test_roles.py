"""Roles enforced by a real nats-server: each refusal is the server's, and normal operation needs no more.

An embedded server (as `mesh-actor run` starts it) with users issued through the users file and a reload;
every refusal is proven by the server's own permissions-violation error reaching the client, and by the
state it would have changed being unchanged. A `mesh-actor run` node works on its `node:<id>` user, a
client with `client` credentials runs the read and request commands, and the server logs no violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from actors.placement import decision_records
from messages.events import DecisionInputs
from messages.generate import STREAM_PING_HEADER, GenerateChunk, GenerateRequest, GenerateResult
from messages.placement import ModelRef, PlacementDecision
from runtime import embedded, tls
from runtime.bus import Bus, ConnectFailed, encode
from runtime.cli.journal import StoredEvent, read_events
from runtime.config import NatsOptions
from runtime.creds import CredsFile, issue, read_creds_file
from runtime.embedded import Credentials, EmbeddedNats
from runtime.generate_client import generate
from runtime.roles import Role, inbox_prefix
from tests.conftest import node_process, run_cli
from tests.harness.nats_roles import S, admin_bus, bus_when_loaded, connect_when_loaded, issued, server
from tests.harness.placement import GIB, ask, report
from tests.tiny_models import write_llama

__all__ = ["server"]  # the fixture (tests.harness.nats_roles), taken by name


async def test_a_client_cannot_write_a_ledger_delete_the_journal_or_serve_a_runner(server: EmbeddedNats) -> None:
    bus = await admin_bus(server)
    async with connect_when_loaded(issued(server, Role("client"))) as client:
        kv = await bus.js.create_key_value(bucket=S.reservations_bucket)
        ledger = f"$KV.{S.reservations_bucket}.node.n1"
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
            await client.nc.jetstream().publish(ledger, b'{"node_id": "n1", "reservations": []}', timeout=1)
        await client.refused(ledger)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("node.n1")

        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
            await client.nc.jetstream().delete_stream(S.events_stream)
        await client.refused(f"$JS.API.STREAM.DELETE.{S.events_stream}")
        assert (await bus.js.stream_info(S.events_stream)).config.name == S.events_stream

        await client.nc.subscribe(S.runner("n1", "start"))
        await client.refused(S.runner("n1", "start"), "subscription to")
        with pytest.raises(nats.errors.NoRespondersError):
            await bus.nc.request(S.runner("n1", "start"), b"{}", timeout=2)

        await client.nc.subscribe("_INBOX.>")  # another user's replies
        await client.refused("_INBOX.>", "subscription to")
    await bus.close()


async def test_a_node_cannot_publish_another_nodes_telemetry_events_or_keys(server: EmbeddedNats) -> None:
    bus = await admin_bus(server)
    seen = await bus.nc.subscribe(f"{S.prefix}.>")
    stored = await bus.js.subscribe(S.events_all, stream=S.events_stream, ordered_consumer=True)
    async with connect_when_loaded(issued(server, Role("node", "n2"))) as n2:
        for subject in (
            S.telemetry("n1"),
            S.event("runner", "instance_stopped", "n1"),
            f"$KV.{S.nodes_bucket}.n1",
            f"$KV.{S.instances_bucket}.{S.instance_key('n1', 'abc')}",
            f"$KV.{S.l3_bucket}.n1",
            f"$KV.{S.registry_bucket}.model",
            S.handoff("n1", "probe"),  # a link probe is an operator's request
            S.router_generate("n1"),  # a node's own router serves only its own front door
        ):
            await n2.nc.publish(subject, b"{}")
            await n2.refused(subject)
        # Its own subjects pass: the first message through is its own, and the journal stores its event.
        await n2.nc.publish(S.telemetry("n2"), b"{}")
        msg = await seen.next_msg(timeout=5)
        assert msg.subject == S.telemetry("n2")
        ack = await n2.nc.jetstream().publish(S.event("runner", "instance_stopped", "n2"), b"{}", timeout=5)
        assert ack.stream == S.events_stream
        event = await stored.next_msg(timeout=5)
        assert event.subject == S.event("runner", "instance_stopped", "n2")
        with pytest.raises(nats.errors.TimeoutError):
            await stored.next_msg(timeout=0.3)  # nothing of n1's was stored
        # It may book on any node (placement runs on every node): the remaining trust between nodes.
        kv = await bus.js.create_key_value(bucket=S.reservations_bucket)
        await n2.nc.jetstream().publish(f"$KV.{S.reservations_bucket}.node.n1", b"{}", timeout=5)
        assert (await kv.get("node.n1")).value == b"{}"
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
            await n2.nc.jetstream().delete_stream(S.events_stream)
        await n2.refused(f"$JS.API.STREAM.DELETE.{S.events_stream}")
    await bus.close()


async def test_issuing_a_user_reloads_the_server_without_dropping_connections(server: EmbeddedNats) -> None:
    disconnected = asyncio.Event()

    async def on_disconnect() -> None:
        disconnected.set()

    assert server.credentials is not None
    before = await nats.connect(
        server.credentials.url,
        user=server.credentials.user,
        password=server.credentials.password,
        disconnected_cb=on_disconnect,
    )
    try:
        creds = issued(server, Role("client"))
        async with connect_when_loaded(creds) as joined:
            assert joined.nc.is_connected
        await before.flush(timeout=5)
        assert before.is_connected and not disconnected.is_set()
        users = json.loads((server.data_dir / "users.json").read_text())["users"]
        assert {u["role"] for u in users} == {"node:n1", "client"}
        assert stat.S_IMODE((server.data_dir / "users.json").stat().st_mode) == 0o600
    finally:
        await before.close()


async def test_a_reload_returns_once_the_server_applied_it_whole_and_a_new_user_stays_connected(
    server: EmbeddedNats,
) -> None:
    log = server.data_dir / "nats-server.log"
    for _ in range(3):
        before = log.read_text(errors="replace").count(embedded.RELOADED)
        user = issue(server.data_dir, Role("client"))
        assert embedded.reload(server.data_dir) == server.pid
        assert log.read_text(errors="replace").count(embedded.RELOADED) == before + 1  # applied whole already
        assert server.credentials is not None
        creds = Credentials(server.credentials.url, user.user, user.password, server.credentials.tls_ca)
        client = await nats.connect(creds.url, user=creds.user, password=creds.password, allow_reconnect=False,
                                    inbox_prefix=inbox_prefix(creds.user))  # fmt: skip
        try:
            await client.flush(timeout=5)
            await asyncio.sleep(0.2)
            assert client.is_connected  # not closed by the accounts' rebuild: there was none left to come
        finally:
            await client.close()


def test_a_reload_the_server_refuses_is_an_error_and_one_never_confirmed_returns_at_its_deadline(
    tmp_path: Path,
) -> None:
    log = tmp_path / "nats-server.log"
    log.write_text("[1] old line\n")
    offset = log.stat().st_size
    log.write_text(log.read_text() + f"[1] [ERR] {embedded.RELOAD_FAILED}: bad accounts\n")
    with pytest.raises(embedded.EmbeddedNatsError, match="refused the new configuration"):
        embedded._await_reload(log, offset, 5.0)
    started = time.monotonic()
    embedded._await_reload(log, log.stat().st_size, 0.2)  # nothing more logged: a warning, after its deadline
    assert 0.2 <= time.monotonic() - started < 2.0
    log.write_text("rotated\n" + embedded.RELOADED + "\n")  # the log rotated: smaller than the offset
    embedded._await_reload(log, offset + 1000, 5.0)


async def test_a_client_creates_no_consumer_and_changes_none_of_the_meshs(server: EmbeddedNats) -> None:
    """Issue 17: a client rewrote placement's durable consumer (its filter) and made 300 consumers. A client's
    account has no consumer API: none of these requests is answered, and the mesh's consumers stay as they were."""
    bus = await admin_bus(server)
    stream = S.events_stream
    durable = ConsumerConfig(
        durable_name="placement", filter_subject=S.event("runner", "*", "*"), ack_policy=AckPolicy.EXPLICIT
    )
    await bus.js.add_consumer(stream, durable)
    rewrite = {
        "durable_name": "placement",
        "name": "placement",
        "filter_subject": S.events_all,
        "ack_policy": "explicit",
    }
    ephemeral = {"ack_policy": "none", "deliver_policy": "all", "inactive_threshold": 60_000_000_000}
    async with connect_when_loaded(issued(server, Role("client"))) as client:
        for subject, config in (
            (f"$JS.API.CONSUMER.CREATE.{stream}.placement", rewrite),
            (f"$JS.API.CONSUMER.CREATE.{stream}.placement.{S.events_all}", rewrite),
            (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.placement", rewrite),
            (f"$JS.API.CONSUMER.CREATE.{stream}", ephemeral),
            (f"$JS.API.CONSUMER.DELETE.{stream}.placement", None),
        ):
            body = json.dumps({"stream_name": stream, "config": config} if config else {}).encode()
            with pytest.raises(nats.errors.Error):  # refused, or nothing answers in the client's account
                await client.nc.request(subject, body, timeout=1)
        with pytest.raises((nats.errors.Error, nats.js.errors.Error)):
            await client.nc.jetstream().subscribe(S.events_all, stream=stream, ordered_consumer=True)
    info = await bus.js.stream_info(stream)
    assert info.state.consumer_count == 1
    assert (await bus.js.consumer_info(stream, "placement")).config.filter_subject == durable.filter_subject
    await bus.close()


async def test_a_generates_chunks_and_pings_reach_a_client_across_the_accounts(server: EmbeddedNats) -> None:
    """A runner (a node's user, in the mesh's account) publishes a generate's chunks to the client's inbox and
    pings it there; the client (in its own account) gets the chunks in order and answers the pings, and once it
    is gone a ping meets no responders: the runner's signal to stop."""
    assert server.node_credentials is not None
    runner = await Bus.connect(server.node_credentials.options(), name="runner")
    pongs: list[bytes] = []

    async def serve(msg: Msg) -> None:
        stream = json.loads(msg.data)["stream"]
        for seq, text in enumerate(("a", "b", "c")):
            await runner.nc.publish(stream, encode(GenerateChunk(request_id="r", seq=seq, text=text, tokens=[seq])))
        pong = await runner.nc.request(stream, b"{}", timeout=5, headers={STREAM_PING_HEADER: "1"})
        pongs.append(pong.data)
        result = GenerateResult(
            request_id="r", text="abc", tokens=[0, 1, 2], prompt_tokens=1, source="cold", tokens_restored=0,
            tokens_cached=0, tokens_evaluated=1, ttft_ms=1.0, total_ms=1.0, node="n1", instance="i", slot=0,
            stop_reason="limit",
        )  # fmt: skip
        await msg.respond(encode(result))

    await runner.nc.subscribe(S.generate, cb=serve)
    creds = issued(server, Role("client"))
    client = await bus_when_loaded(creds, "client")
    chunks: list[GenerateChunk] = []

    async def on_chunk(chunk: GenerateChunk) -> None:
        chunks.append(chunk)

    try:
        result = await generate(client, S, GenerateRequest(model="m", prompt="hi", timeout_s=10), on_chunk)
        assert [c.text for c in chunks] == ["a", "b", "c"] and result.text == "abc"
        assert pongs == [b""]
        with pytest.raises(nats.errors.NoRespondersError):  # nobody listens on that inbox any more
            await runner.nc.request(f"{inbox_prefix(creds.user)}.gone", b"{}", timeout=5)
    finally:
        await client.close()
        await runner.close()


async def test_a_client_reads_and_follows_the_journal_without_a_consumer(server: EmbeddedNats) -> None:
    """`mesh-actor events [--follow]` on client credentials: stored events through the imported direct gets, new
    ones heard live through the imported journal subjects; no consumer is created."""
    bus = await admin_bus(server)
    await bus.js.publish(S.event("node", "node_started", "n1"), b'{"n": 0}')
    client = await bus_when_loaded(issued(server, Role("client")), "client")
    got: list[StoredEvent] = []

    async def follow() -> None:
        async for stored in read_events(client, S, "node.>", since=None, follow=True):
            got.append(stored)

    task = asyncio.create_task(follow())
    try:
        async with asyncio.timeout(10):
            while not got:
                await asyncio.sleep(0.01)
            for n in (1, 2):
                await bus.js.publish(S.event("node", "node_started", "n1"), f'{{"n": {n}}}'.encode())
            while len(got) < 3:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [json.loads(e.data)["n"] for e in got] == [0, 1, 2]
    stored = [e.seq async for e in read_events(client, S, None, since="2", follow=False)]
    assert stored == [2, 3]
    assert (await bus.js.stream_info(S.events_stream)).state.consumer_count == 0
    await client.close()
    await bus.close()


async def test_a_client_reads_a_decision_record_without_a_consumer(server: EmbeddedNats) -> None:
    """`mesh-actor replay` on client credentials: the complete inputs of a large decision, kept in the decisions
    object store, are read through the imported direct gets (they were read through a consumer, which a
    client's account cannot create: every such decision was skipped as `record unavailable`)."""
    bus = await admin_bus(server)
    view = tuple(report(f"node-{i}", (4 + i % 7) * GIB) for i in range(800))  # several 128 KiB chunks
    decision = PlacementDecision(decision_id="d1", admitted=False, dry_run=False, model=ModelRef(path="/m.gguf"))
    inputs = DecisionInputs(
        request=ask(), view=view, view_revisions={n.node_id: 1 for n in view}, ledgers=(), geometry=None,
        model_path="/m.gguf", decision=decision,
    )  # fmt: skip
    data, ref = decision_records.encode_record(inputs)
    assert len(data) > 3 * 128 * 1024
    await decision_records.store(await decision_records.open_store(bus, S), data, ref)
    client = await bus_when_loaded(issued(server, Role("client")), "client")
    try:
        assert await decision_records.fetch(client, S, ref) == inputs
        missing = msgspec.structs.replace(ref, blake3="ab" * 32)
        with pytest.raises(decision_records.RecordUnavailable, match="not stored"):
            await decision_records.fetch(client, S, missing)
        with pytest.raises(decision_records.RecordUnavailable, match="not the"):  # a size its event does not name
            await decision_records.fetch(client, S, msgspec.structs.replace(ref, size_bytes=ref.size_bytes - 1))
        stream = f"OBJ_{decision_records.store_name(S)}"
        assert (await bus.js.stream_info(stream)).state.consumer_count == 0
    finally:
        await client.close()
        await bus.close()


async def test_creds_issue_with_a_relative_data_dir_reloads_the_running_server(server: EmbeddedNats) -> None:
    """Issue 17: `creds issue --data-dir` spelled relative to the caller's directory named no running server
    (its config path was compared as text), so the new user was never loaded."""
    relative = os.path.relpath(server.data_dir)  # noqa: ASYNC240 (a string operation, no I/O)
    assert not Path(relative).is_absolute()
    out = server.data_dir.parent / "client.json"
    code, _, err = await cli("creds", "issue", "--role", "client", "--data-dir", relative, "--out", str(out))
    assert code == 0 and f"server pid {server.pid} reloaded" in err, err
    creds = read_creds_file(out)
    assert creds is not None
    async with connect_when_loaded(Credentials(creds.urls[0], creds.user, creds.password)) as client:
        assert client.nc.is_connected


async def test_nats_env_gives_a_standard_client_its_inbox_prefix_and_a_nats_context(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    """Issue 17: `nats-env --creds FILE --json` left out the inbox prefix a role's user must use, so a standard
    client following it timed out on every request."""
    path = tmp_path / "client.json"
    code, _, err = await cli(
        "creds", "issue", "--role", "client", "--data-dir", str(server.data_dir), "--out", str(path)
    )
    assert code == 0, err
    creds = read_creds_file(path)
    assert creds is not None
    code, out, err = await cli("nats-env", "--creds", str(path), "--json")
    assert code == 0, err
    env = json.loads(out)
    assert env["inbox_prefix"] == inbox_prefix(creds.user) and env["user"] == creds.user
    code, out, err = await cli("nats-env", "--creds", str(path))
    assert code == 0 and f"NATS_INBOX_PREFIX={inbox_prefix(creds.user)}" in out.splitlines(), out + err

    config = tmp_path / "config"
    code, out, err = await run_cli(
        "nats-env", "--creds", str(path), "--context", "mesh-client", env={"XDG_CONFIG_HOME": str(config)}
    )
    assert code == 0, err
    saved = config / "nats" / "context" / "mesh-client.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    context = json.loads(saved.read_text())
    assert context["url"] == ",".join(creds.urls) and context["user"] == creds.user
    assert context["password"] == creds.password and context["inbox_prefix"] == inbox_prefix(creds.user)
    code, _, err = await run_cli(
        "nats-env", "--creds", str(path), "--context", "../x", env={"XDG_CONFIG_HOME": str(config)}
    )
    assert code == 2 and "context" in err

    async with connect_when_loaded(Credentials(creds.urls[0], creds.user, creds.password)):
        pass  # the user is loaded
    # A standard client configured from the context alone (nats-py here) reads the mesh's JetStream account.
    nc = await nats.connect(
        context["url"], user=context["user"], password=context["password"], inbox_prefix=context["inbox_prefix"]
    )
    try:
        assert (await nc.jetstream().account_info()).api.total >= 1  # answered: the mesh account counted it
    finally:
        await nc.close()
    # Without the prefix its default inbox is not its to read: the answer never comes.
    bare = await nats.connect(context["url"], user=context["user"], password=context["password"])
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await bare.request("$JS.API.INFO", b"", timeout=1)
    finally:
        await bare.close()


@pytest.mark.parametrize("host", ["0.0.0.0"])
async def test_a_server_beyond_loopback_requires_tls_and_clients_verify_it(tmp_path: Path, host: str) -> None:
    async with EmbeddedNats(tmp_path / "node", preferred_port=0, host=host, node_id="n1") as tls_server:
        creds = tls_server.credentials
        assert creds is not None and creds.tls_ca and creds.url.startswith("tls://")
        config = json.loads((tls_server.data_dir / "nats-server.conf").read_text())
        assert config["listen"].startswith(f"{host}:") and "cert_file" in config["tls"]
        bus = await Bus.connect(creds.options(), name="tls")  # verifies the server against the data dir's CA
        await bus.close()
        port = creds.url.rsplit(":", 1)[1]
        plain = NatsOptions(urls=(f"nats://127.0.0.1:{port}",), user=creds.user, password=creds.password)
        with pytest.raises(ConnectFailed):
            await Bus.connect(plain, name="plain", deadline_s=3)
        unverified = NatsOptions(urls=(creds.url,), user=creds.user, password=creds.password, tls_ca=os.devnull)
        with pytest.raises(ConnectFailed):
            await Bus.connect(unverified, name="unverified", deadline_s=3)
        for address in _non_loopback_addresses():  # the address other machines dial, where there is one
            remote = NatsOptions(
                urls=(f"tls://{address}:{port}",), user=creds.user, password=creds.password, tls_ca=creds.tls_ca
            )
            bus = await Bus.connect(remote, name="remote")
            await bus.close()


def _non_loopback_addresses() -> list[str]:
    return [a for a in tls.primary_address() if not a.startswith("127.")]


# --- the commands, on a node of its own role ---------------------------------------------------------------


errors: list[str] = []


async def cli(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    code, out, err = await run_cli(*args, timeout=timeout)
    errors.append(err)
    return code, out, err


@contextlib.asynccontextmanager
async def node(data_dir: Path, node_id: str, *args: str) -> AsyncIterator[Any]:
    async with node_process(data_dir, node_id, *args, stderr=data_dir.parent / f"{node_id}.stderr") as process:
        yield process


async def test_a_node_and_a_client_work_with_their_roles_rights_only(tmp_path: Path) -> None:
    model = write_llama(tmp_path / "dense.gguf")
    data_dir = tmp_path / "node"
    async with node(data_dir, "n1"):
        creds_path = tmp_path / "client.json"
        code, _, err = await cli(
            "creds", "issue", "--role", "client", "--data-dir", str(data_dir), "--out", str(creds_path)
        )
        assert code == 0, err
        assert stat.S_IMODE(creds_path.stat().st_mode) == 0o600
        creds = read_creds_file(creds_path)
        assert isinstance(creds, CredsFile) and creds.role == "client"

        code, out, err = await cli("nats-env", "--creds", str(creds_path), "--json")
        assert code == 0, err
        env = json.loads(out)
        assert {"url", "user", "password"} <= set(env) and env["user"] == creds.user

        as_client = ("--nats-creds", str(creds_path), "--data-dir", str(tmp_path / "elsewhere"))
        async with asyncio.timeout(30):
            while True:
                code, out, err = await cli("status", "--json", *as_client)
                assert code == 0, err
                if [n["node_id"] for n in json.loads(out)["nodes"]] == ["n1"]:
                    break
                await asyncio.sleep(0.2)
        code, out, err = await cli("place", str(model), "-c", "512", "--fit", "--json", *as_client)
        assert code in (0, 3), err  # a decision, admitted or refused: the request got through
        assert "admitted" in json.loads(out)
        code, out, err = await cli("place", str(model), "-c", "512", "--json", *as_client)
        assert code in (0, 3), err
        code, out, err = await cli("events", "--json", "--subject", "node.node_started", *as_client)
        assert code == 0 and json.loads(out)["event"]["node"] == "n1", err
        code, out, err = await cli("events", "--json", *as_client)
        assert code == 0, err
        subjects = [json.loads(line)["subject"] for line in out.splitlines()]
        assert S.event("node", "node_started", "n1") in subjects
        assert all(s.endswith(".n1") for s in subjects)
        code, out, err = await cli("generate", str(model), "hello", "--json", *as_client)
        assert "invalid_api_key" in out + err, out + err  # a client user bound to no tenant key (issue 30)
        code, out, err = await cli("usage", "--json", *as_client)  # the tenants' usage is not a client's to read
        assert code != 0 and "cannot be read with these credentials: a client's" in err, (code, out, err)

        code, _, err = await cli("creds", "issue", "--role", "node", "--data-dir", str(data_dir))
        assert code == 2 and "--node" in err
    # Neither the node nor the client needed a right it lacks: the server refused nothing of theirs.
    assert "permissions violation" not in (tmp_path / "n1.stderr").read_text().lower()
    assert not [e for e in errors if "permissions violation" in e.lower()], errors


async def test_a_node_listening_beyond_loopback_serves_its_clients_over_verified_tls(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    async with node(data_dir, "n1", "--nats-listen", "0.0.0.0:0"):
        admin = json.loads((data_dir / "nats.json").read_text())
        assert admin["url"].startswith("tls://") and admin["tls_ca"] == str(data_dir / "tls" / "ca.pem")
        creds_path = tmp_path / "client.json"
        code, _, err = await cli(
            "creds", "issue", "--role", "client", "--data-dir", str(data_dir), "--out", str(creds_path)
        )
        assert code == 0, err
        port = admin["url"].rsplit(":", 1)[1]
        url = f"tls://{(tls.primary_address() or ['127.0.0.1'])[0]}:{port}"  # as another machine dials it
        code, out, err = await cli("creds", "issue", "--role", "client", "--data-dir", str(data_dir), "--url", url)
        assert code == 0, err
        remote = tmp_path / "remote.json"
        remote.write_text(out)
        for path in (creds_path, remote):
            async with asyncio.timeout(30):
                while True:
                    code, out, err = await cli(
                        "status", "--json", "--nats-creds", str(path), "--data-dir", str(tmp_path)
                    )
                    assert code == 0, err
                    if [n["node_id"] for n in json.loads(out)["nodes"]] == ["n1"]:
                        break
                    await asyncio.sleep(0.2)
    assert "permissions violation" not in (tmp_path / "n1.stderr").read_text().lower()


async def test_a_clients_forged_reply_subjects_land_nowhere_in_the_mesh(tmp_path: Path) -> None:
    """Issue 17, the confused deputy: nodes (and JetStream) answered on whatever reply subject a requester named,
    so a client's `placement.fit` with reply `$KV.MESH_RESERVATIONS.node.n1` overwrote n1's ledger. A client's
    reply subjects are its own account's: whatever they say, nothing lands in the mesh's."""
    data_dir = tmp_path / "node"
    ledger = f"$KV.{S.reservations_bucket}.node.n1"
    record = f"$KV.{S.instances_bucket}.{S.instance_key('n1', 'forged')}"
    event = S.event("placement", "forged", "n1")
    forged = {  # request subject: reply subjects a node, or JetStream itself, would be allowed to write
        S.placement_fit: (ledger, record, event),
        S.placement_request: (ledger,),
        S.generate: (record, event),
        f"$JS.API.STREAM.INFO.KV_{S.reservations_bucket}": (ledger, event),
        "$JS.API.INFO": (ledger,),
    }
    async with node(data_dir, "n1"):
        admin = embedded.read_credentials(data_dir)
        assert admin is not None
        bus = await Bus.connect(admin.options(), name="admin")
        landed: list[str] = []

        async def on_landed(msg: Msg) -> None:
            landed.append(msg.subject)

        for target in (ledger, record, event):
            await bus.nc.subscribe(target, cb=on_landed)
        await bus.nc.flush(timeout=5)
        user = issue(data_dir, Role("client"))
        assert embedded.reload(data_dir) is not None
        async with connect_when_loaded(Credentials(admin.url, user.user, user.password)) as client:
            async with asyncio.timeout(30):  # each endpoint is up once a request to it is answered (actors
                for subject in forged:  # start independently: the router may still wait for JetStream)
                    while True:
                        try:
                            await client.nc.request(subject, b"x", timeout=2)
                            break
                        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                            await asyncio.sleep(0.1)
            for subject, replies in forged.items():
                for reply in replies:
                    await client.nc.publish(subject, b"x", reply=reply)
            # Each endpoint answers in order: once later requests are answered (twice, so that a second worker
            # of an endpoint has answered too), the forged ones were answered before them.
            for _ in range(2):
                for subject in forged:
                    answer = await client.nc.request(subject, b"x", timeout=10)
                    assert answer.data  # an answer (bad_request, or JetStream's) reached the client's own inbox
        await bus.nc.flush(timeout=5)
        await asyncio.sleep(0)
        assert landed == []
        kv = await bus.js.key_value(S.reservations_bucket)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("node.n1")
        stored = await bus.js.stream_info(S.events_stream, subjects_filter=event)
        assert not stored.state.subjects
        await bus.close()
    assert "permissions violation" not in (tmp_path / "n1.stderr").read_text().lower()
