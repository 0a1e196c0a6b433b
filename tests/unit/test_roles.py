"""The permission blocks of each role, derived from the subjects of a mesh (its prefix)."""

from __future__ import annotations

import pytest

from actors.placement.decision_records import store_name
from messages.subjects import Subjects
from runtime.roles import Role, inbox_prefix, permissions, user_entry


def _match(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` one token, `>` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def allowed(rights: dict[str, object], kind: str, subject: str) -> bool:
    block = rights[kind]
    assert isinstance(block, dict)
    return any(_match(p, subject) for p in block["allow"]) and not any(
        _match(p, subject) for p in block.get("deny", ())
    )


S = Subjects("lab-a")


def test_admin_has_no_permissions_block() -> None:
    assert permissions(S, Role("admin"), "admin-1") is None
    assert "permissions" not in user_entry(S, Role("admin"), "admin-1", "pw")


def test_client_requests_placement_and_generate_and_reads_but_writes_nothing() -> None:
    rights = permissions(S, Role("client"), "client-1")
    assert rights is not None
    for subject in (S.placement_request, S.placement_fit, S.generate, "$JS.API.STREAM.INFO.LAB_A_EVENTS"):
        assert allowed(rights, "publish", subject), subject
    for subject in (
        f"$KV.{S.reservations_bucket}.node.n1",
        f"$KV.{S.registry_bucket}.model",
        S.runner("n1", "start"),
        S.event("runner", "instance_stopped", "n1"),
        "$JS.API.STREAM.DELETE.LAB_A_EVENTS",
        "$JS.API.STREAM.PURGE.LAB_A_EVENTS",
        "mesh.placement.request",  # another prefix's mesh
    ):
        assert not allowed(rights, "publish", subject), subject
    assert rights["subscribe"] == {"allow": ["_INBOX.client-1.>"]}
    assert not allowed(rights, "subscribe", S.runner("n1", "start"))


def test_a_node_publishes_only_its_own_telemetry_events_and_keys() -> None:
    rights = permissions(S, Role("node", "n1"), "node-n1")
    assert rights is not None
    own = (
        S.telemetry("n1"),
        S.serving("n1"),
        S.event("runner", "instance_ready", "n1"),
        f"$KV.{S.nodes_bucket}.n1",
        f"$KV.{S.l3_bucket}.n1",
        f"$KV.{S.instances_bucket}.{S.instance_key('n1', 'abc')}",
        f"$KV.{S.reservations_bucket}.node.n2",  # placement books on every node
        S.runner("n2", "generate"),
        S.runner("n2", "start"),  # the front door starts models on demand on any node
        S.l3("n2", "segment"),
        S.handoff("n2", "open"),
    )
    for subject in own:
        assert allowed(rights, "publish", subject), subject
    others = (
        S.telemetry("n2"),
        S.serving("n2"),
        S.event("runner", "instance_ready", "n2"),
        f"$KV.{S.nodes_bucket}.n2",
        f"$KV.{S.l3_bucket}.n2",
        f"$KV.{S.instances_bucket}.{S.instance_key('n2', 'abc')}",
        f"$KV.{S.registry_bucket}.model",
        S.l3("n2", "evict"),
        S.handoff("n2", "probe"),  # an operator's request: it makes n2 send gigabytes
        S.handoff("n1", "probe"),
        "$JS.API.STREAM.DELETE.LAB_A_EVENTS",
        "$JS.API.STREAM.UPDATE.LAB_A_EVENTS",
        "$JS.API.STREAM.PURGE.KV_LAB_A_RESERVATIONS",
    )
    for subject in others:
        assert not allowed(rights, "publish", subject), subject
    serves = (S.runner("n1", "start"), S.l3("n1", "segment"), S.handoff("n1", "probe"), S.generate, S.placement_request)
    for subject in (*serves, S.event("handoff", "link_measured", "n2"), "$SRV.PING"):
        assert allowed(rights, "subscribe", subject), subject
    for subject in (S.runner("n2", "start"), S.l3("n2", "segment"), "_INBOX.client-1.x"):
        assert not allowed(rights, "subscribe", subject), subject


def test_the_decisions_store_named_by_roles_is_placements() -> None:
    rights = permissions(S, Role("node", "n1"), "node-n1")
    assert rights is not None
    assert allowed(rights, "publish", f"$JS.API.STREAM.CREATE.OBJ_{store_name(S)}")
    assert allowed(rights, "publish", f"$O.{store_name(S)}.C.x")


def test_roles_parse_and_refuse_what_is_not_a_role() -> None:
    assert Role.parse("node:n1") == Role("node", "n1") and str(Role("node", "n1")) == "node:n1"
    assert Role.parse("client") == Role("client")
    for text in ("node", "client:n1", "root", "node:a.b"):
        with pytest.raises(ValueError):
            Role.parse(text)
    assert inbox_prefix("node-n1") == "_INBOX.node-n1"
    with pytest.raises(ValueError):
        inbox_prefix("a.b")
