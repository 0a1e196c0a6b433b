"""Writes `docs/roles.md`: the accounts of the embedded nats-server, what crosses between them, and what each role
may publish, subscribe to and answer, as `runtime.roles` generates them for nats-server.

Everything in the output is read from `runtime.roles.accounts`, so the file changes only when the rights do.
Run from the repository root:

    python -m docs.generate_roles           # rewrite docs/roles.md
    python -m docs.generate_roles --check   # exit 1 if docs/roles.md is out of date

`tests/unit/test_docs_roles.py` fails when the committed file differs from what this renders, and
`tests/integration/test_roles_forged_replies.py` checks the sample denials against a running server.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Literal

from docs.generated import write_or_check
from messages.subjects import Subjects
from runtime import roles
from runtime.roles import Role

COMMAND: Final = "python -m docs.generate_roles"
ROLES_MD: Final = Path(__file__).resolve().parent / "roles.md"

S: Final = Subjects()
#: The users the tables are shown for: an admin, one node and one client.
USERS: Final = (
    (Role("admin"), "mesh", "…"),
    (Role("node", "n1"), "node-n1", "…"),
    (Role("client"), "client-1", "…"),
)

Right = Literal["publish", "subscribe"]
#: Subjects whose verdict the file shows for a role (the role's user of `USERS`): denials first among them, each
#: a refusal the server is checked to make.
SAMPLES: Final[tuple[tuple[str, Right, str], ...]] = (
    ("client", "publish", f"$KV.{S.reservations_bucket}.node.n1"),
    ("client", "publish", f"$KV.{S.keys_bucket}.0123456789abcdef"),
    ("client", "publish", f"$JS.API.DIRECT.GET.KV_{S.keys_bucket}"),
    ("client", "publish", f"$JS.API.STREAM.DELETE.{S.events_stream}"),
    ("client", "publish", f"$JS.API.CONSUMER.CREATE.{S.events_stream}"),
    ("client", "publish", S.runner("n1", "start")),
    ("client", "publish", S.client_placement_request),
    ("client", "subscribe", "_INBOX.>"),
    ("client", "subscribe", S.runner("n1", "start")),
    ("client", "publish", S.placement_request),
    ("client", "publish", f"$JS.API.DIRECT.GET.{S.events_stream}"),
    ("client", "subscribe", S.events_all),
    ("node:n1", "publish", S.telemetry("n2")),
    ("node:n1", "publish", S.event("runner", "instance_ready", "n2")),
    ("node:n1", "publish", f"$KV.{S.nodes_bucket}.n2"),
    ("node:n1", "publish", f"$KV.{S.instances_bucket}.{S.instance_key('n2', 'abc')}"),
    ("node:n1", "publish", f"$KV.{S.keys_bucket}.0123456789abcdef"),
    ("node:n1", "publish", f"$KV.{S.registry_bucket}.model"),
    ("node:n1", "publish", S.handoff("n2", "probe")),
    ("node:n1", "publish", S.files("n2", "pull")),
    ("node:n1", "publish", S.handoff_open("n2", "n3")),  # a handoff opened as another node
    ("node:n1", "publish", f"$JS.API.STREAM.DELETE.{S.events_stream}"),
    ("node:n1", "publish", f"$JS.API.CONSUMER.CREATE.{S.events_stream}"),
    ("node:n1", "publish", f"$JS.API.CONSUMER.DURABLE.CREATE.{S.events_stream}.{roles.placement_consumer('n2')}"),
    ("node:n1", "publish", f"$JS.API.CONSUMER.MSG.NEXT.{S.events_stream}.{roles.placement_consumer('n2')}"),
    ("node:n1", "subscribe", S.runner("n2", "start")),
    ("node:n1", "subscribe", "_INBOX.node-n2.>"),
    ("node:n1", "publish", S.telemetry("n1")),
    ("node:n1", "publish", S.event("runner", "instance_ready", "n1")),
    ("node:n1", "publish", f"$KV.{S.reservations_bucket}.node.n2"),  # placement books on every node
    ("node:n1", "publish", S.handoff_open("n2", "n1")),  # a handoff it opens, as itself
    ("node:n1", "publish", f"$JS.API.CONSUMER.MSG.NEXT.{S.events_stream}.{roles.placement_consumer('n1')}"),
    ("node:n1", "subscribe", S.runner("n1", "start")),
)


def user_of(role: str) -> tuple[Role, str]:
    """The role and user name of `USERS` that `role` (as `SAMPLES` write it) names."""
    return next((r, user) for r, user, _ in USERS if str(r) == role)


def verdict(role: str, right: Right, subject: str) -> bool:
    """Whether the role's user may `right` `subject` (`runtime.roles.allows`)."""
    parsed, user = user_of(role)
    return roles.allows(roles.permissions(S, parsed, user), right, subject)


def _code(subjects: Sequence[str]) -> str:
    return ", ".join(f"`{s}`" for s in subjects) or "none"


def _export_of(block: dict[str, Any], kind: str, subject: str) -> dict[str, Any]:
    """The export of an account that an import of `subject` binds to: the same subject, else one covering it."""
    exports = [e for e in block.get("exports", ()) if kind in e]
    exact = [e for e in exports if e[kind] == subject]
    found: dict[str, Any] = (exact or [e for e in exports if roles.matches(e[kind], subject)])[0]
    return found


def _answers(export: dict[str, Any]) -> str:
    if "service" not in export:
        return "(a stream: no answers)"
    kind = "a stream of answers" if export.get("response_type") == "stream" else "one answer"
    return f"{kind} within {export.get('response_threshold', '2m')}"


def _accounts(lines: list[str], block: dict[str, Any]) -> None:
    lines += [
        "## Accounts",
        "",
        "| account | users | JetStream |",
        "|---|---|---|",
    ]
    for name, account in block.items():
        users = _code([u["user"] for u in account.get("users", ())])
        lines.append(f"| `{name}` | {users} | {account.get('jetstream', 'none')} |")
    lines += [
        "",
        "What crosses between them: each import, the export it binds to in the exporting account, and how the "
        "answers to a request come back (through nats-server's `_R_.…` reply subjects, kept open that long).",
        "",
        "| into | from | kind | subject | as named in `into` | answers |",
        "|---|---|---|---|---|---|",
    ]
    for name, account in block.items():
        for imported in account.get("imports", ()):
            kind = "service" if "service" in imported else "stream"
            source, subject = imported[kind]["account"], imported[kind]["subject"]
            export = _export_of(block[source], kind, subject)
            shared = " (names the requester)" if imported.get("share") else ""
            lines.append(
                f"| `{name}` | `{source}` (export `{export[kind]}`) | {kind}{shared} | `{subject}` "
                f"| `{imported.get('to', subject)}` | {_answers(export)} |"
            )
    lines.append("")


def _role(lines: list[str], role: Role, user: str) -> None:
    lines += [f"### `{role}` (account `{role.account}`, user `{user}`)", ""]
    rights = roles.permissions(S, role, user)
    if rights is None:
        lines += ["Every right: no permissions block.", ""]
        return
    lines += ["| right | subjects |", "|---|---|"]
    lines.append(f"| publish | {_code(rights['publish']['allow'])} |")
    if rights["publish"].get("deny"):
        lines.append(f"| publish, denied | {_code(rights['publish']['deny'])} |")
    lines.append(f"| subscribe | {_code(rights['subscribe']['allow'])} |")
    answer = "the reply subject of a request it received, once" if rights.get("allow_responses") else "nothing more"
    lines += [f"| answer | {answer} (besides the subjects it may publish) |", ""]


def render() -> str:
    """The whole of `docs/roles.md`."""
    block = roles.accounts(S, list(USERS))
    lines = [
        "# Roles and accounts",
        "",
        f"<!-- Generated by `{COMMAND}` from `runtime/roles.py`; edit the code, then regenerate. -->",
        "",
        "What each credential may do on the bus, as the embedded nats-server enforces it (`runtime/roles.py` says "
        "why). Shown for the prefix "
        f"`{S.prefix}`, the node `n1` and the users "
        + ", ".join(f"`{user}` ({role})" for role, user, _ in USERS)
        + ": another node's or client's rights are the same with its own id and inbox.",
        "",
    ]
    _accounts(lines, block)
    lines += ["## What each role may do", ""]
    for role, user, _ in USERS:
        _role(lines, role, user)
    lines += [
        "## Sample verdicts",
        "",
        "nats-server's verdict on a few subjects, from the rights above (`runtime.roles.allows`); each denial "
        "is checked against a running server (`tests/integration/test_roles_forged_replies.py`).",
        "",
        "| role | right | subject | verdict |",
        "|---|---|---|---|",
    ]
    for named, right, subject in SAMPLES:
        judged = "allowed" if verdict(named, right, subject) else "denied"
        lines.append(f"| `{named}` | {right} | `{subject}` | {judged} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return write_or_check(ROLES_MD, render, COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
