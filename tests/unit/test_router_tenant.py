"""The router's view of who asks (`actors.router.actor.as_asked`): a `client` user over NATS is its own tenant in
the default class, whatever its request claims; the mesh's own users (a front door) are taken at their word."""

from __future__ import annotations

import msgspec

from actors.router.actor import as_asked
from messages.generate import GenerateRequest, RunnerGenerate


def test_a_client_is_its_own_tenant_in_the_default_class_whatever_it_claims() -> None:
    claimed = GenerateRequest(model="m", prompt="hi", tenant="vip", priority=9, weight=1000.0)
    seen = as_asked(claimed, "client-a b/c")
    assert (seen.tenant, seen.priority, seen.weight) == ("nats:client-a_b_c", 0, 1.0)
    # what the router forwards still decodes on the runner
    order = RunnerGenerate(request=seen, request_id="r1", instance_id="i1")
    msgspec.json.decode(msgspec.json.encode(order), type=RunnerGenerate)


def test_the_meshs_own_users_are_taken_at_their_word() -> None:
    claimed = GenerateRequest(model="m", prompt="hi", tenant="team-a", priority=3, weight=2.0)
    assert as_asked(claimed, None) is claimed


def test_a_client_with_a_very_long_name_still_gives_a_valid_tenant() -> None:
    seen = as_asked(GenerateRequest(model="m", prompt="hi"), "client-" + "x" * 300)
    order = RunnerGenerate(request=seen, request_id="r1", instance_id="i1")
    assert msgspec.json.decode(msgspec.json.encode(order), type=RunnerGenerate).request.tenant.startswith("nats:")
