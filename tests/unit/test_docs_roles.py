"""docs/roles.md is generated from `runtime/roles.py`; these tests fail when the committed file no longer matches it."""

from __future__ import annotations

import pytest

from docs import generate_roles
from runtime import roles


def test_the_roles_table_matches_what_the_generator_renders_from_the_rights() -> None:
    expected = generate_roles.render()
    path = generate_roles.ROLES_MD
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current == expected:
        return
    old, new = current.splitlines(), expected.splitlines()
    line = next((i + 1 for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)) + 1)
    pytest.fail(
        f"docs/roles.md is out of date (first difference at line {line}); "
        f"regenerate it from the repository root with `{generate_roles.COMMAND}` and commit it",
        pytrace=False,
    )


def test_every_publish_and_subscribe_right_of_each_role_is_listed() -> None:
    text = generate_roles.render()
    for role, user, _ in generate_roles.USERS:
        rights = roles.permissions(generate_roles.S, role, user)
        for kind in ("publish", "subscribe"):
            for subject in () if rights is None else rights[kind]["allow"]:
                assert f"`{subject}`" in text, (role, kind, subject)


def test_the_samples_say_what_the_rights_decide() -> None:
    """The sample denials are the ones issue 30 found open (another node's records and journal subjects, the
    tenants' keys, another node's placement consumer); they stay denied, and what a role needs stays allowed."""
    verdicts = {(role, subject): generate_roles.verdict(role, right, subject) for role, right, subject in
                generate_roles.SAMPLES}  # fmt: skip
    assert not verdicts[("node:n1", "$KV.MESH_KEYS.0123456789abcdef")]
    assert not verdicts[("node:n1", "mesh.events.runner.instance_ready.n2")]
    assert not verdicts[("node:n1", "$JS.API.CONSUMER.DURABLE.CREATE.MESH_EVENTS.placement-reservations-n2")]
    assert verdicts[("node:n1", "$JS.API.CONSUMER.MSG.NEXT.MESH_EVENTS.placement-reservations-n1")]
    assert verdicts[("client", "mesh.placement.request")]
    assert sum(not v for v in verdicts.values()) >= 20
    assert generate_roles.main(["--check"]) == 0


def test_matching_follows_nats_wildcards() -> None:
    assert roles.matches("a.*.c", "a.b.c") and not roles.matches("a.*.c", "a.b.d")
    assert roles.matches("a.>", "a.b.c") and not roles.matches("a.>", "a")
    assert roles.matches(">", "$JS.API.>") and not roles.matches("a.b", "a.b.c")
    assert roles.allows(None, "publish", "anything")
    rights = {"publish": {"allow": ["a.>"], "deny": ["a.x"]}}
    assert roles.allows(rights, "publish", "a.y") and not roles.allows(rights, "publish", "a.x")
