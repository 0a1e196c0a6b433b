"""Zero-ops cluster: three `mesh-actor run` nodes whose embedded nats-servers form one NATS cluster.

Placement answers through any node; when one node is killed (SIGKILL: its embedded server dies with it,
by the parent-death signal) placement still answers within 10 s through the others, no reservation is lost
or doubled, the journal (replicated on the three servers) keeps every event, and the node restarted on its
data dir rejoins. No llama-server is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from pathlib import Path
from typing import Any

import pytest

from messages.subjects import Subjects
from runtime import tls
from runtime.bus import Bus
from runtime.embedded import read_credentials
from tests.cluster_harness import NODES, cli, cluster
from tests.conftest import processes
from tests.harness.nodes import events_of, status_of
from tests.tiny_models import write_llama


async def route_handshakes(port: int, data_dir: Path) -> tuple[dict[str, object], str]:
    """A route listener speaks only TLS and only to a member: with the node's own route certificate (issued
    under the CA derived from the secret) the handshake passes and the INFO inside says TLS and verification
    are required; without a client certificate the server refuses the handshake (what the second says)."""
    files = tls.route_files(data_dir)
    found: list[dict[str, object]] = []
    refused = ""
    for member in (True, False):
        context = ssl.create_default_context(cafile=str(files.ca))
        if member:
            context.load_cert_chain(str(files.cert), str(files.key))
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"), 5
            )
            try:
                line = await asyncio.wait_for(reader.readline(), 5)
            finally:
                writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await writer.wait_closed()
            assert line.startswith(b"INFO "), line
            info = json.loads(line[5:])
            found.append({k: info.get(k) for k in ("tls_required", "tls_verify")})
        except (ssl.SSLError, ConnectionError) as exc:
            refused = str(exc)
    return found[0] if found else {}, refused


async def replicas(data_dir: Path) -> dict[str, int]:
    """Replicas of the journal stream and the reservations bucket, asked with the node's admin user."""
    creds = read_credentials(data_dir)
    assert creds is not None
    bus = await Bus.connect(creds.options(), name="test", deadline_s=10)
    try:
        subjects = Subjects("mesh")
        found = {}
        for stream in (subjects.events_stream, f"KV_{subjects.reservations_bucket}"):
            info = await bus.js.stream_info(stream)
            found[stream] = info.config.num_replicas or 1
        return found
    finally:
        await bus.close()


async def status(data_dir: Path) -> dict[str, Any]:
    record = await status_of(data_dir)
    assert record is not None, f"no status from {data_dir}"
    return record


async def wait_nodes(data_dir: Path, names: set[str], timeout: float = 30) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(AssertionError, ValueError):
                current = await status(data_dir)
                if {n["node_id"] for n in current["nodes"]} >= names:
                    return current
            await asyncio.sleep(0.3)


async def place(data_dir: Path, model: Path, *extra: str) -> tuple[int, str, str]:
    return await cli("place", str(model), "-c", "512", "--json", "--timeout", "5", *extra, "--data-dir", str(data_dir))


async def events(data_dir: Path) -> list[dict[str, Any]]:
    return await events_of(data_dir)


@pytest.mark.timeout(240)
async def test_three_node_cluster_survives_a_killed_node_and_takes_it_back(tmp_path: Path) -> None:
    model = write_llama(tmp_path / "tiny.gguf")
    async with cluster(tmp_path) as mesh:
        first = mesh.data_dir("c1")
        await wait_nodes(first, set(NODES))
        code, out, err = await place(first, model, "--fit")
        assert code == 0, out + err
        code, out, err = await place(mesh.data_dir("c2"), model)
        assert code == 0, out + err
        before = (await status(first))["reservations"]
        assert len(before) == 1, before
        assert set((await replicas(first)).values()) == {3}
        info, refused = await route_handshakes(mesh.ports["c1"], first)
        assert info == {"tls_required": True, "tls_verify": True} and "certificate" in refused.lower(), refused
        journal_before = await events(first)
        assert journal_before, "the journal is empty"

        # Kill c3 (SIGKILL): its embedded nats-server dies with it (parent-death signal).
        servers = processes("nats-server", str(mesh.data_dir("c3")))
        assert servers, "c3's nats-server is not running"
        mesh.kill("c3")
        await mesh.processes["c3"].wait()
        killed_at = time.monotonic()
        async with asyncio.timeout(10):
            while processes("nats-server", str(mesh.data_dir("c3"))):
                await asyncio.sleep(0.05)
            while True:
                code, out, err = await place(first, model, "--fit", "--node", "c1")
                if code == 0:
                    break
                await asyncio.sleep(0.2)
        assert time.monotonic() - killed_at < 10

        survivor = mesh.data_dir("c2")
        after = (await status(survivor))["reservations"]
        assert sorted(r["reservation_id"] for r in after) == sorted(
            r["reservation_id"] for r in before
        )  # none lost, none doubled
        ids = {e["id"] for e in await events(survivor)}
        assert {e["id"] for e in journal_before} <= ids

        # c3 restarts on its data dir and rejoins: it reports again, and appends to the shared journal.
        await mesh.start("c3")
        await mesh.ready("c3")
        await wait_nodes(first, set(NODES))
        async with asyncio.timeout(30):
            while True:
                started = [e for e in await events(first) if e.get("node") == "c3" and e["id"] not in ids]
                if started:
                    break
                await asyncio.sleep(0.5)
    for name in NODES:
        assert not processes("nats-server", str(mesh.data_dir(name))), f"{name}'s nats-server left behind"
