"""Roles: what each kind of credential may do on the bus, as the permission block nats-server enforces.

Pure: from a mesh's `Subjects` (its prefix) and a role, the `permissions` of one user in nats-server's
`authorization { users = [...] }`. Nothing in our code checks these rights; nats-server does, so a refusal
is the server's (`Permissions Violation`) and no actor is a security boundary.

- `client` requests `placement.request`, `placement.fit` and `generate`, answers the stream pings of a
  generate, and reads the buckets and the journal (the JetStream calls that reading needs: stream info,
  ephemeral consumers, direct gets, flow control). It writes nothing and serves nothing.
- `node:<id>` publishes only its own telemetry, serving reports, events (`<prefix>.events.*.*.<id>`) and
  bucket keys (`MESH_NODES.<id>`, `MESH_L3.<id>`, `MESH_INSTANCES.<id>.>`), serves its own runner, L3 and
  handoff subjects and the queue groups every node serves (placement, generate), and requests other nodes'
  runner `generate`/`tokenize`/`template`/`start`/`stop` (router and front door), L3 peer fetch and handoff
  subjects (but not another node's link probe, `handoff.<id>.probe`: an admin's request). Placement runs on
  every node and books memory on any node by compare-and-set, so a node may write every reservation ledger
  (and start or stop instances anywhere): that is the trust that remains between nodes. It may create the
  mesh's streams and buckets (an idempotent create cannot alter an existing one) but not update, delete or
  purge them (the decisions object store excepted: replacing an object purges its old chunks).
- `admin` may do everything (stream and bucket management, registry writes, L3 admin).

Every user receives its replies on its own inbox prefix `_INBOX.<user>` (the bus sets it from the user
name), so no client can read another's replies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from messages.subjects import Subjects, check_token

RoleKind = Literal["client", "node", "admin"]
ROLE_KINDS: Final = ("client", "node", "admin")
INBOX_ROOT: Final = "_INBOX"


@dataclass(frozen=True, slots=True)
class Role:
    """A role; `node` names the node a `node` role acts for."""

    kind: RoleKind
    node: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROLE_KINDS:
            raise ValueError(f"unknown role {self.kind!r}: use one of {', '.join(ROLE_KINDS)}")
        if (self.kind == "node") != (self.node is not None):
            raise ValueError("a node role names its node (node:<id>); other roles name none")
        if self.node is not None:
            check_token(self.node, "node id")

    @classmethod
    def parse(cls, text: str) -> Role:
        """`client`, `admin` or `node:<id>`."""
        kind, _, node = text.partition(":")
        if kind not in ROLE_KINDS:
            raise ValueError(f"unknown role {text!r}: use client, admin or node:<id>")
        return cls(kind, node or None)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"node:{self.node}" if self.node else self.kind


def inbox_prefix(user: str) -> str:
    """Where `user` receives replies: `_INBOX.<user>` (a user name that is one subject token)."""
    return f"{INBOX_ROOT}.{check_token(user, 'user name')}"


def _streams(subjects: Subjects) -> dict[str, str]:
    """The JetStream streams of a mesh, by what they hold (a KV bucket `X` is stream `KV_X`)."""
    decisions = subjects.events_stream.removesuffix("_EVENTS") + "_DECISIONS"  # actors/placement/decision_records
    return {
        "events": subjects.events_stream,
        "nodes": f"KV_{subjects.nodes_bucket}",
        "reservations": f"KV_{subjects.reservations_bucket}",
        "registry": f"KV_{subjects.registry_bucket}",
        "instances": f"KV_{subjects.instances_bucket}",
        "l3": f"KV_{subjects.l3_bucket}",
        "frontdoors": f"KV_{subjects.frontdoors_bucket}",
        "decisions": f"OBJ_{decisions}",
    }


def _reading(streams: list[str]) -> list[str]:
    """Publish rights that reading these streams needs: their info, ephemeral (ordered) consumers, direct and
    stored-message gets, the consumers' flow control, and the account info a client may check first."""
    rights = ["$JS.API.INFO"]
    for s in streams:
        rights += [
            f"$JS.API.STREAM.INFO.{s}",
            f"$JS.API.CONSUMER.CREATE.{s}",
            f"$JS.API.CONSUMER.CREATE.{s}.>",
            f"$JS.API.CONSUMER.INFO.{s}.*",
            f"$JS.API.DIRECT.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}.>",
            f"$JS.API.STREAM.MSG.GET.{s}",
            f"$JS.FC.{s}.>",
        ]
    return rights


def permissions(subjects: Subjects, role: Role, user: str) -> dict[str, Any] | None:
    """The nats-server `permissions` of `user` acting in `role`; None for `admin` (no restriction)."""
    if role.kind == "admin":
        return None
    p = subjects.prefix
    streams = _streams(subjects)
    inbox = f"{inbox_prefix(user)}.>"
    if role.kind == "client":
        publish = [subjects.placement_request, subjects.placement_fit, subjects.generate]
        publish += _reading(list(streams.values()))
        return {
            "publish": {"allow": publish},
            "subscribe": {"allow": [inbox]},
            "allow_responses": True,  # answering a generate's stream pings (a reply to a request received)
        }
    node = role.node
    assert node is not None
    own = [
        subjects.telemetry(node),
        subjects.serving(node),
        subjects.events_from(node),
        f"$KV.{subjects.nodes_bucket}.{node}",
        f"$KV.{subjects.l3_bucket}.{node}",
        f"$KV.{subjects.frontdoors_bucket}.{node}",
        f"$KV.{subjects.instances_bucket}.{subjects.instance_key(node, '>')}",
        f"{p}.runner.{node}.>",
        f"{p}.l3.{node}.>",
        f"{p}.handoff.{node}.>",
    ]
    mesh = [
        subjects.placement_request,
        subjects.placement_fit,
        subjects.generate,
        f"$KV.{subjects.reservations_bucket}.>",  # placement books on every node (compare-and-set)
        f"$O.{streams['decisions'].removeprefix('OBJ_')}.>",  # placement's decision records
        f"{p}.runner.*.generate",  # the router forwards to the chosen runner
        f"{p}.runner.*.tokenize",
        f"{p}.runner.*.template",  # the front door renders chats with the model's template
        f"{p}.runner.*.prefill",  # a decoding node asks another to prefill and hand the state off
        f"{p}.runner.*.start",  # the front door starts models on demand, and makes room, on any node
        f"{p}.runner.*.stop",
        f"{p}.l3.*.manifests",  # peer fetch
        f"{p}.l3.*.manifest",
        f"{p}.l3.*.segment",
        f"{p}.handoff.*.>",  # a handoff to the receiving node
        f"{INBOX_ROOT}.>",  # replies, generate stream chunks and pings go to the requester's inbox
    ]
    jetstream = _reading(list(streams.values()))
    jetstream += [f"$JS.API.STREAM.CREATE.{s}" for s in streams.values()]  # idempotent: alters nothing existing
    jetstream += [
        f"$JS.API.CONSUMER.DURABLE.CREATE.{streams['events']}.*",  # placement's runner-events consumer
        f"$JS.API.CONSUMER.MSG.NEXT.{streams['events']}.*",
        f"$JS.ACK.{streams['events']}.>",
        f"$JS.API.STREAM.PURGE.{streams['decisions']}",  # replacing an object purges its old chunks
    ]
    serve = [
        f"{p}.runner.{node}.>",
        f"{p}.l3.{node}.>",
        f"{p}.handoff.{node}.>",
        subjects.placement_request,
        subjects.placement_fit,
        subjects.generate,
        subjects.serving_all,  # routers read every node's serving reports
        subjects.telemetry_all,
        subjects.event("handoff", "link_measured", "*"),  # routers learn links from every node's probes
        "$SRV.>",  # NATS micro discovery of this node's services
        inbox,
    ]
    return {
        # A link probe makes a node send up to gigabytes: an operator's (admin's) request, not a peer's.
        "publish": {"allow": own + mesh + jetstream, "deny": [f"{p}.handoff.*.probe"]},
        "subscribe": {"allow": serve},
        "allow_responses": True,
    }


def user_entry(subjects: Subjects, role: Role, user: str, password: str) -> dict[str, Any]:
    """One entry of `authorization.users` in the nats-server config."""
    entry: dict[str, Any] = {"user": user, "password": password}
    rights = permissions(subjects, role, user)
    if rights is not None:
        entry["permissions"] = rights
    return entry
