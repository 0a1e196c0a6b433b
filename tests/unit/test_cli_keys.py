"""`mesh-actor keys`' own parts that need no bus: expiries, fresh keys, what `ls` shows."""

from __future__ import annotations

import pytest

from actors.frontdoor.keys import KeyTable
from runtime.cli import build_parser
from runtime.cli.common import CliError
from runtime.cli.keys import _public, new_key, parse_expiry

NOW = 1_800_000_000.0


def test_an_expiry_is_a_duration_from_now_or_an_iso_time_in_the_future() -> None:
    assert parse_expiry("90m", NOW) == NOW + 5400
    assert parse_expiry("12h", NOW) == NOW + 43200
    assert parse_expiry("30d", NOW) == NOW + 30 * 86400
    assert parse_expiry("2w", NOW) == NOW + 14 * 86400
    assert parse_expiry("1.5h", NOW) == NOW + 5400
    assert parse_expiry("2030-01-01T00:00:00", NOW) == parse_expiry("2030-01-01T00:00:00+00:00", NOW) == 1893456000.0
    assert parse_expiry("2030-01-01T01:00:00+01:00", NOW) == 1893456000.0
    for bad in ("soon", "-5m", "5 days", "", "2020-01-01T00:00:00Z", "0s"):
        with pytest.raises(CliError) as refused:
            parse_expiry(bad, NOW)
        assert refused.value.code == 2, bad


def test_a_fresh_key_opens_its_record_and_ls_never_shows_its_hash() -> None:
    settings = {"models": ("a", "b"), "priority": 3, "weight": 2.0, "rpm": 5, "tpm": None, "max_concurrent": 2,
                "expires_at": NOW + 60}  # fmt: skip
    key, record = new_key(settings, "lab", NOW)
    other, _ = new_key(settings, "lab", NOW)
    assert key != other and record.tenant == "lab" and record.models == ("a", "b") and record.rpm == 5
    table = KeyTable()
    table.put(record)
    assert table.check(key, NOW) == record
    shown = _public(record)
    assert "secret_sha256" not in shown and record.secret_sha256 not in str(shown) and shown["key_id"] == record.key_id


def test_settings_a_front_door_would_refuse_are_refused_when_issued() -> None:
    for settings, tenant in (({"priority": 10}, "lab"), ({"rpm": 0}, "lab"), ({"weight": 0.0}, "lab"),
                             ({}, "bad name!"), ({}, ""), ({"models": ("",)}, "lab")):  # fmt: skip
        with pytest.raises(CliError) as refused:
            new_key(settings, tenant, NOW)
        assert refused.value.code == 2, (settings, tenant)


def test_revoke_names_a_tenant_or_a_key_never_both_nor_neither() -> None:
    parser = build_parser()
    for argv in (["keys", "revoke"], ["keys", "revoke", "--tenant", "a", "--key-id", "0" * 16]):
        with pytest.raises(SystemExit) as usage:
            parser.parse_args(argv)
        assert usage.value.code == 2
    assert parser.parse_args(["keys", "revoke", "--tenant", "a"]).tenant == "a"
