"""Cluster routes are TLS, both ends verified under a CA every server derives from the cluster secret: two
embedded servers that share the secret form a cluster with no certificate handed around; a server with the
route password but another secret (so another CA) is refused at the handshake and never joins."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import nats
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from runtime import tls
from runtime.children import port_free
from runtime.embedded import ClusterSpec, EmbeddedNats, EmbeddedNatsError


def _ports(n: int) -> list[int]:
    rng, ports = random.Random(), list[int]()
    while len(ports) < n:  # below the ephemeral range, as in test_cluster
        port = rng.randrange(20000, 32000)
        if port not in ports and port_free(port):
            ports.append(port)
    return ports


def _spec(name: str, port: int, routes: list[int], secret: str) -> ClusterSpec:
    return ClusterSpec(
        name="mesh",
        host="127.0.0.1",
        port=port,
        routes=tuple(f"127.0.0.1:{p}" for p in routes),
        secret=secret,
        server_name=name,
    )


def test_every_server_with_the_secret_derives_the_same_route_ca_and_no_other_does(tmp_path: Path) -> None:
    a = tls.ensure_route_certificates(tmp_path / "a", "shared", ["127.0.0.1"])
    b = tls.ensure_route_certificates(tmp_path / "b", "shared", ["127.0.0.1", "localhost"])
    c = tls.ensure_route_certificates(tmp_path / "c", "another", ["127.0.0.1"])

    def key(path: Path) -> bytes:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        return cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    assert key(a.ca) == key(b.ca) != key(c.ca)
    ca = x509.load_pem_x509_certificate(a.ca.read_bytes())
    for files, trusted in ((a, True), (b, True), (c, False)):
        route = x509.load_pem_x509_certificate(files.cert.read_bytes())
        try:
            route.verify_directly_issued_by(ca)
            verified = True
        except (ValueError, InvalidSignature):
            verified = False
        assert verified is trusted
    assert a.key.stat().st_mode & 0o077 == 0  # the route key is private
    again = tls.ensure_route_certificates(tmp_path / "a", "shared", ["127.0.0.1"])
    assert again.cert.read_bytes() == a.cert.read_bytes()  # kept while it names every address
    moved = tls.ensure_route_certificates(tmp_path / "a", "rotated", ["127.0.0.1"])
    assert key(moved.ca) != key(b.ca)  # a new secret, a new CA: reissued


@pytest.mark.timeout(120)
async def test_servers_sharing_the_secret_form_a_cluster_and_one_with_another_secret_is_refused(
    tmp_path: Path,
) -> None:
    pa, pb, pr = _ports(3)
    routes = [pa, pb]
    a = EmbeddedNats(tmp_path / "a", preferred_port=0, cluster=_spec("a", pa, routes, "s3cret"))
    b = EmbeddedNats(tmp_path / "b", preferred_port=0, cluster=_spec("b", pb, routes, "s3cret"))
    rogue = EmbeddedNats(
        tmp_path / "r", preferred_port=0, ready_timeout_s=6, cluster=_spec("r", pr, [pa, pb, pr], "guessed")
    )
    await asyncio.gather(a.start(), b.start())
    try:
        creds_a, creds_b = a.credentials, b.credentials
        assert creds_a is not None and creds_b is not None
        sub_nc = await nats.connect(creds_b.url, user=creds_b.user, password=creds_b.password)
        pub_nc = await nats.connect(creds_a.url, user=creds_a.user, password=creds_a.password)
        try:
            sub = await sub_nc.subscribe("mesh.test.routed")
            await sub_nc.flush()
            async with asyncio.timeout(10):  # the subscription's interest crosses the route
                while True:
                    await pub_nc.publish("mesh.test.routed", b"over tls")
                    try:
                        msg = await sub.next_msg(timeout=0.2)
                        break
                    except nats.errors.TimeoutError:
                        continue
            assert msg.data == b"over tls"
            # The same route password, another secret: its certificate is not the cluster's CA's.
            with pytest.raises(EmbeddedNatsError):
                await rogue.start()
            log = (tmp_path / "a" / "nats-server.log").read_text(errors="replace").lower()
            assert "tls" in log and ("unknown authority" in log or "bad certificate" in log), log[-2000:]
        finally:
            await sub_nc.close()
            await pub_nc.close()
    finally:
        await rogue.stop()
        await asyncio.gather(a.stop(), b.stop())
