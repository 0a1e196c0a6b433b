"""The router's view of who asks (`actors.router.actor.as_asked`): a `client` user over NATS is its tenant key's
(the key that names it in `nats_users`), whatever its request claims, and refused when it is bound to no live key
or asks for a model its key may not use; the mesh's own users (a front door) are taken at their word."""

from __future__ import annotations

import msgspec
import pytest

from actors.frontdoor.keys import KeyTable
from actors.router.actor import as_asked
from messages.errors import INVALID_API_KEY, MODEL_NOT_FOUND
from messages.generate import GenerateRequest, RunnerGenerate
from messages.tenants import TenantKey
from runtime.actor import RequestError

CLIENT = "client-0123abcd"


def key(tenant: str = "lab", **fields: object) -> TenantKey:
    return msgspec.convert(
        {"key_id": "0123456789abcdef", "tenant": tenant, "secret_sha256": "0" * 64, "created_at": 1.0,
         "nats_users": [CLIENT], **fields},
        TenantKey,
    )  # fmt: skip


def test_a_client_is_its_keys_tenant_class_share_and_cache_scope_whatever_it_claims() -> None:
    # issue 30: a `client` credential generated on any model with no key, scope or limit
    claimed = GenerateRequest(model="m", prompt="hi", tenant="vip", priority=9, weight=1000.0, cache_scope="x")
    seen = as_asked(claimed, CLIENT, key(priority=2, weight=3.0, cache_group="g"))
    assert (seen.tenant, seen.priority, seen.weight, seen.cache_scope) == ("lab", 2, 3.0, "group:g")
    order = RunnerGenerate(request=seen, request_id="r1", instance_id="i1")  # what the router forwards decodes
    msgspec.json.decode(msgspec.json.encode(order), type=RunnerGenerate)


def test_a_client_bound_to_no_key_or_asking_for_a_model_its_key_may_not_use_is_refused() -> None:
    with pytest.raises(RequestError) as unbound:
        as_asked(GenerateRequest(model="m", prompt="hi"), CLIENT, None)
    assert unbound.value.reply.code == INVALID_API_KEY and "keys issue" in unbound.value.reply.message
    with pytest.raises(RequestError) as scoped:
        as_asked(GenerateRequest(model="other", prompt="hi"), CLIENT, key(models=["m"]))
    assert scoped.value.reply.code == MODEL_NOT_FOUND
    assert as_asked(GenerateRequest(model="m", prompt="hi"), CLIENT, key(models=["m"])).tenant == "lab"


def test_the_key_table_binds_a_user_to_its_newest_live_key_only() -> None:
    table = KeyTable()
    old = key("old")
    newer = msgspec.structs.replace(key("new"), key_id="fedcba9876543210", created_at=2.0)
    expired = msgspec.structs.replace(key("gone"), key_id="00000000aaaaaaaa", created_at=3.0, expires_at=10.0)
    for k in (old, newer, expired):
        table.put(k)
    assert table.bound(CLIENT, now=20.0) == newer  # the expired one, though newest, binds nothing
    assert table.bound("client-other", now=20.0) is None
    table.remove(newer.key_id)
    assert table.bound(CLIENT, now=20.0) == old


def test_the_meshs_own_users_are_taken_at_their_word() -> None:
    claimed = GenerateRequest(model="m", prompt="hi", tenant="team-a", priority=3, weight=2.0)
    assert as_asked(claimed, None) is claimed
