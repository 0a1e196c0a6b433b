"""NATS permission matching: whether a role's subject patterns allow a subject."""

from __future__ import annotations


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
