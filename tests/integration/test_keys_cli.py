"""`mesh-actor keys` against two `mesh-actor run` nodes with front doors (issue 20's contract), and who may touch
the keys bucket (roles, enforced by a real nats-server).

Node `a` runs the embedded NATS server; node `b` joins it with `node:b` credentials, so both front doors follow
the same keys bucket with a node's rights only. The key `keys issue --data-dir A --json` prints works as
`Authorization: Bearer` on both doors (the official `openai` client) and sees only its models; `keys revoke
--tenant` on node A's data dir refuses every key of the tenant on node B's door within a second; `keys rotate`
replaces a tenant's keys. No model is loaded: listing a catalog needs no llama-server.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import openai
import pytest

from messages.subjects import Subjects
from runtime.children import free_port
from runtime.embedded import EmbeddedNats
from runtime.roles import Role
from tests.conftest import node_process, run_cli
from tests.harness.nats_roles import admin_bus, bus_when_loaded, connect_when_loaded, issued, server
from tests.harness.nodes import joined_node
from tests.tiny_models import write_llama

__all__ = ["server"]  # the fixture, shared with the roles tests

pytestmark = pytest.mark.timeout(240)
S = Subjects()


def write_catalog(data_dir: Path, models: dict[str, Path]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = [f'[models.{name}]\npath = "{path}"\nctx = 512\n' for name, path in models.items()]
    (data_dir / "models.toml").write_text("".join(lines))


def api(port: int, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=10)


async def listed(port: int, key: str) -> list[str] | None:
    """The models the key sees on the door at `port`; None when the key is refused."""
    try:
        return sorted(m.id for m in (await api(port, key).models.list()).data)
    except openai.AuthenticationError:
        return None


async def keys(*args: str) -> Any:
    """`mesh-actor keys ARGS --json`, which must succeed: its output."""
    code, out, err = await run_cli("keys", *args, "--json")
    assert code == 0, err
    return json.loads(out)


async def test_keys_issued_through_node_a_scope_both_doors_and_revoked_there_are_refused_on_b_within_a_second(
    tmp_path: Path,
) -> None:
    models = {"a": write_llama(tmp_path / "a.gguf"), "b": write_llama(tmp_path / "b.gguf", n_layer=3)}
    data_a, data_b = tmp_path / "A", tmp_path / "B"
    write_catalog(data_a, models)
    write_catalog(data_b, models)
    port_a, port_b = free_port(), free_port()
    async with (
        node_process(data_a, "a", "--http", str(port_a), stderr=tmp_path / "a.stderr"),
        joined_node(data_a, data_b, "b", "--http", str(port_b), stderr=tmp_path / "b.stderr") as node_b_creds,
    ):
        joined = ("--nats-creds", str(node_b_creds))
        A = ("--data-dir", str(data_a))
        # a node says "running" as its actors start: its door listens a moment later
        async with asyncio.timeout(30):
            while True:
                try:
                    opened = await listed(port_b, "sk-anything")
                    break
                except openai.APIConnectionError:
                    await asyncio.sleep(0.1)
        assert opened == ["a", "b"]  # no keys yet: the doors are open
        issued_key = await keys("issue", "--tenant", "lab", "--models", "a", "--rpm", "5", *A)
        assert {"key", "key_id", "tenant"} <= set(issued_key)
        key = str(issued_key["key"])
        assert issued_key["tenant"] == "lab" and key.startswith(f"mk_{issued_key['key_id']}_")
        async with asyncio.timeout(5):  # both doors follow the bucket
            while [await listed(port_a, key), await listed(port_b, key)] != [["a"], ["a"]]:
                await asyncio.sleep(0.05)
        with pytest.raises(openai.NotFoundError):
            await api(port_b, key).models.retrieve("b")
        assert await listed(port_b, "sk-anything") is None  # a key exists: the doors are closed
        second = str((await keys("issue", "--tenant", "lab", *A))["key"])
        other = str((await keys("issue", "--tenant", "other", "--models", "b", "--expires", "1d", *A))["key"])

        shown = await keys("ls", *A)
        assert sorted(str(k["tenant"]) for k in shown) == ["lab", "lab", "other"]
        text = json.dumps(shown)
        assert "secret_sha256" not in text and key.rsplit("_", 1)[1] not in text
        assert [k["rpm"] for k in shown if k["models"] == ["a"]] == [5]
        assert len(await keys("ls", "--tenant", "lab", *A)) == 2

        async with asyncio.timeout(5):
            while await listed(port_b, second) != ["a", "b"]:
                await asyncio.sleep(0.05)
        revoked = await keys("revoke", "--tenant", "lab", *A)
        revoked_at = time.monotonic()
        assert len(revoked["revoked"]) == 2
        # on node B, as its watch delivers it: milliseconds; the deadline leaves room for a loaded machine
        async with asyncio.timeout(5.0):
            while await listed(port_b, key) is not None or await listed(port_b, second) is not None:
                await asyncio.sleep(0.02)
        assert time.monotonic() - revoked_at < 5.0
        assert await listed(port_b, other) == ["b"]  # another tenant's key is untouched

        rotated = await keys("rotate", "--tenant", "other", *A)
        assert rotated["models"] == ["b"] and rotated["expires_at"]
        async with asyncio.timeout(5):
            while await listed(port_b, str(rotated["key"])) != ["b"] or await listed(port_b, other) is not None:
                await asyncio.sleep(0.05)

        # a node's credentials read the keys (its front door does) but write none
        code, _, err = await run_cli("keys", "issue", "--tenant", "x", *joined, "--data-dir", str(data_b))
        assert code == 1 and "admin" in err, err
        code, _, err = await run_cli("keys", "revoke", "--key-id", "0" * 16, *A)
        assert code == 1 and "no key" in err
        code, _, err = await run_cli("keys", "issue", "--tenant", "bad name!", *A)
        assert code == 2 and "tenant" in err, err
    for log in ("a.stderr", "b.stderr"):  # neither node needed a right it lacks
        assert "permissions violation" not in (tmp_path / log).read_text().lower(), log


async def test_a_node_reads_the_keys_and_writes_the_limits_and_a_client_reaches_neither(
    server: EmbeddedNats,
) -> None:
    admin = await admin_bus(server)
    kv = await admin.js.create_key_value(bucket=S.keys_bucket)
    await kv.put("0123456789abcdef", b'{"a": "record"}')
    limits = await admin.js.create_key_value(bucket=S.limits_bucket)
    node = await bus_when_loaded(issued(server, Role("node", "n2")), "node")
    try:
        seen = await (await node.js.key_value(S.keys_bucket)).get("0123456789abcdef")
        assert seen.value == b'{"a": "record"}'
        with pytest.raises((nats.errors.Error, nats.js.errors.Error)):
            await node.js.publish(f"$KV.{S.keys_bucket}.0123456789abcdef", b"{}", timeout=1)
        assert (await kv.get("0123456789abcdef")).value == b'{"a": "record"}'
        node_limits = await node.js.key_value(S.limits_bucket)
        await node_limits.put("lab.rpm", b"1")
        assert (await limits.get("lab.rpm")).value == b"1"
    finally:
        await node.close()
    async with connect_when_loaded(issued(server, Role("client"))) as client:
        for stream in (f"KV_{S.keys_bucket}", f"KV_{S.limits_bucket}"):
            for subject in (f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.DIRECT.GET.{stream}.$KV.{stream[3:]}.x"):
                with pytest.raises(nats.errors.Error):  # refused, or nothing answers in the client's account
                    await client.nc.request(subject, b"{}", timeout=1)
    await admin.close()
