"""Who opens a handoff is bound to the NATS credential, on a real nats-server with issued node credentials.

A node opens a handoff on `<prefix>.handoff.<receiver>.<sender>.open`; nats-server lets a node's credential
publish there with its own id only, and the receiver refuses an open whose `sender_node` differs from the
subject's. So node n2 can neither open as n3 on n3's subject (a permission violation) nor claim to be n3 on its
own subject (refused), nor reach the old subject without a sender (an operator's, not a node's); as itself it
opens, and a real handoff between two nodes' actors with their own credentials commits.
"""

from __future__ import annotations

import random
from pathlib import Path

import nats.errors
import pytest

from actors.handoff.actor import HandoffActor
from messages.handoff import HandoffOpen, HandoffOpened
from runtime.bus import RemoteError, parse_reply
from runtime.bus import encode as encode_message
from runtime.embedded import EmbeddedNats
from runtime.roles import Role
from tests.conftest import supervised
from tests.harness.handoff import FAST, IDENTITY, S, _until
from tests.harness.nats_roles import admin_bus, bus_when_loaded, connect_when_loaded, issued, server  # noqa: F401


def open_as(sender: str, inbox: str) -> bytes:
    request = HandoffOpen(sender_node=sender, identity=IDENTITY, n_tokens=1, max_bytes=1 << 20, credit_subject=inbox)
    return encode_message(request)


async def test_a_node_opens_a_handoff_only_as_itself(server: EmbeddedNats, tmp_path: Path) -> None:  # noqa: F811
    admin = await admin_bus(server)
    n1 = await bus_when_loaded(issued(server, Role("node", "n1")), "n1")
    n3 = await bus_when_loaded(issued(server, Role("node", "n3")), "n3")
    receiver = HandoffActor("n1", tmp_path / "n1", limits=FAST)
    sender = HandoffActor("n3", tmp_path / "n3", limits=FAST)
    try:
        async with supervised(n1, [receiver], node_id="n1"), supervised(n3, [sender], node_id="n3"):
            await _until(lambda: receiver.running and sender.running)
            async with connect_when_loaded(issued(server, Role("node", "n2"))) as n2:
                inbox = n2.nc.new_inbox()
                for subject in (S.handoff_open("n1", "n3"), S.handoff("n1", "open")):
                    with pytest.raises(nats.errors.Error):  # not delivered: nobody answers
                        await n2.nc.request(subject, open_as("n3", inbox), timeout=1)
                    await n2.refused(subject)
                own = S.handoff_open("n1", "n2")
                with pytest.raises(RemoteError) as claimed:
                    parse_reply(own, await n2.nc.request(own, open_as("n3", inbox), timeout=5), HandoffOpened)
                assert claimed.value.code == "bad_request" and "sender_node" in str(claimed.value)
                opened = parse_reply(own, await n2.nc.request(own, open_as("n2", inbox), timeout=5), HandoffOpened)
                assert opened.subject == S.handoff_session("n1", opened.session)
            # a real handoff, each node with its own credential
            data = random.Random(5).randbytes(3 << 20)
            source = tmp_path / "slot.bin"
            source.write_bytes(data)
            report = await sender.send("n1", source, identity=IDENTITY, n_tokens=2)
            assert report.bytes == len(data)
    finally:
        for bus in (n1, n3, admin):
            await bus.close()
