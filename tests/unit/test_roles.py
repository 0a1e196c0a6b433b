"""The permission blocks of each role, derived from the subjects of a mesh (its prefix)."""

from __future__ import annotations

import pytest

from actors.placement.decision_records import store_name
from messages.subjects import Subjects
from runtime.creds import user_name
from runtime.roles import (
    CLIENT_ACCOUNT,
    MESH_ACCOUNT,
    NODE_ACCOUNT,
    Role,
    accounts,
    inbox_prefix,
    is_client_user,
    jetstream_subjects,
    permissions,
    placement_consumer,
    requesting_client,
    user_entry,
)
from tests.harness.permissions import allowed

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
        S.router_generate("n1"),  # a node's own router: its front door's, never a client's
        S.event("runner", "instance_stopped", "n1"),
        "$JS.API.STREAM.DELETE.LAB_A_EVENTS",
        "$JS.API.STREAM.PURGE.LAB_A_EVENTS",
        "mesh.placement.request",  # another prefix's mesh
    ):
        assert not allowed(rights, "publish", subject), subject
    for subject in (  # no consumer of its own, none of the mesh's created or changed
        "$JS.API.CONSUMER.CREATE.LAB_A_EVENTS",
        "$JS.API.CONSUMER.CREATE.LAB_A_EVENTS.placement",
        "$JS.API.CONSUMER.DURABLE.CREATE.LAB_A_EVENTS.placement",
        "$JS.API.CONSUMER.DELETE.LAB_A_EVENTS.placement",
        "$JS.FC.LAB_A_EVENTS.x",
    ):
        assert not allowed(rights, "publish", subject), subject
    assert rights["subscribe"] == {"allow": ["_INBOX.clients.client-1.>", S.events_all]}
    assert not allowed(rights, "subscribe", S.runner("n1", "start"))


def test_clients_live_in_their_own_account_and_import_only_what_they_may_request() -> None:
    users = [
        (Role("admin"), "mesh", "pw0"),
        (Role("node", "n1"), "node-n1", "pw1"),
        (Role("client"), "client-1", "pw2"),
        (Role("client"), "client-2", "pw3"),
    ]
    block = accounts(S, users)
    assert set(block) == {MESH_ACCOUNT, NODE_ACCOUNT, CLIENT_ACCOUNT}
    jetstream, nodes, clients = block[MESH_ACCOUNT], block[NODE_ACCOUNT], block[CLIENT_ACCOUNT]
    assert [u["user"] for u in nodes["users"]] == ["mesh", "node-n1"]
    assert [u["user"] for u in clients["users"]] == ["client-1", "client-2"]
    assert "jetstream" not in clients and "jetstream" not in nodes  # no consumers, no streams of their own
    services = [i for i in clients["imports"] if "service" in i]
    imported = {i.get("to", i["service"]["subject"]) for i in services}  # as clients name them
    # The mesh's requests come from the nodes' account, JetStream's reads straight from JetStream's.
    from_nodes = {i.get("to", i["service"]["subject"]) for i in services if i["service"]["account"] == NODE_ACCOUNT}
    assert from_nodes == {S.placement_request, S.placement_fit, S.generate}
    assert all(s.startswith("$JS.API.") for s in imported - from_nodes)
    # A client's placement.request arrives on its own subject in NODES, with the client named by the server.
    (booking,) = [i for i in services if i.get("to") == S.placement_request]
    assert booking == {
        "service": {"account": NODE_ACCOUNT, "subject": S.client_placement_request},
        "to": S.placement_request,
        "share": True,
    }
    # A client's generate too: the router makes the client its tenant in the queue, whatever the request says.
    generate = {"service": {"account": NODE_ACCOUNT, "subject": S.generate}, "share": True}
    assert [i for i in services if "to" in i or "share" in i] == [booking, generate]
    # What a client requested before the accounts: placement, generate, the reads of the mesh's streams.
    assert {S.placement_request, S.placement_fit, S.generate, "$JS.API.INFO"} <= imported
    assert "$JS.API.DIRECT.GET.LAB_A_EVENTS" in imported
    assert not [s for s in imported if ".CONSUMER." in s or s.startswith(("$KV.", "$O.", "$JS.ACK", "$JS.FC"))]
    assert not [s for s in imported if S.runner("n1", "start") == s or ".l3." in s or ".handoff." in s]
    assert imported == set(permissions(S, Role("client"), "client-1")["publish"]["allow"])  # type: ignore[index]
    streams = [i["stream"] for i in clients["imports"] if "stream" in i]
    assert streams == [{"account": NODE_ACCOUNT, "subject": S.events_all}]
    to_clients = [e for e in (*nodes["exports"], *jetstream["exports"]) if e["accounts"] == [CLIENT_ACCOUNT]]
    exported = {e["service"]: e for e in to_clients if "service" in e}
    assert [e for e in to_clients if "stream" in e] == [{"stream": S.events_all, "accounts": [CLIENT_ACCOUNT]}]
    assert set(exported) == {i["service"]["subject"] for i in services}
    assert all(e["accounts"] == [CLIENT_ACCOUNT] for e in nodes["exports"])
    assert S.placement_request not in exported  # only the clients' own subject: no way around the share
    assert exported["$JS.API.DIRECT.GET.LAB_A_EVENTS"]["response_type"] == "stream"  # batches answer many times
    assert "response_type" not in exported[S.placement_fit]
    # Long enough for the longest generation (timeout_s up to an hour) to be answered.
    assert exported[S.generate]["response_threshold"] == "3660s"
    # The way back for a generate's chunks and pings: the clients' inboxes, and nothing else of the mesh's; the
    # same on every server whichever users it has (a runner on one server reaches a client issued on another).
    from_clients = [i["service"] for i in nodes["imports"] if i.get("service", {}).get("account") == CLIENT_ACCOUNT]
    assert from_clients == [{"account": CLIENT_ACCOUNT, "subject": "_INBOX.clients.>"}]
    assert clients["exports"] == [{"service": "_INBOX.clients.>", "accounts": [NODE_ACCOUNT]}]
    alone = accounts(S, users[:2])
    assert alone[NODE_ACCOUNT]["imports"] == nodes["imports"] and alone[CLIENT_ACCOUNT]["exports"] == clients["exports"]
    for user in ("mesh", "node-n1"):  # no mesh user's inbox is in the clients' namespace
        assert not inbox_prefix(user).startswith("_INBOX.clients.")


def test_jetstream_lives_in_an_account_of_no_user_that_the_nodes_reach_through_one_export() -> None:
    """Issue 30 F1: JetStream answered a node on whatever reply subject it named, in its own account, where that
    subject could be a stream's. In an account of its own it answers on nats-server's reply subjects, and every
    subject of the nodes' account that leads back to it is an import of the same one export, which nats-server
    does not let a message pass twice."""
    block = accounts(S, [(Role("admin"), "mesh", "pw0"), (Role("node", "n1"), "node-n1", "pw1")])
    jetstream, nodes = block[MESH_ACCOUNT], block[NODE_ACCOUNT]
    assert jetstream["jetstream"] == "enabled" and "users" not in jetstream
    to_nodes = [e for e in jetstream["exports"] if e["accounts"] == [NODE_ACCOUNT]]
    assert to_nodes == [
        {"service": ">", "accounts": [NODE_ACCOUNT], "response_type": "stream", "response_threshold": "30s"},
        {"stream": "_INBOX.>", "accounts": [NODE_ACCOUNT]},  # push consumers' deliveries
    ]
    from_jetstream = [i for i in nodes["imports"] if MESH_ACCOUNT in (i.get("service") or i["stream"])["account"]]
    assert [i["service"]["subject"] for i in from_jetstream if "service" in i] == jetstream_subjects(S)
    assert {"$JS.API.>", "$JS.ACK.>", "$KV.>", "$O.>", S.events_all} <= set(jetstream_subjects(S))
    assert [i["stream"] for i in from_jetstream if "stream" in i] == [{"account": MESH_ACCOUNT, "subject": "_INBOX.>"}]
    assert not [i for i in nodes["imports"] if "to" in i]  # every subject keeps its name: streams see what was sent


def test_a_users_name_must_say_whether_it_is_a_client() -> None:
    assert is_client_user(user_name(Role("client"))) and not is_client_user(user_name(Role("admin")))
    with pytest.raises(ValueError, match="client-"):
        accounts(S, [(Role("admin"), "client-x", "pw")])
    with pytest.raises(ValueError, match="client-"):
        accounts(S, [(Role("client"), "alice", "pw")])


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
        S.handoff_open("n2", "n1"),  # a handoff opened on n2 by n1 (its own id in the subject)
        S.handoff_session("n2", "ab" * 16, "data"),
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
        S.handoff_open("n2", "n3"),  # a handoff opened as another node
        S.handoff("n2", "open"),  # an open naming no sender: an operator's
        S.handoff("n1", "probe"),
        "$JS.API.STREAM.DELETE.LAB_A_EVENTS",
        "$JS.API.STREAM.UPDATE.LAB_A_EVENTS",
        "$JS.API.STREAM.PURGE.KV_LAB_A_RESERVATIONS",
    )
    for subject in others:
        assert not allowed(rights, "publish", subject), subject
    # A node never poses as a client: what arrives on the clients' subject came through their account.
    assert not allowed(rights, "publish", S.client_placement_request)
    serves = (S.runner("n1", "start"), S.l3("n1", "segment"), S.handoff("n1", "probe"), S.generate, S.placement_request)
    for subject in (*serves, S.client_placement_request, S.event("handoff", "link_measured", "n2"), "$SRV.PING"):
        assert allowed(rights, "subscribe", subject), subject
    assert allowed(rights, "subscribe", S.events_all)  # `events --follow` hears new events live
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
    assert inbox_prefix("node-n1") == "_INBOX.node-n1" and inbox_prefix("client-1") == "_INBOX.clients.client-1"
    with pytest.raises(ValueError):
        inbox_prefix("a.b")


def test_the_requesting_client_is_the_user_the_server_names_in_its_request_info() -> None:
    info = '{"acc": "CLIENTS", "user": "client-ab12", "host": "127.0.0.1"}'
    assert requesting_client({"Nats-Request-Info": info}) == "client-ab12"
    for headers in (
        None,
        {},
        {"Nats-Request-Info": '{"acc": "MESH", "user": "node-n1"}'},  # not a client
        {"Nats-Request-Info": '{"acc": "CLIENTS"}'},
        {"Nats-Request-Info": '{"acc": "CLIENTS", "user": 7}'},
        {"Nats-Request-Info": "not json"},
        {"Nats-Request-Info": "[1, 2]"},
    ):
        assert requesting_client(headers) is None, headers


def test_tenants_keys_are_read_by_nodes_written_by_admins_only_and_never_reach_a_client() -> None:
    """Issue 20: the keys bucket holds the tenants' key hashes, scopes and limits; the limits bucket their shared
    counters. A node's front door follows the keys and updates the counters; a client sees neither."""
    node = permissions(S, Role("node", "n1"), "node-n1")
    client = permissions(S, Role("client"), "client-1")
    assert node is not None and client is not None
    keys, limits = f"KV_{S.keys_bucket}", f"KV_{S.limits_bucket}"
    for stream in (keys, limits):
        for subject in (  # a node opens (or creates) the bucket and watches it
            f"$JS.API.STREAM.CREATE.{stream}",
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.$KV.x.k",
            f"$JS.API.CONSUMER.CREATE.{stream}.watch.$KV.x.>",
            f"$JS.FC.{stream}.x",
        ):
            assert allowed(node, "publish", subject), subject
        for subject in (f"$JS.API.STREAM.UPDATE.{stream}", f"$JS.API.STREAM.DELETE.{stream}",
                        f"$JS.API.STREAM.PURGE.{stream}"):  # fmt: skip
            assert not allowed(node, "publish", subject), subject
        for subject in (f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
                        f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.$KV.x.k"):  # fmt: skip
            assert not allowed(client, "publish", subject), subject
    assert not allowed(node, "publish", f"$KV.{S.keys_bucket}.0123456789abcdef")  # an admin's to write
    assert allowed(node, "publish", f"$KV.{S.limits_bucket}.lab.rpm")  # every front door updates the counters
    assert not allowed(client, "publish", f"$KV.{S.keys_bucket}.0123456789abcdef")
    assert not allowed(client, "publish", f"$KV.{S.limits_bucket}.lab.rpm")
    block = accounts(S, [(Role("admin"), "mesh", "pw")])
    exported = [e.get("service") for e in (*block[MESH_ACCOUNT]["exports"], *block[NODE_ACCOUNT]["exports"])
                if e["accounts"] == [CLIENT_ACCOUNT]]  # fmt: skip
    assert not [s for s in exported if s and (keys in s or limits in s)]


def test_a_node_touches_no_consumer_of_the_journal_but_its_own_placements() -> None:
    """Issue 30 F16: every node could create (so change) placement's one shared durable, and pull from it. Each
    node's placement now has its own, and a node's rights name only its own; an ephemeral create, which names its
    consumer in the body, is not a node's on the journal at all (it reads the journal with direct gets)."""
    rights = permissions(S, Role("node", "n1"), "node-n1")
    assert rights is not None
    events = S.events_stream
    own, theirs = placement_consumer("n1"), placement_consumer("n2")
    assert own == "placement-reservations-n1"
    for subject in (
        f"$JS.API.CONSUMER.CREATE.{events}.{own}.{S.prefix}.events.runner.>",
        f"$JS.API.CONSUMER.CREATE.{events}.{own}",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{events}.{own}",
        f"$JS.API.CONSUMER.INFO.{events}.{own}",
        f"$JS.API.CONSUMER.MSG.NEXT.{events}.{own}",
        f"$JS.ACK.{events}.{own}.1.7.7.1700000000000000000.0",
        f"$JS.API.DIRECT.GET.{events}",  # the journal is read with direct gets
    ):
        assert allowed(rights, "publish", subject), subject
    for name in (theirs, "placement-reservations"):  # another node's, and the one every node shared before
        for subject in (
            f"$JS.API.CONSUMER.CREATE.{events}.{name}.{S.prefix}.events.nothing.>",
            f"$JS.API.CONSUMER.CREATE.{events}.{name}",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{events}.{name}",
            f"$JS.API.CONSUMER.MSG.NEXT.{events}.{name}",
            f"$JS.ACK.{events}.{name}.1.7.7.1700000000000000000.0",
        ):
            assert not allowed(rights, "publish", subject), subject
    assert not allowed(rights, "publish", f"$JS.API.CONSUMER.CREATE.{events}")  # a name in the body: any consumer
    assert not allowed(rights, "publish", f"$JS.API.CONSUMER.DELETE.{events}.{own}")
    with pytest.raises(ValueError):
        placement_consumer("n1.x")
