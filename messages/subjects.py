"""Subject names. Every subject starts with a configurable prefix (default `mesh`).

Node ids and other tokens placed in subjects must be valid single NATS tokens; `check_token` says why not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

DEFAULT_PREFIX: Final = "mesh"


_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_token(value: str, what: str = "token") -> str:
    """Returns `value` if it can be one subject token; raises ValueError naming `what` otherwise."""
    if not _TOKEN.match(value):
        raise ValueError(f"invalid {what} {value!r}: use 1-64 characters from A-Z a-z 0-9 _ -")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    """The subject names of one mesh (one prefix)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        for part in self.prefix.split("."):
            check_token(part, "subject prefix")

    @property
    def _upper(self) -> str:
        return self.prefix.replace(".", "_").replace("-", "_").upper()

    # JetStream names (not subjects) follow the prefix, so two meshes can share one NATS deployment:
    # the default prefix gives MESH_EVENTS, MESH_NODES and MESH_RESERVATIONS.
    @property
    def events_stream(self) -> str:
        return f"{self._upper}_EVENTS"

    @property
    def usage_stream(self) -> str:
        """The journal of the tenants' usage (`request_usage`): the mesh's to read, never a client's."""
        return f"{self._upper}_USAGE"

    @property
    def nodes_bucket(self) -> str:
        return f"{self._upper}_NODES"

    @property
    def reservations_bucket(self) -> str:
        return f"{self._upper}_RESERVATIONS"

    @property
    def registry_bucket(self) -> str:
        return f"{self._upper}_REGISTRY"

    @property
    def instances_bucket(self) -> str:
        return f"{self._upper}_INSTANCES"

    @property
    def l3_bucket(self) -> str:
        return f"{self._upper}_L3"

    @property
    def frontdoors_bucket(self) -> str:
        return f"{self._upper}_FRONTDOORS"

    @property
    def keys_bucket(self) -> str:
        """Tenants' API keys (`messages.tenants.TenantKey`, by key id): written by an admin only."""
        return f"{self._upper}_KEYS"

    @property
    def limits_bucket(self) -> str:
        """Tenants' shared limit counters (rate buckets, concurrency), written by every node's front door."""
        return f"{self._upper}_LIMITS"

    def telemetry(self, node: str) -> str:
        return f"{self.prefix}.telemetry.{node}"

    @property
    def telemetry_all(self) -> str:
        return f"{self.prefix}.telemetry.*"

    @property
    def placement_request(self) -> str:
        return f"{self.prefix}.placement.request"

    @property
    def placement_fit(self) -> str:
        return f"{self.prefix}.placement.fit"

    @property
    def client_placement_request(self) -> str:
        """Where a client's `placement.request` arrives in the mesh's account: the clients' account imports
        this subject under the name `placement_request`, so a request here came from a client (nats-server
        names which one in its `Nats-Request-Info` header) and is held to the client share."""
        return f"{self.prefix}.clients.placement.request"

    def runner(self, node: str, verb: str) -> str:
        return f"{self.prefix}.runner.{node}.{verb}"

    @property
    def generate(self) -> str:
        return f"{self.prefix}.generate"

    def router_generate(self, node: str) -> str:
        """One node's router alone (its front door asks it: a frozen peer's router never holds its requests)."""
        return f"{self.prefix}.router.{node}.generate"

    def serving(self, node: str) -> str:
        return f"{self.prefix}.serving.{node}"

    @property
    def serving_all(self) -> str:
        return f"{self.prefix}.serving.*"

    def l3(self, node: str, verb: str) -> str:
        return f"{self.prefix}.l3.{node}.{verb}"

    def files(self, node: str, verb: str) -> str:
        """`<prefix>.files.<node>.<verb>`: a node's model files (`held`, `chunk` for peers; `pull` for operators)."""
        return f"{self.prefix}.files.{node}.{verb}"

    def handoff(self, node: str, verb: str) -> str:
        """`<prefix>.handoff.<node>.<verb>`: the receiving node's handoff actor (`open`)."""
        return f"{self.prefix}.handoff.{node}.{verb}"

    def handoff_session(self, node: str, session: str, verb: str | None = None) -> str:
        """A handoff session's subject on its receiving node; with `verb` (`data`, `commit`, `abort`) one of its
        messages."""
        base = f"{self.prefix}.handoff.{node}.{session}"
        return base if verb is None else f"{base}.{verb}"

    def handoff_open(self, receiver: str, sender: str) -> str:
        """Where `sender` opens a handoff on `receiver`: the sender's node id is a token of the subject, which
        nats-server lets a node's credential publish with its own id only (`runtime.roles`), so the receiver
        knows who opens (a `HandoffOpen.sender_node` that differs is refused)."""
        return f"{self.prefix}.handoff.{receiver}.{sender}.open"

    def handoff_sessions(self, node: str) -> str:
        """Every session message of a node's handoff actor (one subscription keeps a session's order)."""
        return f"{self.prefix}.handoff.{node}.*.*"

    def instance_key(self, node: str, instance_id: str) -> str:
        """An instance's key in the instances bucket: the node id first, so nats-server can scope a node's
        writes to its own records (`$KV.<bucket>.<node>.>`)."""
        return f"{node}.{instance_id}"

    def event(self, actor: str, kind: str, node: str) -> str:
        """Where `node` publishes its `actor`'s events of type `kind`. The publishing node is the last token,
        so nats-server can confine each node to its own events (`events_from`)."""
        return f"{self.prefix}.events.{actor}.{kind}.{node}"

    def events_from(self, node: str) -> str:
        return f"{self.prefix}.events.*.*.{node}"

    def usage_event(self, actor: str, kind: str, node: str) -> str:
        """Where `node` publishes a private event (`Event.PRIVATE`: the tenants' usage), in `usage_stream`."""
        return f"{self.prefix}.usage.{actor}.{kind}.{node}"

    def usage_from(self, node: str) -> str:
        return f"{self.prefix}.usage.*.*.{node}"

    @property
    def usage_all(self) -> str:
        return f"{self.prefix}.usage.>"

    def events_of(self, actor: str) -> str:
        return f"{self.prefix}.events.{actor}.>"

    @property
    def events_all(self) -> str:
        return f"{self.prefix}.events.>"
