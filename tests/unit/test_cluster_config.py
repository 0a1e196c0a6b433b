"""`--cluster-listen`/`--join`/the cluster secret: parsed, validated, and turned into nats-server's cluster block."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats.js.errors
import pytest

from runtime.buckets import _create_placed, next_replicas
from runtime.config import ConfigError, load_config
from runtime.embedded import ClusterSpec, Credentials, ServerRecord, server_config

SECRET = "0123456789abcdef-secret"


def test_no_cluster_by_default(tmp_path: Path) -> None:
    config = load_config({"data_dir": str(tmp_path)}, env={})
    assert config.cluster_listen is None and config.cluster_routes == () and config.cluster_secret is None


def test_flags_env_and_secret_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    flags = {
        "data_dir": str(tmp_path),
        "cluster_listen": "10.0.0.1:6222",
        "join": "10.0.0.2:6222,nats://10.0.0.3:6222,10.0.0.2:6222",
        "cluster_secret_file": str(secret),
    }
    config = load_config(flags, env={})
    assert config.cluster_listen == ("10.0.0.1", 6222)
    assert config.cluster_routes == ("10.0.0.2:6222", "10.0.0.3:6222")
    assert config.cluster_secret == SECRET
    env = {"MESH_ACTOR_CLUSTER_LISTEN": "127.0.0.1:6222", "MESH_ACTOR_JOIN": "127.0.0.1:6223"}
    config = load_config({"data_dir": str(tmp_path)}, env={**env, "MESH_ACTOR_CLUSTER_SECRET": SECRET})
    assert config.cluster_listen == ("127.0.0.1", 6222) and config.cluster_secret == SECRET


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"join": "10.0.0.2:6222"}, "--cluster-listen"),
        ({"cluster_listen": "10.0.0.1:6222"}, "secret"),
        ({"cluster_listen": "127.0.0.1:6222", "nats": "nats://x:4222"}, "--nats"),
        ({"cluster_listen": "10.0.0.1"}, "HOST:PORT"),
    ],
)
def test_refused(tmp_path: Path, values: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"data_dir": str(tmp_path), **values}, env={})


def test_short_secret_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="16"):
        load_config(
            {"data_dir": str(tmp_path), "cluster_listen": "127.0.0.1:6222"}, env={"MESH_ACTOR_CLUSTER_SECRET": "x"}
        )


def test_server_config_cluster_block(tmp_path: Path) -> None:
    admin = Credentials("nats://127.0.0.1:4222", "mesh", "pw")
    plain = server_config(tmp_path, ServerRecord("127.0.0.1", 4222, "mesh", False), admin)
    assert "cluster" not in plain and "server_name" not in plain
    cluster = ClusterSpec("mesh", "127.0.0.1", 6222, ("127.0.0.1:6222", "127.0.0.1:6223"), "a/b secret", "n1")
    config = server_config(tmp_path, ServerRecord("127.0.0.1", 4222, "mesh", False, cluster), admin)
    assert config["server_name"] == "n1"
    assert config["cluster"] == {
        "name": "mesh",
        "listen": "127.0.0.1:6222",
        "authorization": {"user": "route", "password": "a/b secret", "timeout": 5},
        "routes": ["nats://route:a%2Fb%20secret@127.0.0.1:6222", "nats://route:a%2Fb%20secret@127.0.0.1:6223"],
        "tls": {  # routes are TLS, both ends verified under the CA derived from the secret
            "cert_file": str(tmp_path / "tls" / "route" / "route.pem"),
            "key_file": str(tmp_path / "tls" / "route" / "route-key.pem"),
            "ca_file": str(tmp_path / "tls" / "route" / "ca.pem"),
            "verify": True,
            "timeout": 5,
        },
    }
    assert cluster.expected_servers() == 2
    assert ClusterSpec.from_json(cluster.to_json()) == cluster


def test_replicas_are_retried_while_a_young_cluster_cannot_place_them_then_fewer() -> None:
    """A cluster's first seconds refuse R3 ("no suitable peers", "insufficient resources") until its meta group
    knows every server: the same replicas again while patient, then fewer; a standalone server's "not
    clustered" at once; anything else is not about replicas, and one replica is never lowered."""
    for code in (10005, 10023):
        assert next_replicas(3, code, patient=True) == 3
        assert next_replicas(3, code, patient=False) == 2
        assert next_replicas(1, code, patient=False) is None
    assert next_replicas(3, 10074, patient=True) == 2
    assert next_replicas(2, 10074, patient=True) == 1
    assert next_replicas(3, 10058, patient=True) is None
    assert next_replicas(3, None, patient=False) is None


async def test_creation_waits_out_a_young_cluster_then_steps_down_and_takes_what_another_node_made() -> None:
    """The loop around `next_replicas`, with JetStream's answers played back: two "no suitable peers" while
    patient (R3 again), then past the patience R3 -> R2, and "name already in use" returns the existing one."""
    tried: list[int] = []

    def answering(*codes: int) -> Callable[[int], Awaitable[str]]:
        pending = list(codes)

        async def create(replicas: int) -> str:
            tried.append(replicas)
            if pending:
                raise nats.js.errors.APIError(code=400, err_code=pending.pop(0), description="refused")
            return f"R{replicas}"

        return create

    async def existing() -> str:
        return "theirs"

    loop = asyncio.get_running_loop()
    patient = loop.time() + 60
    assert await _create_placed(3, answering(10005, 10005), existing, patient) == ("R3", 3)
    assert tried == [3, 3, 3]
    tried.clear()
    assert await _create_placed(3, answering(10005, 10023), existing, loop.time()) == ("R1", 1)
    assert tried == [3, 2, 1]
    assert await _create_placed(3, answering(10058), existing, patient) == ("theirs", 3)
    with pytest.raises(nats.js.errors.APIError):
        await _create_placed(1, answering(10005), existing, patient)  # one replica is never lowered
