"""Tenants' API keys at the front door (`actors.frontdoor.keys`, pure): the table a watch fills, the check of a
presented key, when a door needs a key at all, and what a key's scope lets it see."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.frontdoor.keys import (
    MAX_PRESENTED,
    KeyRefused,
    KeyTable,
    allows,
    authenticate,
    format_key,
    secret_digest,
)
from messages.tenants import TenantKey, split_key

KEY_ID = "0123456789abcdef"
SECRET = "ab" * 32
NOW = 1_800_000_000.0


def record(key_id: str = KEY_ID, secret: str = SECRET, **fields: object) -> TenantKey:
    return TenantKey(key_id=key_id, tenant="lab", secret_sha256=secret_digest(secret), created_at=NOW - 60,
                     **fields)  # type: ignore[arg-type]  # fmt: skip


def table(*records: TenantKey) -> KeyTable:
    t = KeyTable()
    for r in records:
        t.put(r)
    return t


def refusal(t: KeyTable, presented: str, now: float = NOW) -> str:
    with pytest.raises(KeyRefused) as refused:
        t.check(presented, now)
    return refused.value.reason


def test_a_key_made_from_its_id_and_secret_is_its_records() -> None:
    presented = format_key(KEY_ID, SECRET)
    assert split_key(presented) == (KEY_ID, SECRET)
    assert table(record()).check(presented, NOW) == record()


def test_malformed_unknown_wrong_secret_and_expired_keys_are_refused_each_for_its_reason() -> None:
    t = table(record(), record("fedcba9876543210", "cd" * 32, expires_at=NOW))
    assert refusal(t, "sk-not-ours") == "malformed"
    assert refusal(t, format_key(KEY_ID, SECRET.upper())) == "malformed"  # lowercase hex only
    assert refusal(t, format_key(KEY_ID, SECRET) + " ") == "malformed"
    assert refusal(t, format_key("1111111111111111", SECRET)) == "unknown"
    assert refusal(t, format_key(KEY_ID, "cd" * 32)) == "wrong_secret"
    assert refusal(t, format_key("fedcba9876543210", "cd" * 32), now=NOW) == "expired"  # at its instant
    assert t.check(format_key("fedcba9876543210", "cd" * 32), NOW - 1).tenant == "lab"  # just before


def test_an_unknown_key_and_a_wrong_secret_read_the_same_to_the_client() -> None:
    t = table(record())
    with pytest.raises(KeyRefused) as unknown:
        t.check(format_key("1111111111111111", SECRET), NOW)
    with pytest.raises(KeyRefused) as wrong:
        t.check(format_key(KEY_ID, "cd" * 32), NOW)
    assert str(unknown.value) == str(wrong.value) and SECRET not in str(wrong.value)


def test_a_removed_key_stops_working_and_a_spoiled_record_takes_its_keys_place() -> None:
    t = table(record())
    t.remove(KEY_ID)
    assert refusal(t, format_key(KEY_ID, SECRET)) == "unknown" and not t.holds_any
    t.put(record())
    t.spoil(KEY_ID)  # the record under its key became garbage: the old key opens nothing any more
    assert refusal(t, format_key(KEY_ID, SECRET)) == "unknown" and t.holds_any and len(t) == 0
    t.put(record())
    assert t.check(format_key(KEY_ID, SECRET), NOW) == record() and list(t) == [record()]
    t.spoil("garbage")
    t.remove("garbage")
    assert t.holds_any and len(t) == 1


def test_a_door_without_keys_is_open_but_still_refuses_a_tenant_key_it_does_not_hold() -> None:
    empty = KeyTable()
    assert authenticate(None, admin_key=None, table=empty, now=NOW) is None
    assert authenticate("sk-no-key-required", admin_key=None, table=empty, now=NOW) is None  # clients send one
    with pytest.raises(KeyRefused) as revoked:
        authenticate(format_key(KEY_ID, SECRET), admin_key=None, table=empty, now=NOW)
    assert revoked.value.reason == "unknown"


def test_with_an_admin_key_or_any_tenant_key_every_request_needs_one() -> None:
    keyed = table(record())
    for admin, t in (("admin-key", KeyTable()), (None, keyed), ("admin-key", keyed)):
        with pytest.raises(KeyRefused) as missing:
            authenticate(None, admin_key=admin, table=t, now=NOW)
        assert missing.value.reason == "missing"
        with pytest.raises(KeyRefused) as other:
            authenticate("sk-no-key-required", admin_key=admin, table=t, now=NOW)
        assert other.value.reason == "malformed"
    assert authenticate("admin-key", admin_key="admin-key", table=keyed, now=NOW) is None
    assert authenticate(format_key(KEY_ID, SECRET), admin_key="admin-key", table=keyed, now=NOW) == record()
    assert authenticate(format_key(KEY_ID, SECRET), admin_key=None, table=keyed, now=NOW) == record()
    spoiled = KeyTable()
    spoiled.spoil("forged")  # a bucket holding only garbage still closes the door
    with pytest.raises(KeyRefused):
        authenticate(None, admin_key=None, table=spoiled, now=NOW)


def test_a_huge_or_undecodable_key_is_refused_without_being_read() -> None:
    keyed = table(record())
    for presented in ("x" * (MAX_PRESENTED + 1), "mk_" + "0" * 10_000_000):
        for admin in (None, "admin-key"):
            with pytest.raises(KeyRefused) as refused:
                authenticate(presented, admin_key=admin, table=keyed, now=NOW)
            assert refused.value.reason == "malformed"
    undecodable = "key\udcff\udcfe"  # a header's non-UTF-8 bytes, as aiohttp hands them over
    with pytest.raises(KeyRefused):
        authenticate(undecodable, admin_key="admin-key", table=keyed, now=NOW)
    assert authenticate(undecodable, admin_key=undecodable, table=keyed, now=NOW) is None


@given(st.text(max_size=200))
def test_no_presented_text_crashes_the_check(presented: str) -> None:
    for admin in (None, "admin-key"):
        try:
            authenticate(presented, admin_key=admin, table=table(record()), now=NOW)
        except KeyRefused as exc:
            assert exc.reason in ("malformed", "unknown", "wrong_secret")


def test_a_key_sees_only_its_models_and_a_key_naming_none_sees_all() -> None:
    scoped = record(models=("a", "b"))
    assert allows(scoped, "a") and allows(scoped, "b") and not allows(scoped, "c")
    assert not allows(scoped, "A")  # catalog names are exact
    assert allows(record(), "anything") and allows(None, "anything")
