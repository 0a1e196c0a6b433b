"""Roles: what each kind of credential may do on the bus, as the accounts and permissions nats-server enforces.

Pure: from a mesh's `Subjects` (its prefix) and its users, nats-server's `accounts` block. Nothing in our code
checks these rights; nats-server does, so a refusal is the server's (`Permissions Violation`, or no responders
where an account has no route to a subject) and no actor is a security boundary.

Three accounts, so that no reply subject a requester names can make a responder write where the requester may
not (the confused deputy: nats-server has no permission on reply subjects, and JetStream answers, and stores
what it is sent, in its own account):

- `MESH` holds the mesh's JetStream (its streams, buckets and consumers) and no user. (It keeps the name of the
  account that once held every user: JetStream keeps its store per account name, so a store written before
  stays the mesh's, standalone or clustered.)
- `NODES` holds the admin and the nodes, and the mesh's own subjects (requests, telemetry, the live events).
- `CLIENTS` holds the `client` users and nothing else: no subject of the mesh's but what it imports.

A request that crosses an account boundary (a service import) reaches the responder with a reply subject of
nats-server's own (`_R_.…`); the answer travels back to the requester's account and is published there on the
subject the requester named. So whatever reply a node names for a JetStream call (an API call, a publish's
acknowledgement, a direct get, a pull), JetStream answers in `MESH` on `_R_.…`, never on a subject of its
streams, and the answer lands in `NODES`. There, the subjects that lead back to JetStream (`$KV.>`, `$O.>`, the
journal's, `$JS.…`) are imports of one and the same export of `MESH` as the call itself, and nats-server drops a
message that would pass through an export it came through already (its loop check): an answer never comes back
into a stream. A client's reply subjects are subjects of `CLIENTS`, where nothing leads into a stream either.
Push consumers deliver in `MESH`, where nothing but the stream itself listens on a stream's subjects (an
account of no users, whose only interest from outside is `_INBOX.>`), so a deliver subject that names a stream's
subject delivers nothing. What remains: a live subscriber of the reply subject in `NODES` still hears the answer
(JetStream's bytes; for a direct get, a message the node stored itself) though the node may not publish there:
what is stored stays its owner's, and what is heard live does not prove who sent it.

Across the boundaries (`accounts`):

- `MESH` exports to `NODES` everything, as one service (`>`, answered as a stream of messages: pulls and
  batched direct gets answer many times), and the push consumers' deliveries (`_INBOX.>`) as a stream. `NODES`
  imports what reaches JetStream (`jetstream_subjects`): the JetStream API, acks and flow control, the buckets'
  and object stores' subjects and the journal's; nothing else of `NODES` reaches `MESH`.
- `MESH` exports, to `CLIENTS` only, the read-only JetStream calls on the mesh's streams (account and stream
  info, stored-message and direct gets; a batched direct get answers with a stream of messages).
- `NODES` exports as services, to `CLIENTS` only, what a client may request: `placement.request`,
  `placement.fit` and `generate`. Answers go back through nats-server's reply mapping. A client's
  `placement.request` arrives in `NODES` as `clients.placement.request` (imported under the usual name, with
  `share`): placement knows it came from a client, and nats-server names the client user in a
  `Nats-Request-Info` header it writes itself, so the client share (what one client may hold booked) is
  counted per user. No consumer API is exported to clients: a consumer's deliver subject is a publish target,
  and durable consumers are the mesh's. So a client creates, changes and deletes no consumer at all.
- `NODES` exports the journal's subjects (`<prefix>.events.>`) as a stream: a client following the journal
  hears new events live (and reads what is stored through direct gets).
- The clients' inboxes, `_INBOX.clients.>`, are exported by `CLIENTS` to `NODES` and imported there under the
  same name: a generate's chunks and stream pings (a runner publishes them to the client's inbox) reach the
  client, and its answers to the pings flow back. Nothing else in `NODES` routes to `CLIENTS`. One subject for
  every client, not one per user, so that every server of a cluster has the same accounts: a client issued on
  one server is reached by a runner on another (users stay per server).

Within an account, each user's `permissions` (`docs/roles.md` lists them, written by `docs/generate_roles.py`):

- `client` requests `placement.request`, `placement.fit` and `generate` and the read-only JetStream calls above,
  answers the stream pings of a generate, and subscribes to its own inbox and the journal's live subjects.
  It reads neither the tenants' keys (the keys bucket) nor the shared limit counters (the limits bucket):
  neither is among the streams exported to its account.
- `node:<id>` publishes only its own telemetry, serving reports, events (`<prefix>.events.*.*.<id>`) and
  bucket keys (`MESH_NODES.<id>`, `MESH_L3.<id>`, `MESH_INSTANCES.<id>.>`), serves its own runner, L3 and
  handoff subjects and the queue groups every node serves (placement, generate), and requests other nodes'
  runner `generate`/`tokenize`/`render`/`start`/`stop` (router and front door), `lend` (a split's head), L3
  peer fetch, model files (`files.<id>.held`/`.facts`/`.chunk`/`.offer`; a `pull` only of its own node: an
  admin's request elsewhere) and handoff sessions (opened on `handoff.<id>.<its own id>.open` only, so a
  receiver knows who opens; not another node's link probe, `handoff.<id>.probe`: an admin's request).
  Placement runs on every node and books memory on any node by compare-and-set, so a node may write
  every reservation ledger and every tenant's limit counters (front doors share them), and start or stop
  instances anywhere: that is the trust that remains between nodes. It reads the tenants' keys (its front
  door follows them) but writes none: only an admin issues and revokes keys. It may create the mesh's streams
  and buckets (an idempotent create cannot alter an existing one) but not update, delete or purge them (the
  decisions object store excepted: replacing an object purges its old chunks). On the journal it creates,
  changes, pulls from and acknowledges only its own placement's durable consumer (`placement_consumer`), and
  no other consumer: a peer cannot refilter, drain or acknowledge another node's.
- `admin` may do everything (stream and bucket management, registry writes, L3 admin).

Every user receives its replies on its own inbox prefix (the bus sets it from the user name, `inbox_prefix`):
`_INBOX.<user>`, or `_INBOX.clients.<user>` for a client (named `client-…`, as `creds issue` names them), so no
client can read another's replies and the mesh's users' inboxes stay out of the clients' namespace.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from messages.subjects import Subjects, check_token

RoleKind = Literal["client", "node", "admin"]
ROLE_KINDS: Final = ("client", "node", "admin")
INBOX_ROOT: Final = "_INBOX"
#: Client users' names begin so (`creds issue` names them `client-<hex>`), and their inboxes live under
#: `CLIENT_INBOXES`: one subject the nodes' account imports for every client, on every server.
CLIENT_USER_PREFIX: Final = "client-"
CLIENT_INBOXES: Final = f"{INBOX_ROOT}.clients"

#: The mesh's JetStream, and no user (see the module's docstring for why it keeps this name).
MESH_ACCOUNT: Final = "MESH"
#: The admin and the nodes.
NODE_ACCOUNT: Final = "NODES"
CLIENT_ACCOUNT: Final = "CLIENTS"

#: How long nats-server keeps the way back for a client's request open: a generation may take its whole
#: `timeout_s` (at most an hour) before the router answers, placement a few of its request deadlines.
GENERATE_REPLY_WITHIN: Final = "3660s"
PLACEMENT_REPLY_WITHIN: Final = "300s"
#: A batched direct get answers with many messages, so its way back stays open until this passes (not until
#: the first answer): long enough for one batch, short enough that many reads do not pile up mappings.
BATCH_REPLY_WITHIN: Final = "30s"
#: The same for every JetStream call of the nodes' account (one export, so every answer is a stream of messages, and
#: every call's way back stays open this long, at most twice, after its last answer): several times the longest
#: pull a node makes (placement waits 5 s), short enough that a busy mesh's calls do not pile up mappings.
JETSTREAM_REPLY_WITHIN: Final = "30s"
#: Placement follows the runners' events through a durable consumer of its own node (`placement_consumer`).
PLACEMENT_CONSUMER: Final = "placement-reservations"


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

    @property
    def account(self) -> str:
        """The NATS account a user of this role lives in."""
        return CLIENT_ACCOUNT if self.kind == "client" else NODE_ACCOUNT


def inbox_prefix(user: str) -> str:
    """Where `user` receives replies: `_INBOX.<user>`, or `_INBOX.clients.<user>` for a client user (a user name
    is one subject token)."""
    root = CLIENT_INBOXES if is_client_user(check_token(user, "user name")) else INBOX_ROOT
    return f"{root}.{user}"


def is_client_user(user: str) -> bool:
    return user.startswith(CLIENT_USER_PREFIX)


def placement_consumer(node: str) -> str:
    """The durable consumer through which `node`'s placement follows the runners' events: its own, so that only
    it may create, change, pull from or acknowledge it (every node's placement applies every event; a change
    applies once, by compare-and-set)."""
    return f"{PLACEMENT_CONSUMER}-{check_token(node, 'node id')}"


def jetstream_subjects(subjects: Subjects) -> list[str]:
    """What the nodes' account routes to JetStream (in `MESH`): its API, consumers' acknowledgements and flow
    control, the buckets' and object stores' subjects, and the journal's."""
    return ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.>", "$O.>", subjects.events_all, subjects.usage_all]


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


def _node_streams(subjects: Subjects) -> dict[str, str]:
    """The streams a node reads and may create: the clients' (`_streams`) and the ones no client may read, the
    tenants' keys (their hashes, scopes and limits), the shared limit counters and the tenants' usage."""
    return {
        **_streams(subjects),
        "keys": f"KV_{subjects.keys_bucket}",
        "limits": f"KV_{subjects.limits_bucket}",
        "usage": subjects.usage_stream,
    }


def _gets(streams: list[str]) -> list[tuple[str, bool]]:
    """The read-only JetStream calls on these streams, each with whether its answer is a stream of messages:
    account info, stream info, stored-message gets and direct gets (batched: many answers)."""
    calls = [("$JS.API.INFO", False)]
    for s in streams:
        calls += [
            (f"$JS.API.STREAM.INFO.{s}", False),
            (f"$JS.API.STREAM.MSG.GET.{s}", False),
            (f"$JS.API.DIRECT.GET.{s}", True),
            (f"$JS.API.DIRECT.GET.{s}.>", True),
        ]
    return calls


def _reading(streams: list[str]) -> list[str]:
    """Publish rights that reading these streams needs: the gets, ephemeral (ordered) consumers and their flow
    control."""
    rights = [subject for subject, _ in _gets(streams)]
    for s in streams:
        rights += [
            f"$JS.API.CONSUMER.CREATE.{s}",
            f"$JS.API.CONSUMER.CREATE.{s}.>",
            f"$JS.API.CONSUMER.INFO.{s}.*",
            f"$JS.FC.{s}.>",
        ]
    return rights


@dataclass(frozen=True, slots=True)
class ClientService:
    """A service `CLIENTS` imports: `subject` as clients request it, `exported` as it arrives in the exporting
    `account` (`NODES` for the mesh's requests, `MESH` for JetStream's reads); `response` and `threshold` None
    for nats-server's defaults (one answer, within two minutes); `share`: nats-server tells the responder which
    user asked (a `Nats-Request-Info` header)."""

    subject: str
    exported: str
    account: str = NODE_ACCOUNT
    response: str | None = None
    threshold: str | None = None
    share: bool = False


def client_requests(subjects: Subjects) -> list[ClientService]:
    """What `CLIENTS` imports as services: the mesh's requests from `NODES`, JetStream's reads from `MESH`."""
    placement_request, placement_fit = subjects.placement_request, subjects.placement_fit
    services = [
        ClientService(
            placement_request, subjects.client_placement_request, threshold=PLACEMENT_REPLY_WITHIN, share=True
        ),
        ClientService(placement_fit, placement_fit, threshold=PLACEMENT_REPLY_WITHIN),
        # shared: the router names the client as the request's tenant in the queue, whatever the request says
        ClientService(subjects.generate, subjects.generate, threshold=GENERATE_REPLY_WITHIN, share=True),
    ]
    for subject, batched in _gets(list(_streams(subjects).values())):
        services.append(
            ClientService(subject, subject, MESH_ACCOUNT, "stream", BATCH_REPLY_WITHIN)
            if batched
            else ClientService(subject, subject, MESH_ACCOUNT)
        )
    return services


#: The header nats-server writes on a request it forwards through a shared service import: who asked.
REQUEST_INFO_HEADER: Final = "Nats-Request-Info"


def requesting_client(headers: Mapping[str, str] | None) -> str | None:
    """The client user nats-server names in a request's `Nats-Request-Info` (set by the server on a `share`d
    import, whatever the client sent), or None when it names no user of the clients' account."""
    raw = (headers or {}).get(REQUEST_INFO_HEADER)
    if not raw or len(raw) > 64 * 1024:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    user = info.get("user") if isinstance(info, dict) else None
    if not isinstance(user, str) or not user or info.get("acc") != CLIENT_ACCOUNT:
        return None
    return user[:256]


def permissions(subjects: Subjects, role: Role, user: str) -> dict[str, Any] | None:
    """The nats-server `permissions` of `user` acting in `role`; None for `admin` (no restriction)."""
    if role.kind == "admin":
        return None
    p = subjects.prefix
    streams = _node_streams(subjects)
    inbox = f"{inbox_prefix(user)}.>"
    if role.kind == "client":
        # What its account imports, named again: a second wall if an import were ever widened by mistake.
        return {
            "publish": {"allow": [service.subject for service in client_requests(subjects)]},
            "subscribe": {"allow": [inbox, subjects.events_all]},
            "allow_responses": True,  # answering a generate's stream pings (a reply to a request received)
        }
    node = role.node
    assert node is not None
    own = [
        subjects.telemetry(node),
        subjects.serving(node),
        subjects.events_from(node),
        subjects.usage_from(node),  # its private events (the tenants' usage), in a stream no client reads
        f"$KV.{subjects.nodes_bucket}.{node}",
        f"$KV.{subjects.l3_bucket}.{node}",
        f"$KV.{subjects.frontdoors_bucket}.{node}",
        f"$KV.{subjects.instances_bucket}.{subjects.instance_key(node, '>')}",
        f"{p}.runner.{node}.>",
        f"{p}.router.{node}.>",  # its front door asks its own router
        f"{p}.l3.{node}.>",
        f"{p}.handoff.{node}.>",
        subjects.files(node, "pull"),  # its runner fetches a file a start needs (its own files actor writes it)
    ]
    mesh = [
        subjects.placement_request,
        subjects.placement_fit,
        subjects.generate,
        f"$KV.{subjects.reservations_bucket}.>",  # placement books on every node (compare-and-set)
        f"$KV.{subjects.limits_bucket}.>",  # front doors share tenants' limit counters (compare-and-set)
        f"$O.{streams['decisions'].removeprefix('OBJ_')}.>",  # placement's decision records
        f"{p}.runner.*.generate",  # the router forwards to the chosen runner
        f"{p}.runner.*.tokenize",
        f"{p}.runner.*.render",  # routers render pass-through prompts on a model's instance
        f"{p}.runner.*.prefill",  # a decoding node asks another to prefill and hand the state off
        f"{p}.runner.*.start",  # the front door starts models on demand, and makes room, on any node
        f"{p}.runner.*.stop",
        f"{p}.runner.*.lend",  # a split's head asks each member for its part
        f"{p}.l3.*.manifests",  # peer fetch
        f"{p}.l3.*.manifest",
        f"{p}.l3.*.segment",
        f"{p}.l3.*.offer",  # a ticket for a segment over the direct data path
        f"{p}.l3.*.warm",  # the scaler warms a new replica's node from its peers' stores
        f"{p}.files.*.held",  # model files from peers (a pull is an operator's request: admin only)
        f"{p}.files.*.facts",  # placement reads a file's header facts on a node that holds it
        f"{p}.files.*.chunk",
        f"{p}.files.*.offer",  # a ticket for the direct data path (the bytes then travel beside the bus)
        f"{p}.handoff.*.{node}.open",  # a handoff's open names its sender: this node's id, no other's
        f"{p}.handoff.*.*.data",  # and its session's messages (the session id is the receiver's secret)
        f"{p}.handoff.*.*.commit",
        f"{p}.handoff.*.*.abort",
        f"{INBOX_ROOT}.>",  # replies, generate stream chunks and pings go to the requester's inbox
    ]
    events = streams["events"]
    # No consumer of its own on the journal but its placement's: an ephemeral create may name any consumer in
    # its body, another node's durable among them. The journal is read with direct gets.
    jetstream = [subject for subject, _ in _gets([events])]
    jetstream += _reading([s for s in streams.values() if s != events])
    jetstream += [f"$JS.API.STREAM.CREATE.{s}" for s in streams.values()]  # idempotent: alters nothing existing
    durable = placement_consumer(node)  # its placement's, and no other node's (create, update, pull, ack)
    jetstream += [
        f"$JS.API.CONSUMER.CREATE.{events}.{durable}",
        f"$JS.API.CONSUMER.CREATE.{events}.{durable}.>",  # the filter, named in the subject
        f"$JS.API.CONSUMER.DURABLE.CREATE.{events}.{durable}",
        f"$JS.API.CONSUMER.INFO.{events}.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.{events}.{durable}",
        f"$JS.ACK.{events}.{durable}.>",
        f"$JS.API.STREAM.PURGE.{streams['decisions']}",  # replacing an object purges its old chunks
    ]
    serve = [
        f"{p}.runner.{node}.>",
        f"{p}.router.{node}.>",
        f"{p}.l3.{node}.>",
        f"{p}.files.{node}.>",
        f"{p}.handoff.{node}.>",
        subjects.placement_request,
        subjects.client_placement_request,  # what clients request, held to their share
        subjects.placement_fit,
        subjects.generate,
        subjects.serving_all,  # routers read every node's serving reports
        subjects.telemetry_all,
        subjects.events_all,  # routers learn links from every node's probes; `events --follow` hears new ones
        subjects.usage_all,  # its metrics fold its tenants' usage
        "$SRV.>",  # NATS micro discovery of this node's services
        inbox,
    ]
    return {
        # A link probe makes a node send up to gigabytes: an operator's (admin's) request, not a peer's.
        "publish": {"allow": own + mesh + jetstream, "deny": [f"{p}.handoff.*.probe"]},
        "subscribe": {"allow": serve},
        "allow_responses": True,
    }


def matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` is one token, a final `>` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or token not in ("*", have[i]):
            return False
    return len(want) == len(have)


def allows(rights: Mapping[str, Any] | None, kind: Literal["publish", "subscribe"], subject: str) -> bool:
    """Whether nats-server lets a user of these `permissions` (None: every right) publish or subscribe to
    `subject`: an allow matches it and no deny does."""
    if rights is None:
        return True
    block = rights[kind]
    return any(matches(p, subject) for p in block["allow"]) and not any(
        matches(p, subject) for p in block.get("deny", ())
    )


def user_entry(subjects: Subjects, role: Role, user: str, password: str) -> dict[str, Any]:
    """One entry of an account's `users` in the nats-server config."""
    entry: dict[str, Any] = {"user": user, "password": password}
    rights = permissions(subjects, role, user)
    if rights is not None:
        entry["permissions"] = rights
    return entry


def _export(service: ClientService) -> dict[str, Any]:
    export: dict[str, Any] = {"service": service.exported, "accounts": [CLIENT_ACCOUNT]}
    if service.response is not None:
        export["response_type"] = service.response
    if service.threshold is not None:
        export["response_threshold"] = service.threshold
    return export


def _import(service: ClientService) -> dict[str, Any]:
    imported: dict[str, Any] = {"service": {"account": service.account, "subject": service.exported}}
    if service.subject != service.exported:
        imported["to"] = service.subject
    if service.share:
        imported["share"] = True
    return imported


def accounts(subjects: Subjects, users: Sequence[tuple[Role, str, str]]) -> dict[str, Any]:
    """nats-server's `accounts` block for these users `(role, user, password)`: `MESH` (JetStream, no user),
    `NODES` (admin and nodes) and `CLIENTS` (clients), and what crosses between them (see the module's
    docstring)."""
    for role, user, _ in users:  # a name decides the inbox: it must say the role's account, or replies go astray
        if is_client_user(user) != (role.kind == "client"):
            raise ValueError(f"user {user!r} of role {role}: only client users are named {CLIENT_USER_PREFIX}…")
    requests = client_requests(subjects)
    inboxes = f"{CLIENT_INBOXES}.>"
    # One export for everything the nodes' account sends JetStream: nats-server drops a message that would pass
    # an export twice, so an answer delivered on a reply subject of `NODES` never flows back into a stream.
    to_nodes: list[dict[str, Any]] = [
        {"service": ">", "accounts": [NODE_ACCOUNT], "response_type": "stream",
         "response_threshold": JETSTREAM_REPLY_WITHIN},
        {"stream": f"{INBOX_ROOT}.>", "accounts": [NODE_ACCOUNT]},  # push consumers deliver to inboxes
    ]  # fmt: skip
    from_jetstream: list[dict[str, Any]] = [
        {"service": {"account": MESH_ACCOUNT, "subject": subject}} for subject in jetstream_subjects(subjects)
    ]
    from_jetstream.append({"stream": {"account": MESH_ACCOUNT, "subject": f"{INBOX_ROOT}.>"}})
    node_exports = [_export(service) for service in requests if service.account == NODE_ACCOUNT]
    node_exports.append({"stream": subjects.events_all, "accounts": [CLIENT_ACCOUNT]})
    client_imports: list[dict[str, Any]] = [_import(service) for service in requests]
    client_imports.append({"stream": {"account": NODE_ACCOUNT, "subject": subjects.events_all}})
    return {
        MESH_ACCOUNT: {
            "jetstream": "enabled",
            "exports": to_nodes + [_export(service) for service in requests if service.account == MESH_ACCOUNT],
        },
        NODE_ACCOUNT: {
            "users": [user_entry(subjects, role, user, pw) for role, user, pw in users if role.kind != "client"],
            "exports": node_exports,
            # A runner publishes a generate's chunks and pings to the client's inbox, named as in its account.
            "imports": [*from_jetstream, {"service": {"account": CLIENT_ACCOUNT, "subject": inboxes}}],
        },
        CLIENT_ACCOUNT: {
            "users": [user_entry(subjects, role, user, pw) for role, user, pw in users if role.kind == "client"],
            "exports": [{"service": inboxes, "accounts": [NODE_ACCOUNT]}],
            "imports": client_imports,
        },
    }
