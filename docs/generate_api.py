"""Writes `docs/api.md`: the subjects, buckets, events stream, error replies and message schemas of a mesh.

Everything in the output is read from the code (subject names from `messages.subjects`, bucket definitions
from `runtime.buckets`, schemas from `msgspec.json.schema_components`, field notes from the comments beside
each Struct field), so the file changes only when the code does. Run from the repository root:

    python -m docs.generate_api           # rewrite docs/api.md
    python -m docs.generate_api --check   # exit 1 if docs/api.md is out of date

`tests/unit/test_docs_api.py` fails when the committed file differs from what this renders.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from actors.files.actor import FilesActor
from actors.frontdoor.actor import FrontDoorActor
from actors.handoff import receiver as handoff_receiver
from actors.handoff import sender as handoff_sender
from actors.handoff.actor import HandoffActor, HandoffLimits
from actors.l3.actor import L3Actor, L3Limits
from actors.metrics.actor import MetricsActor
from actors.placement import decision_records
from actors.placement.actor import QUEUE_GROUP, RUNNER_EVENTS_CONSUMER, PlacementActor, ledger_key
from actors.router.actor import QUEUE_GROUP as ROUTER_QUEUE
from actors.router.actor import RouterActor
from actors.runner.actor import RunnerActor, RunnerLimits
from actors.telemetry.actor import TelemetryActor
from docs.generated import write_or_check
from messages import datapath as datapath_messages
from messages import errors
from messages import events as ev
from messages import files as files_messages
from messages import handoff as handoff_messages
from messages import l3 as l3_messages
from messages import placement as placement_messages
from messages.errors import ErrorReply
from messages.frontdoor import FrontDoorReport
from messages.generate import (
    RELAY_HEADER,
    RELAY_SEQ_HEADER,
    STREAM_PING_HEADER,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    Prefill,
    PrefillResult,
    RelayHead,
    Render,
    RunnerGenerate,
    ServingReport,
    StreamPing,
    Tokenize,
    Tokens,
)
from messages.placement import NodeLedger, PlacementDecision, PlacementRequest, RejectReason
from messages.registry import RegistryEntry
from messages.runner import InstanceStatus, LendRequest, Lent, RunnerAck, StartInstance, StopInstance
from messages.subjects import DEFAULT_PREFIX, Subjects
from messages.telemetry import NodeResources
from messages.tenant_limits import KeyState
from messages.tenants import TenantKey
from runtime import buckets
from runtime.bus import BadMessage, decode_checked, error_headers
from runtime.config import NodeConfig

API_MD = Path(__file__).with_name("api.md")
COMMAND = "python -m docs.generate_api"

S = Subjects(DEFAULT_PREFIX)
TELEMETRY, PLACEMENT, RUNNER, L3 = TelemetryActor.name, PlacementActor.name, RunnerActor.name, L3Actor.name
ROUTER, FRONTDOOR = RouterActor.name, FrontDoorActor.name
HANDOFF, METRICS, FILES = HandoffActor.name, MetricsActor.name, FilesActor.name
NODE = "node"  # the pseudo-actor of `mesh-actor run` itself (runtime/launcher.py)
# the front door only with --http, the metrics with --http or --metrics
SUPERVISED = (TELEMETRY, PLACEMENT, RUNNER, L3, ROUTER, HANDOFF, FILES, FRONTDOOR, METRICS)

#: Who publishes each event, and when. Every member of `AnyEvent` must be here (checked at render time).
EVENTS: dict[type[ev.Event], tuple[tuple[str, ...], str]] = {
    ev.ActorStarted: (SUPERVISED, "the supervisor started the actor (attempt 1)"),
    ev.ActorCrashed: (SUPERVISED, "the actor crashed; it restarts after `restart_in_s`"),
    ev.ActorRestarted: (SUPERVISED, "the actor started again after a crash"),
    ev.ActorGaveUp: (SUPERVISED, "more crashes than its restart intensity allows; the node stops (exit 1)"),
    ev.ActorStopped: (SUPERVISED, "the actor ended (node shutdown)"),
    ev.NodeStarted: ((NODE,), "`mesh-actor run` is connected and starts its actors"),
    ev.NodeStopped: ((NODE,), "`mesh-actor run` is stopping (`reason`: `signal`, or why an actor gave up)"),
    ev.TelemetryChanged: (
        (TELEMETRY,),
        "first report, or the serving settings, devices, llama-server or memory limit changed",
    ),
    ev.PlacementDecided: (
        (PLACEMENT,),
        "every `placement.request` decision with its inputs (replayable); `placement.fit` is not journaled",
    ),
    ev.ReservationReleased: (
        (PLACEMENT, RUNNER),
        "a reservation was removed; `reason`: stopped, failed, rejected, refused (runner events or the instance's "
        "final record), expired (never claimed within its hold), instance_gone (its instance record stayed away "
        "while its node reported, for the claim grace; or the node's runner, starting, released its predecessor's "
        "claims), node_restarted, rolled_back, "
        "undelivered (its decision could not reach the requester)",
    ),
    ev.ReservationObserved: ((PLACEMENT,), "the instance is ready: the reservation now holds the observed footprint"),
    ev.ReservationRebooked: (
        (RUNNER,),
        "an instance ran without its reservation (released while its runner could not refresh its records) and was "
        "booked again; `outcome` `stopping`: it no longer fitted and is being stopped, booked until it is gone",
    ),
    ev.InstanceStarting: ((RUNNER,), "a llama-server process was spawned (every generation, restarts included)"),
    ev.RpcLent: (
        (RUNNER,),
        "a split's member started serving its part: a ggml-rpc-server on loopback behind a tunnel exit (`port`)",
    ),
    ev.RpcServerExited: (
        (RUNNER,),
        "a member's ggml-rpc-server exited unasked: restarted after `restart_in_s` (None: the part is given up); "
        "the head's instance crashes naming the member (`instance_crashed.member`)",
    ),
    ev.RpcLendEnded: (
        (RUNNER,),
        "a member stopped serving its part: its booking left the ledger, its RPC server gave up, or the runner stopped",
    ),
    ev.InstanceReady: ((RUNNER,), "healthy and verified against the stamp; predicted and observed memory"),
    ev.DriftRejected: (
        (RUNNER,),
        "a setting differs from the stamp: refused before start, or stopped after start (once it exited)",
    ),
    ev.InstanceRefused: ((RUNNER,), "worker-side admission: the model no longer fits, or no current telemetry"),
    ev.InstanceCrashed: (
        (RUNNER,),
        "the server exited or missed a deadline; `restart_in_s` is null when it will not be restarted",
    ),
    ev.InstanceRestarted: ((RUNNER,), "the server was spawned again after a crash"),
    ev.HealthCheckFailed: (
        (RUNNER,),
        "a ready server failed a liveness check (`check`: a one-token `probe`, its `/health`, or a real "
        "`completion` the server failed); enough `consecutive` failures make it a crash",
    ),
    ev.InstanceStopped: ((RUNNER,), "stopped on request or because the runner stopped; the server is gone"),
    ev.InstanceFailed: ((RUNNER,), "given up: too many crashes, or the driver of this instance failed"),
    ev.InstanceStuck: (
        (RUNNER,),
        "the server survived SIGKILL: it is killed again until it is gone, and its memory stays held",
    ),
    ev.GenerateRouted: (
        (ROUTER,),
        "every `generate` request: the candidates with their load and held prefix, the weights, the choice "
        "(`chosen` null: no ready instance, answered `no_instance`); `mesh-actor replay` re-decides it",
    ),
    ev.GenerateCancelled: (
        (RUNNER,),
        "a generation's requester left (an HTTP client disconnected, a stream's pings unanswered): the server "
        "stopped and freed the slot; `tokens_generated` says how far it got",
    ),
    ev.GenerateQueued: (
        (RUNNER,),
        "a request found no slot it could take and waits in its instance's queue: why (`reason`: busy slots, who "
        "is ahead by class and by fair share) and its tags (`waiter`: tenant, class, share, cost, start and finish)",
    ),
    ev.GenerateDequeued: (
        (RUNNER,),
        "a waiting request got its slot: the queue's choice among everyone then waiting (`candidates`, the chosen "
        "first: highest class, then earliest finish tag), which `mesh-actor replay` re-decides",
    ),
    ev.GenerateCompleted: (
        (RUNNER,),
        "a generation was answered: its prefix's source, token counts, time to first token and total time (the "
        "figures of its `GenerateResult`); the metrics' request counters and latency histograms come from it",
    ),
    ev.ModelLoading: ((FRONTDOOR,), "a request found no ready instance of a catalog model: one is placed and started"),
    ev.ModelLoaded: ((FRONTDOOR,), "the instance started for a catalog model is ready (`load_ms` from the request)"),
    ev.RoomMade: ((FRONTDOOR,), "instances stopped so that a model fits, with the bytes each stop frees"),
    ev.ModelRefused: ((FRONTDOOR,), "a model that never fits (HTTP 507: need and have), or could not be placed"),
    ev.ScalingDecided: (
        (FRONTDOOR,),
        "the scaler added or retired a replica of a catalog model: every replica's load, queued work and measured "
        "rates, the hysteresis it remembered, and its decision with the reason (`mesh-actor replay` re-decides it)",
    ),
    ev.ReplicaAdded: ((FRONTDOOR,), "a replica the scaler decided is ready (its node, the time it took), or `error`"),
    ev.IdleStopped: ((FRONTDOOR,), "an instance of a catalog model stopped after its `idle_ttl_s`"),
    ev.RequestUsage: (
        (FRONTDOOR,),
        "one request to the front door's API, answered or refused: its tenant and key, catalog model, HTTP status, "
        "tokens and duration (`refused`: the key's limit that refused it); what `mesh-actor usage` sums",
    ),
    ev.L3Captured: ((L3,), "a saved slot state was ingested and committed (after its eviction pass)"),
    ev.L3CaptureDropped: (
        (L3,),
        "a capture was not stored; `reason`: queue_full, disabled (budget 0), over_budget, not_running, stopping, "
        "eviction_blocked (an unreadable quarantined manifest, and the capture does not fit the budget), "
        "refused: <commit rule>, io_error: <why>",
    ),
    ev.L3Evicted: ((L3,), "one eviction pass (budget) or `l3 evict`: the entries removed, least recently used first"),
    ev.L3Quarantined: (
        (L3,),
        "a manifest failed to load or verify (startup reconcile, `l3 gc`, a restore or `l3 verify`); its segments "
        "are kept",
    ),
    ev.L3Fetched: ((L3,), "an entry was fetched from a peer and committed; `moved_bytes`: the segments it lacked"),
    ev.ModelFilePulled: (
        (FILES,),
        "`models pull`: a model file arrived from a peer, its whole blake3 verified; `resumed_from`: bytes kept",
    ),
    ev.ModelFilePullRefused: (
        (FILES,),
        "a pull was refused (`reason`: `no_peer`, `no_space`, `digest_mismatch`, `chunk_refused`, `peer_failed`, …)",
    ),
    ev.L3EvictionBlocked: (
        (L3,),
        "a reconcile (start, `l3 gc`) found quarantined manifests that cannot be parsed: no segment may be freed, "
        "so captures that do not fit the budget are dropped until they are deleted (`l3_quarantine_cleared`, "
        f"{L3Limits().quarantine_keep_s:g} s after they were quarantined once the store needs room), or by "
        "`mesh-actor l3 gc --quarantine`",
    ),
    ev.L3QuarantineCleared: (
        (L3,),
        "quarantined manifests deleted by the store's policy, the segments only they named freed: `retention` "
        f"(kept {L3Limits().quarantine_retention_s:g} s) or `space` (the store needed the room, and they were kept "
        f"{L3Limits().quarantine_keep_s:g} s); why each was quarantined is its `l3_quarantined` event",
    ),
    ev.HandoffCommitted: (
        (HANDOFF,),
        "the receiving side verified a handoff (every segment, tiling, counts, payload digest) and restored it",
    ),
    ev.HandoffAborted: (
        (HANDOFF,),
        "a handoff session ended without a restore; `role` says which side recorded it, `reason` is one of the "
        "[handoff reasons](#handoff-refusal-reasons); the receiver's staging is freed",
    ),
    ev.LinkMeasured: (
        (HANDOFF,),
        "a link probe (`mesh-actor handoff bench`) fitted `seconds = fixed_s + bytes / bytes_per_s` for handoffs "
        "from `src` to `dst`; every router learns it (until generations report that pair's handoffs)",
    ),
    ev.EventTooLarge: (
        (*SUPERVISED, NODE),
        "recorded by the journal in place of an event that could never be stored (over its size limit)",
    ),
}

_limits = RunnerLimits()
_l3_limits = L3Limits()
_handoff_limits = HandoffLimits()

#: Refusal reasons whose line in messages/placement.py carries no comment.
REASONS_WITHOUT_COMMENT = {
    "unsupported_architecture": "the model's architecture has no geometry rule; it is refused, never guessed",
}
_CODE = re.compile(r"^[a-z][a-z_]*$")


class GeneratorError(RuntimeError):
    """The code has something this generator does not describe yet; the message says what to add."""


# --- schema rendering ---------------------------------------------------------------------------------------


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _link(name: str) -> str:
    return f"[{name}](#{name.lower()})"


def _type_of(schema: dict[str, Any]) -> str:
    """A short human rendering of a JSON schema (the JSON block below each table is the full one)."""
    if not schema:
        return "any"
    if "$ref" in schema:
        return _link(_ref_name(schema["$ref"]))
    if "anyOf" in schema:
        return " \\| ".join(_type_of(item) for item in schema["anyOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(_type_of(item) for item in schema["prefixItems"]) + "]"
        return f"array of {_type_of(schema.get('items', {}))}"
    if kind == "object":
        values = schema.get("additionalProperties")
        return f"object of {_type_of(values)}" if isinstance(values, dict) and values else "object"
    bounds = [
        f"{op} {schema[key]}"
        for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
        if key in schema
    ]
    return str(kind) + (" " + ", ".join(bounds) if bounds else "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _field_comments(cls: type) -> dict[str, str]:
    """The `# comment` beside each field in the class bodies of `cls` and its Struct bases."""
    fields: tuple[str, ...] = getattr(cls, "__struct_fields__", ())
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, msgspec.Struct) or not isinstance(klass, type) or not issubclass(klass, msgspec.Struct):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        names: dict[int, str] = {}
        comments: dict[int, str] = {}
        for i, tok in enumerate(tokens):
            row, column = tok.start
            if tok.type == tokenize.COMMENT:
                comments[row] = tok.string.lstrip("#").strip()
            elif tok.type == tokenize.NAME and column == 4 and row not in names and tokens[i + 1].string == ":":
                names[row] = tok.string
        for row, name in names.items():
            if name in fields and row in comments:
                out[name] = comments[row]
    return out


def _component_order(roots: Sequence[str], components: dict[str, Any]) -> list[str]:
    """Each root, then what it refers to (depth first, in field order), then anything left."""
    order: list[str] = []

    def refs(node: Any) -> Iterable[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str):
                    yield _ref_name(value)
                else:
                    yield from refs(value)
        elif isinstance(node, list):
            for item in node:
                yield from refs(item)

    def visit(name: str) -> None:
        if name in order:
            return
        order.append(name)
        for child in refs(components[name]):
            visit(child)

    for root in roots:
        visit(root)
    for name in sorted(components):
        visit(name)
    return order


def _schema_section(types: Sequence[type], lines: list[str]) -> None:
    _, components = msgspec.json.schema_components(types)
    by_name = {t.__name__: t for t in _all_struct_types(types)}
    for name in _component_order([t.__name__ for t in types], components):
        schema = components[name]
        lines += [f"### {name}", ""]
        if schema.get("description"):
            lines += [" ".join(schema["description"].split()), ""]
        properties: dict[str, Any] = schema.get("properties", {})
        if properties:
            required = set(schema.get("required", ()))
            notes = _field_comments(by_name[name]) if name in by_name else {}
            lines += ["| field | type | default | notes |", "|---|---|---|---|"]
            for field, prop in properties.items():
                default = "required" if field in required else f"`{json.dumps(prop.get('default'))}`"
                lines.append(f"| `{field}` | {_type_of(prop)} | {default} | {_cell(notes.get(field, ''))} |")
            lines.append("")
            closed = schema.get("additionalProperties") is False
            lines += [("Unknown fields are refused." if closed else "Unknown fields are ignored."), ""]
        block = json.dumps(schema, indent=2, ensure_ascii=False)
        lines += ["<details><summary>JSON schema</summary>", "", "```json", block, "```", "", "</details>", ""]


def _all_struct_types(roots: Iterable[Any]) -> list[type]:
    """Every Struct type reachable from `roots` through field annotations."""
    seen: list[type] = []

    def walk(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            if tp in seen:
                return
            seen.append(tp)
            for field_type in typing.get_type_hints(tp, include_extras=True).values():
                walk(field_type)
            return
        for arg in typing.get_args(tp):
            walk(arg)

    for root in roots:
        walk(root)
    return seen


# --- tables read from the code -------------------------------------------------------------------------------


def _event_types() -> list[type[ev.Event]]:
    members: list[type[ev.Event]] = list(typing.get_args(ev.AnyEvent))
    missing = [t.__name__ for t in members if t not in EVENTS]
    if missing:
        raise GeneratorError(f"describe these events in EVENTS of docs/generate_api.py: {', '.join(missing)}")
    return members


def _module_codes(module: Any, exclude: Iterable[str] = ()) -> list[str]:
    skip = set(exclude)
    return [
        value
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, str) and _CODE.match(value) and value not in skip
    ]


def _error_codes() -> list[tuple[str, str, str, str]]:
    """(code, who answers with it, HTTP status and retry, meaning) for every stable error code: the one registry,
    `messages.errors.REGISTRY` (every code constant of `messages.errors` must be in it)."""
    missing = [code for code in _module_codes(errors) if code not in errors.REGISTRY]
    if missing:
        raise GeneratorError(f"describe these error codes in messages/errors.py's REGISTRY: {missing}")
    return [
        (e.code, e.where, f"{e.http_status}, {'retry' if e.retryable else 'no retry'}", e.meaning)
        for e in errors.REGISTRY.values()
    ]


def _handoff_reasons() -> list[tuple[str, str, str]]:
    """(reason, side, meaning) for every handoff reason, from the comments beside the enum members."""
    rows: list[tuple[str, str, str]] = []
    enums: tuple[tuple[type[enum.Enum], str], ...] = (
        (handoff_receiver.ReceiveReason, "receiver"),
        (handoff_sender.SendReason, "sender"),
    )
    for reasons, side in enums:
        comments = dict(re.findall(r'^\s+[A-Z_]+ = "(\w+)"\s*#\s*(.*)$', inspect.getsource(reasons), re.M))
        rows += [(r.value, side, comments.get(r.value, "")) for r in reasons]
    return rows


def _reject_reasons() -> list[tuple[str, str]]:
    source = inspect.getsource(placement_messages)
    comments = dict(re.findall(r'^\s+"(\w+)",\s*#\s*(.*)$', source, flags=re.MULTILINE))
    comments.update({k: v for k, v in REASONS_WITHOUT_COMMENT.items() if k not in comments})
    return [(str(reason), comments.get(str(reason), "")) for reason in typing.get_args(RejectReason)]


def _config_default(name: str) -> Any:
    for field in dataclasses.fields(NodeConfig):
        if field.name == name:
            return field.default
    raise GeneratorError(f"NodeConfig has no field {name!r}")


def _bad_request_example() -> ErrorReply:
    raw = b'{"model": {"path": "/models/x.gguf"}, "ctx": "8k"}'
    try:
        decode_checked(raw, PlacementRequest, f"request on {S.placement_request!r}")
    except BadMessage as exc:
        return exc.to_reply()
    raise GeneratorError("the bad-request example decoded without an error")


# --- the document ----------------------------------------------------------------------------------------


def render() -> str:
    """The full text of docs/api.md."""
    lines: list[str] = []
    add = lines.extend
    node = "<node>"
    ttl = _config_default("telemetry_ttl_s")
    interval = _config_default("telemetry_interval_s")
    max_age_days = _config_default("journal_max_age_s") / 86400
    max_gib = _config_default("journal_max_bytes") / (1 << 30)
    lab = Subjects("lab-a")

    add(
        [
            "# mesh-actor API",
            "",
            f"<!-- Generated by `{COMMAND}` from the code; do not edit by hand. -->",
            "",
            "Every message is JSON encoded by msgspec; field names are the Struct field names (snake_case).",
            f"Every subject starts with a prefix, `{DEFAULT_PREFIX}` unless configured (`--prefix`, "
            "`MESH_ACTOR_PREFIX`, or `prefix` in `config.toml`); JetStream names follow it in upper case "
            f"(prefix `lab-a`: `{lab.placement_request}`, stream `{lab.events_stream}`). Node ids, instance ids "
            "and registry names are single subject tokens: 1-64 characters from `A-Z a-z 0-9 _ -`.",
            "",
            "## Subjects",
            "",
            "| subject | kind | message in → out | served by |",
            "|---|---|---|---|",
            f"| `{S.placement_request}` | req/reply, queue group `{QUEUE_GROUP}` | {_link('PlacementRequest')} → "
            f"{_link('PlacementDecision')} | placement (every node; one answers) |",
            f"| `{S.placement_fit}` | req/reply, queue group `{QUEUE_GROUP}` | {_link('PlacementRequest')} → "
            f"{_link('PlacementDecision')} with `dry_run: true`: nothing reserved, not journaled | placement |",
            f"| `{S.client_placement_request}` | req/reply, queue group `{QUEUE_GROUP}` | a client's "
            f"`{S.placement_request}`, as it arrives from the clients' account (nats-server names the client in "
            "`Nats-Request-Info`): held to the client share (`over_client_share`) | placement |",
            f"| `{S.runner(node, 'start')}` | req/reply | {_link('StartInstance')} → {_link('RunnerAck')} | "
            "the runner of that node |",
            f"| `{S.runner(node, 'stop')}` | req/reply | {_link('StopInstance')} → {_link('RunnerAck')} | "
            "the runner of that node |",
            f"| `{S.runner(node, 'lend')}` | req/reply | {_link('LendRequest')} → {_link('Lent')}: a split's head asks "
            "a member for its part (answered only for a part the member's ledger books for that head) | "
            "the runner of that node (a lending member) |",
            f"| `{S.generate}` | req/reply, queue group `{ROUTER_QUEUE}` | {_link('GenerateRequest')} → "
            f"{_link('GenerateResult')}; with `stream`, {_link('GenerateChunk')}s on that subject (a pass-through "
            f"`api` request: a {_link('RelayHead')}, then the server's body as raw data, headers `{RELAY_HEADER}` "
            f"and `{RELAY_SEQ_HEADER}`), and {_link('StreamPing')} requests (header `{STREAM_PING_HEADER}`) the "
            "client must answer | the router (every node; one answers) |",
            f"| `{S.router_generate(node)}` | req/reply | the same as `{S.generate}`, to that node's router alone "
            "(only that node may ask: its front door, so a frozen peer's router never holds its requests) | the "
            "router of that node |",
            f"| `{S.runner(node, 'generate')}` | req/reply | {_link('RunnerGenerate')} → {_link('GenerateResult')} "
            "| the runner of that node (sent by routers) |",
            f"| `{S.runner(node, 'prefill')}` | req/reply | {_link('Prefill')} → {_link('PrefillResult')}: the "
            "prompt computed here and its state handed off to the decoding node's L3 | the runner of that node (a "
            "decoding runner asks, for `prefill_node`) |",
            f"| `{S.runner(node, 'render')}` | req/reply | {_link('Render')} → {_link('Tokens')}: a pass-through "
            "body's prompt as the instance renders and tokenizes it | the runner of that node (routers ask) |",
            f"| `{S.runner(node, 'tokenize')}` | req/reply | {_link('Tokenize')} → {_link('Tokens')} | the runner "
            "of that node |",
            f"| `{S.serving(node)}` | pub | {_link('ServingReport')} (slots, busy, queued, resident prefixes) | the "
            "runner of that node, on change and every few seconds (routers read it) |",
            f"| `{S.telemetry(node)}` | pub | {_link('NodeResources')} | telemetry of that node, every "
            f"{interval:g} s and on change (placement reads the nodes bucket instead) |",
            f"| `{S.l3(node, 'manifests')}` | req/reply | {_link('ManifestsRequest')} → {_link('ManifestList')} | "
            "the L3 actor of that node (peer fetch: what its store holds) |",
            f"| `{S.l3(node, 'manifest')}` | req/reply | {_link('ManifestRequest')} → raw bytes: one chunk of the "
            f"stored manifest JSON, headers `{l3_messages.CHUNK_OFFSET_HEADER}` and `{l3_messages.CHUNK_TOTAL_HEADER}` "
            "| the L3 actor of that node |",
            f"| `{S.l3(node, 'segment')}` | req/reply | {_link('SegmentRequest')} → raw bytes: one chunk of the "
            f"segment (under `max_payload`), headers `{l3_messages.CHUNK_OFFSET_HEADER}` and "
            f"`{l3_messages.CHUNK_TOTAL_HEADER}`; several requests are served at once | the L3 actor of that node |",
            f"| `{S.l3(node, 'offer')}` | req/reply | {_link('SegmentOfferRequest')} → {_link('DirectOffer')}: a "
            "one-shot ticket for the whole segment over the direct data path (docs/datapath.md; an error reply, or no "
            "responder: the fetching node uses `.segment`) | the L3 actor of that node |",
            f"| `{S.l3(node, 'stat')}` / `{S.l3(node, 'verify')}` | req/reply | {_link('EntryRequest')} → "
            f"{_link('EntryStat')} / {_link('VerifyReply')} | the L3 actor of that node (`mesh-actor l3`) |",
            f"| `{S.l3(node, 'gc')}` / `{S.l3(node, 'evict')}` | req/reply | {_link('GcRequest')} → {_link('GcReply')}"
            f" / {_link('EvictRequest')} → {_link('EvictReply')} | the L3 actor of that node (`mesh-actor l3`) |",
            f"| `{S.files(node, 'held')}` | req/reply | {_link('HeldRequest')} → {_link('FileHeld')} (only for files "
            "a catalog or a trusted registry entry names; anything else `not_found`) | the files actor of that node |",
            f"| `{S.files(node, 'facts')}` | req/reply | {_link('HeldRequest')} → {_link('FileFacts')} (the same "
            "names; placement on a node without the file admits it by these header facts) | the files actor of "
            "that node |",
            f"| `{S.files(node, 'chunk')}` | req/reply | {_link('ChunkRequest')} → raw bytes: one chunk of the file "
            f"(under `max_payload`), headers `{files_messages.FILES_OFFSET_HEADER}`, "
            f"`{files_messages.FILES_TOTAL_HEADER}` and `{files_messages.FILES_BLAKE3_HEADER}` (the chunk's own "
            "blake3) | the files actor of that node |",
            f"| `{S.files(node, 'offer')}` | req/reply | {_link('OfferRequest')} → {_link('DirectOffer')}: a "
            "one-shot ticket for the direct data path (docs/datapath.md: the range then travels on a TCP stream from "
            "the holder, each chunk with its blake3; an error reply, or no responder: the asking node uses `.chunk`) "
            "| the files actor of that node |",
            f"| `{S.files(node, 'pull')}` | req/reply | {_link('PullRequest')} → {_link('PullReply')} (a refusal "
            "carries `details.reason`; admin credentials only) | the files actor of that node (`mesh-actor models "
            "pull`) |",
            f"| `{S.handoff_open(node, '<sender>')}` | req/reply | {_link('HandoffOpen')} → "
            f"{_link('HandoffOpened')} (a node opens as itself only: nats-server lets its credential publish with "
            "its own id there, and an open whose `sender_node` differs is `bad_request`; a refusal: `busy`, or "
            "`bad_request` with `details.reason`) | the handoff actor of that node (the receiver) |",
            f"| `{S.handoff(node, 'open')}` | req/reply | the same, for an operator (admin credentials only) | "
            "the handoff actor of that node |",
            f"| `{S.handoff(node, 'probe')}` | req/reply | {_link('LinkProbe')} → {_link('LinkProbeResult')} "
            "(admin credentials only) | the handoff actor of that node (the sender of the probe's handoffs; "
            "`mesh-actor handoff bench`) |",
            f"| `{S.handoff_session(node, '<session>', 'data')}` | pub | raw bytes: one chunk of a segment (at most "
            "`chunk_bytes`), headers "
            + ", ".join(
                f"`{h}`"
                for h in (
                    handoff_messages.SESSION_HEADER,
                    handoff_messages.INDEX_HEADER,
                    handoff_messages.OFFSET_HEADER,
                    handoff_messages.LENGTH_HEADER,
                    handoff_messages.DIGEST_HEADER,
                    handoff_messages.CHUNK_HEADER,
                )
            )
            + "; only within the credit granted | the sender, to the receiving handoff actor |",
            f"| `{S.handoff_session(node, '<session>', 'commit')}` | req/reply | {_link('HandoffCommit')} → "
            f"{_link('HandoffResult')} | the receiving handoff actor |",
            f"| `{S.handoff_session(node, '<session>', 'abort')}` | pub | {_link('HandoffAbort')} | the sender, to the "
            "receiving handoff actor |",
            "| `HandoffOpen.credit_subject` (the sender's inbox) | pub | "
            f"{_link('CreditGrant')} or {_link('SessionAborted')} (tag `type`) | the receiving handoff actor |",
            f"| `{S.event('<actor>', '<type>', '<node>')}` | JetStream, stream `{S.events_stream}` | one "
            "[event](#events) | every actor; `<node>`: the publishing node (nats-server holds each to its own) |",
            "| `$KV.<bucket>.<key>` | KV bucket | see [KV buckets](#kv-buckets) | |",
            "| `$SRV.PING`, `$SRV.INFO`, `$SRV.STATS` | req/reply (NATS micro) | service discovery | every actor, as "
            f"service `mesh-<actor>` (`mesh-{TELEMETRY}`, `mesh-{PLACEMENT}`, `mesh-{RUNNER}`) with metadata "
            "`node` and `prefix` |",
            "",
            "Every req/reply endpoint answers an [error reply](#error-replies) instead when it cannot answer. "
            "A refused placement is not an error: it is a decision with `admitted: false`, a `reason` and one "
            "[NodeRejection](#noderejection) per node.",
            "",
            "A start names a reservation made by placement; the runner reads the stamp from the reservations "
            "bucket, never from the caller. `RunnerAck.state` is where the instance stands when the reply is sent; "
            f"follow it in the instances bucket or the `{S.events_of(RUNNER)}` events.",
            "",
            "### Handoff refusal reasons",
            "",
            f"A handoff session is refused or aborted with one of these names (`HandoffResult.reason`, "
            f"`SessionAborted.reason`, `handoff_aborted` events). The receiver's credit window is up to "
            f"{_handoff_limits.window_bytes >> 20} MiB ahead of what it staged (what its sessions "
            f"may have in flight together stays within {_handoff_limits.credit_budget_bytes >> 20} MiB, two chunks "
            f"each at least), "
            f"its idle timeout "
            f"{_handoff_limits.idle_timeout_s:g} s (a session's first chunk within "
            f"{_handoff_limits.first_chunk_timeout_s:g} s of its open), at most {_handoff_limits.max_sessions} "
            "sessions at once, each sending node an equal share of them (an empty session of a node over its share "
            "gives its place to one under it: `preempted`).",
            "",
            "| reason | side | meaning |",
            "|---|---|---|",
            *(f"| `{r}` | {side} | {_cell(m)} |" for r, side, m in _handoff_reasons()),
            "",
            "### Placement refusal reasons",
            "",
            "`PlacementDecision.reason` (overall) and `NodeRejection.reason` (per node):",
            "",
            "| reason | meaning |",
            "|---|---|",
        ]
    )
    add(f"| `{reason}` | {_cell(meaning)} |" for reason, meaning in _reject_reasons())
    add(
        [
            "",
            "## KV buckets",
            "",
            "Created on first use by whichever actor or command opens them (idempotent); never deleted. "
            "An expired key reads back as an empty value (a delete marker).",
            "",
            "| bucket | key | value | history | TTL | written by | read by |",
            "|---|---|---|---|---|---|---|",
        ]
    )
    rows = [
        (
            S.nodes_bucket,
            buckets.NODES,
            "`<node id>`",
            "NodeResources",
            f"per key: the report's `ttl_s` (default {ttl:g} s)",
            "telemetry",
            "placement (watch), runner (worker-side admission), `mesh-actor status`",
        ),
        (
            S.reservations_bucket,
            buckets.RESERVATIONS,
            f"`{ledger_key('<node id>')}`",
            "NodeLedger",
            "none (an unclaimed reservation expires `hold_s` after placement first saw it)",
            "placement; the runner's claim (`reserved` to `starting`); compare-and-set on the revision read",
            "runner (`start`), `mesh-actor status`",
        ),
        (
            S.registry_bucket,
            buckets.REGISTRY,
            "`<entry name>`",
            "RegistryEntry",
            "none",
            "`mesh-actor registry add`",
            "placement (trusts entries signed by its `--registry-key`s)",
        ),
        (
            S.instances_bucket,
            buckets.INSTANCES,
            f"`{S.instance_key('<node id>', '<instance id>')}`",
            "InstanceStatus",
            f"per key: {_limits.status_ttl_s:g} s while the instance lives (refreshed), "
            f"{_limits.final_ttl_s:g} s once it ended",
            "runner",
            "placement (reconcile), `mesh-actor status`, `mesh-actor stop`",
        ),
        (
            S.l3_bucket,
            buckets.L3,
            "`<node id>`",
            "L3Inventory",
            f"per key: {_l3_limits.inventory_ttl_s:g} s (refreshed every {_l3_limits.inventory_refresh_s:g} s and "
            "soon after every change)",
            "the L3 actor",
            "router (prefix credit), other nodes' L3 actors (peer hits), `mesh-actor l3 ls`, `mesh-actor status`",
        ),
        (
            S.frontdoors_bucket,
            buckets.FRONTDOORS,
            "`<node id>`",
            "FrontDoorReport",
            "per key: 30 s (rewritten within a second of a change, and every 10 s)",
            "the front door (`mesh-actor run --http`)",
            "`mesh-actor models`, `mesh-actor status`",
        ),
        (
            S.keys_bucket,
            buckets.KEYS,
            "`<key id>`",
            "TenantKey",
            "none (a key's own `expires_at` ends it; revoking deletes its record)",
            "`mesh-actor keys issue`, `rotate`, `revoke` (admin credentials only)",
            "every front door (watch; its node's credentials read, never write), `mesh-actor keys ls`; no client",
        ),
        (
            S.limits_bucket,
            buckets.LIMITS,
            "`<key id>`",
            "KeyState",
            "per key: until its buckets are full again and its leases over, plus 60 s (set at every write); in memory",
            "every front door, by compare-and-set, on each request of a key with limits",
            "every front door (read when its last write lost to another's)",
        ),
    ]
    for name, spec, key, value, key_ttl, writer, reader in rows:
        marker = f"; delete markers kept {spec.marker_ttl_s:g} s" if spec.marker_ttl_s else ""
        add([f"| `{name}` | {key} | {_link(value)} | {spec.history} | {key_ttl}{marker} | {writer} | {reader} |"])
    add(
        [
            "",
            "Per-key TTLs are set with the `Nats-TTL` header on a JetStream publish to "
            "`$KV.<bucket>.<key>`. A ledger holds every reservation on its node; placement rewrites it "
            "with the revision it read, and re-reads and decides again when another placement wrote first.",
            "",
            f"A decision whose inputs are too large for one event (a view of thousands of nodes) stores them "
            f"in the JetStream object store `{decision_records.store_name(S)}`, as one object named by the blake3 "
            f"of its bytes; its `placement_decided` event carries that digest in `record`, and `mesh-actor "
            f"replay` fetches and checks it. Records are kept "
            f"{decision_records.DEFAULT_MAX_AGE_S / 86400:g} days (at most "
            f"{decision_records.DEFAULT_MAX_BYTES >> 30} GiB, oldest first).",
            "",
            "## Events",
            "",
            f"Stream `{S.events_stream}` stores subjects `{S.events_all}`: file storage, limits retention, "
            f"oldest discarded first, bounded by age (default {max_age_days:g} days, `journal_max_age`) and size "
            f"(default {max_gib:g} GiB, `journal_max_bytes`). Each event's `id` is its `Nats-Msg-Id`, so a "
            "retried publish is stored once. Every event has the envelope fields `type`, `id`, `time` (unix "
            "seconds), `node` and `actor`, and is published on "
            f"`{S.event('<actor>', '<type>', '<node>')}`, where `<node>` is the node that published it (its "
            "credentials allow no other). Readers should show a `type` they do not know as plain JSON "
            "(a newer producer).",
            "",
            f"Placement follows `{S.events_of(RUNNER)}` through a durable pull consumer of each node's own "
            f"(`{RUNNER_EVENTS_CONSUMER}-<node>`: only that node may create, change, pull or acknowledge it), so "
            "reservation updates survive a placement restart; every node applies every event, and a change is "
            "written once (compare-and-set).",
            "",
            "| type | subject | schema | when |",
            "|---|---|---|---|",
        ]
    )
    event_types = _event_types()
    for event_type in event_types:
        actors, when = EVENTS[event_type]
        tag = str(event_type.__struct_config__.tag)
        if len(actors) == 1:
            subject = f"`{S.event(actors[0], tag, '<node>')}`"
        else:
            subject = f"`{S.event('<actor>', tag, '<node>')}`, `<actor>`: " + ", ".join(f"`{a}`" for a in actors)
        add([f"| `{tag}` | {subject} | {_link(event_type.__name__)} | {_cell(when)} |"])

    bad = _bad_request_example()
    add(
        [
            "",
            "## Error replies",
            "",
            f"A request that fails is answered with an {_link('ErrorReply')} body and these headers (NATS micro's "
            "service-error convention, so generic tools show them):",
            "",
            "| header | value |",
            "|---|---|",
            f"| `{errors.ERROR_HEADER}` | the message (at most 256 characters) |",
            f"| `{errors.ERROR_CODE_HEADER}` | an HTTP-like number: "
            + ", ".join(
                f"`{error_headers(ErrorReply(code=code, message=''))[errors.ERROR_CODE_HEADER]}` for `{code}`"
                for code in (
                    errors.BAD_REQUEST,
                    errors.NOT_FOUND,
                    errors.BUSY,
                    errors.UNAVAILABLE,
                    errors.TIMEOUT,
                    errors.INTERNAL,
                )
            )
            + f", `{error_headers(ErrorReply(code='settings_drift', message=''))[errors.ERROR_CODE_HEADER]}` for an "
            "actor's own refusals (e.g. `settings_drift`) |",
            f"| `{errors.MESH_ERROR_HEADER}` | the stable `code` |",
            "",
            f"A client checks for `{errors.ERROR_HEADER}` or `{errors.MESH_ERROR_HEADER}` before decoding the body "
            "as the reply type. Codes are stable; clients branch on them. One registry (`messages/errors.py`) gives "
            "each its HTTP status on the front door and whether a retry can fix it (the front door says so in "
            "`x-should-retry`, with `Retry-After` on a retryable one; a 503 is always retryable):",
            "",
            "| code | from | HTTP, retry | meaning |",
            "|---|---|---|---|",
        ]
    )
    add(f"| `{code}` | {where} | {http} | {_cell(meaning)} |" for code, where, http, meaning in _error_codes())
    add(
        [
            "",
            "A request whose `ctx` is a string instead of an integer is answered:",
            "",
            "```json",
            json.dumps(msgspec.to_builtins(bad), indent=2, ensure_ascii=False),
            "```",
            "",
            "## Calling it from any NATS client",
            "",
            "`mesh-actor nats-env` prints the URL and credentials of the mesh: for the embedded server, those "
            "recorded in the data dir (`nats.json`, mode 0600; pass `--data-dir` of the first node); otherwise "
            "those given with `--nats` and the credential flags. The names are the ones the `nats` CLI reads; "
            "`--json` prints one object instead.",
            "",
            "```sh",
            "mesh-actor nats-env                          # NATS_URL=…, NATS_USER=…, NATS_PASSWORD=…",
            'set -a; eval "$(mesh-actor nats-env)"; set +a',
            "",
            f'nats req {S.placement_request} \'{{"model": {{"path": "/models/x.gguf"}}, "ctx": 8192}}\' --timeout 30s',
            f'nats req {S.placement_fit} \'{{"model": {{"path": "/models/x.gguf"}}, "max_ctx": true}}\' --timeout 30s',
            f'nats req {S.runner(node, "start")} \'{{"reservation_id": "<reservation_id of the decision>"}}\' '
            "--timeout 2m",
            f'nats req {S.runner(node, "stop")} \'{{"instance_id": "<instance id>"}}\' --timeout 40s',
            f"nats sub '{S.telemetry_all}'                 # live telemetry",
            f"nats sub '{S.events_all}'                    # events as they are published",
            f"nats kv get {S.reservations_bucket} {ledger_key(node)}",
            f"nats kv watch {S.instances_bucket}",
            "nats micro ls                                # the actors of every node",
            "```",
            "",
            "The model path is read by the placement actor that answers, so it must name the same file on every "
            'placement node (or use a signed registry entry: `{"model": {"registry": "<name>"}}`). '
            "Payloads over the server's `max_payload` are refused at the sender.",
            "",
            "## Message schemas",
            "",
            "Exported with `msgspec.json.schema_components`; a `$ref` `#/$defs/<Name>` is the section `<Name>` "
            "below. Sizes are integer bytes; times are unix seconds. The notes are the comments beside each field "
            "in `messages/`.",
            "",
        ]
    )
    roots: list[type] = [
        PlacementRequest,
        PlacementDecision,
        StartInstance,
        StopInstance,
        RunnerAck,
        LendRequest,
        Lent,
        NodeResources,
        NodeLedger,
        RegistryEntry,
        InstanceStatus,
        GenerateRequest,
        GenerateResult,
        GenerateChunk,
        StreamPing,
        RunnerGenerate,
        Tokenize,
        Tokens,
        Render,
        RelayHead,
        Prefill,
        PrefillResult,
        ServingReport,
        FrontDoorReport,
        TenantKey,
        KeyState,
        l3_messages.L3Inventory,
        l3_messages.ManifestsRequest,
        l3_messages.ManifestList,
        l3_messages.ManifestRequest,
        l3_messages.SegmentRequest,
        l3_messages.SegmentOfferRequest,
        l3_messages.EntryRequest,
        l3_messages.EntryStat,
        l3_messages.VerifyReply,
        l3_messages.GcRequest,
        l3_messages.GcReply,
        l3_messages.EvictRequest,
        l3_messages.EvictReply,
        files_messages.HeldRequest,
        files_messages.FileHeld,
        files_messages.FileFacts,
        files_messages.ChunkRequest,
        files_messages.OfferRequest,
        datapath_messages.DirectOffer,
        datapath_messages.DataHello,
        datapath_messages.DataAnswer,
        files_messages.PullRequest,
        files_messages.PullReply,
        handoff_messages.HandoffOpen,
        handoff_messages.HandoffOpened,
        handoff_messages.CreditGrant,
        handoff_messages.SessionAborted,
        handoff_messages.HandoffCommit,
        handoff_messages.HandoffAbort,
        handoff_messages.HandoffResult,
        handoff_messages.LinkProbe,
        handoff_messages.LinkProbeResult,
        ErrorReply,
        *event_types,
    ]
    _schema_section(roots, lines)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return write_or_check(API_MD, render, COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
