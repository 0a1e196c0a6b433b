"""A data dir written when every user lived in nats-server's one global account keeps its streams.

Before clients had an account of their own, the embedded server kept the mesh's JetStream in the global
account (`$G`); now it is the `MESH` account's. A standalone store is moved over before the server starts,
so the registry, the journal and the buckets survive the upgrade; a clustered one is left alone.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import nats
import pytest

from runtime import embedded
from runtime.children import free_port
from runtime.embedded import EmbeddedNats, adopt_global_store, find_nats_server

pytestmark = pytest.mark.timeout(120)


def _old_config(data_dir: Path) -> tuple[Path, int]:
    """The embedded server's config of the previous version: every user in `authorization` (the global account)."""
    port = free_port()
    config = data_dir / "old.conf"
    data_dir.mkdir(parents=True)
    record = {
        "listen": f"127.0.0.1:{port}",
        "jetstream": {"store_dir": str(data_dir / "jetstream")},
        "authorization": {"users": [{"user": "mesh", "password": "pw"}]},
    }
    config.write_text(json.dumps(record))
    return config, port


async def _old_server_writes(data_dir: Path) -> None:
    """What the embedded server of the previous version kept: a bucket with a key, in the global account."""
    config, port = _old_config(data_dir)
    server = await asyncio.create_subprocess_exec(
        find_nats_server(), "-c", str(config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        async with asyncio.timeout(20):
            while True:
                try:
                    nc = await nats.connect(f"nats://127.0.0.1:{port}", user="mesh", password="pw", connect_timeout=1)
                    break
                except (nats.errors.Error, OSError):
                    await asyncio.sleep(0.05)
        try:
            kv = await nc.jetstream().create_key_value(bucket="MESH_REGISTRY")
            await kv.put("model", b"signed entry")
        finally:
            await nc.close()
    finally:
        server.terminate()
        async with asyncio.timeout(10):
            await server.wait()


async def test_a_standalone_store_of_the_global_account_is_adopted_by_the_mesh_account(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    await _old_server_writes(data_dir)
    assert (data_dir / "jetstream" / "jetstream" / "$G").is_dir()
    async with EmbeddedNats(data_dir, preferred_port=0, node_id="n1") as server:
        assert server.credentials is not None
        nc = await nats.connect(
            server.credentials.url, user=server.credentials.user, password=server.credentials.password
        )
        try:
            kv = await nc.jetstream().key_value("MESH_REGISTRY")
            assert (await kv.get("model")).value == b"signed entry"
        finally:
            await nc.close()
    assert not (data_dir / "jetstream" / "jetstream" / "$G").exists()
    assert embedded.read_credentials(data_dir) is not None


def test_a_clustered_store_of_the_global_account_is_left_alone(tmp_path: Path) -> None:
    old = tmp_path / "jetstream" / "jetstream" / "$G"
    old.mkdir(parents=True)
    assert not adopt_global_store(tmp_path, clustered=True)
    assert old.is_dir() and not (old.parent / "MESH").exists()
    assert adopt_global_store(tmp_path, clustered=False)
    assert not old.exists() and (old.parent / "MESH").is_dir()
    assert not adopt_global_store(tmp_path, clustered=False)  # once
