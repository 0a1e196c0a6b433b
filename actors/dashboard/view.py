"""The fleet as the dashboard shows it (dashboard core, pure): records and journal events folded into one view.

Inputs, each fed by the shell as it arrives: the buckets' records of every node (`node`, `instance`, `ledger`,
`frontdoor`, `l3`: a value, or None when the key went) and the journal's events (`event`, as stored: JSON bytes,
read without a schema so that a newer producer's events still show). Each call returns the deltas it caused,
which the shell sends to every open page; `snapshot` is the whole view, what a page gets when it connects.

What it shows, every figure read from a record (nothing is measured here):

* a node: its telemetry, and per device a bar: its size (capped by the node's memory limit) and what is usable
  now, what each kind of memory of its live instances is predicted to take there (weights, KV, recurrent,
  compute, the rest), what their servers reported they allocated there (`observed`: llama.cpp's buffers, named
  by backend and device, `device_of`), what the ledger holds (`reserved`: predicted while booked, observed once
  running) and what a new reservation may take (`available`, placement's own rule);
* an instance: its settings as stamped, its state, and its memory predicted and observed, kind by kind;
* a catalog model of each front door: its state, queue and instances;
* the journal's tail, one summary line per event, bounded (`journal_limit` events); the whole event is kept
  only for placement and routing decisions (`decision_limit` of them, `decision_bytes` in all), which
  `explain` turns into the decision with its inputs.

Memory is bounded: the journal tail and the decisions kept are capped, and records go with their keys. Every
field is a peer's (any node writes its events and records), so each string shown is cut to a bound and each
list to a count (`_text`, `_ident`, `_listed`): a peer's 900 KB event ids would otherwise make a 500-event tail
hundreds of MB, sent whole to every page that connects.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from actors.placement.ledger import available, device_sizes
from messages.frontdoor import FrontDoorModel, FrontDoorReport
from messages.l3 import L3Inventory
from messages.placement import NodeLedger
from messages.runner import InstanceStatus
from messages.telemetry import NodeResources

__all__ = ["DECISION_TYPES", "KINDS", "Delta", "FleetView", "device_of", "merge", "summary"]

#: The kinds of memory a bar shows apart; everything else an instance takes on a device is "other".
KINDS: Final = ("weights", "kv", "recurrent", "compute")
#: Events that carry a decision with its inputs (what `mesh-actor replay` re-decides).
DECISION_TYPES: Final = frozenset({"placement_decided", "generate_routed"})
#: Instance states whose server no longer holds memory.
_ENDED: Final = frozenset({"stopped", "failed", "rejected"})
#: Envelope fields a summary line leaves out (shown in columns of their own).
_ENVELOPE: Final = frozenset({"id", "time", "node", "actor", "type", "trace"})
_SUMMARY_CHARS: Final = 240
#: Bounds of what is shown of a peer's strings: an id or a name (node, actor, type, instance, model), a path
#: or a message, a traceparent (55 characters when well formed); and of its lists (members, instances).
_NAME_CHARS: Final = 128
_TEXT_CHARS: Final = 1024
_TRACE_CHARS: Final = 64
_LIST_ITEMS: Final = 256
#: An event's time is seconds since the epoch: anything else is not shown (a 4,000-digit integer is JSON too).
_MAX_TIME: Final = 1e12
#: A GPU backend's buffer of one device (`CUDA0`, `Vulkan1`, …): the mesh names that device `GPU<n>`.
_GPU_BUFFER: Final = re.compile(r"^(?:CUDA|ROCm|HIP|Vulkan|SYCL|MUSA|CANN)(\d+)$")

#: One change of the view: `{"op": "node" | "instance" | "model" | "event", "id": ..., "value": ... | None}`.
Delta = dict[str, Any]


def device_of(buffer: str) -> str | None:
    """The mesh's device of one of llama.cpp's buffers (`CPU`, `CPU_Mapped`, `CPU_REPACK` and pinned host
    buffers such as `CUDA_Host` are host memory, `CUDA0` is `GPU0`); None for another node's (`RPC[…]`) or one
    it cannot tell."""
    gpu = _GPU_BUFFER.match(buffer)
    if gpu is not None:
        return f"GPU{int(gpu.group(1))}"
    if buffer.startswith("CPU") or buffer.endswith("_Host"):
        return "CPU"
    return None


def _text(value: object, limit: int = _NAME_CHARS) -> str:
    """`value` as a string of at most `limit` characters (a longer one is cut, and says so with "…")."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _ident(value: object) -> str:
    """An id or key of at most `_NAME_CHARS` characters; a longer one keeps its start and a digest of the whole,
    so two long ids stay two (an event is not taken for another, a record does not replace another's)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= _NAME_CHARS:
        return text
    digest = hashlib.blake2b(text.encode(errors="replace"), digest_size=8).hexdigest()
    return f"{text[: _NAME_CHARS - len(digest) - 1]}…{digest}"


def _listed(values: Iterable[object], limit: int = _LIST_ITEMS) -> list[str]:
    """At most `limit` of `values`, each a bounded name."""
    return [_text(v) for _, v in zip(range(limit), values, strict=False)]


def summary(event: dict[str, Any]) -> str:
    """One line for an event: the verdict of a decision, then its scalar fields (nested records are in its
    detail), at most `_SUMMARY_CHARS` characters (each field cut before it is joined: a peer's field may be
    a megabyte)."""
    parts = [
        _text(f"{_text(k)}={_text(v, _SUMMARY_CHARS)}", _SUMMARY_CHARS)
        for k, v in event.items()
        if k not in _ENVELOPE and v not in ("", None) and not isinstance(v, dict | list)
    ]
    decision = event.get("decision")
    kind = event.get("type")
    if isinstance(decision, dict) and kind == "placement_decided":
        model = decision.get("model") or {}
        where = ",".join(str(p.get("node_id")) for p in decision.get("placements") or () if isinstance(p, dict))
        where = _text(where, _SUMMARY_CHARS)
        verdict = f"admitted on {where}" if decision.get("admitted") else f"refused ({_text(decision.get('reason'))})"
        named = _text(model.get("path") or model.get("registry"), _SUMMARY_CHARS)
        parts = [_text(f"{named} {verdict} ctx={decision.get('ctx')}", _SUMMARY_CHARS), *parts]
    elif isinstance(decision, dict) and kind == "generate_routed":
        chosen = decision.get("chosen")
        reason = _text(decision.get("reason"))
        verdict = f"to {_text(chosen)} ({reason})" if chosen else f"refused ({reason})"
        if decision.get("prefill_node"):
            verdict += f", prefill on {_text(decision['prefill_node'])}"
        parts = [verdict, *parts]
    line = " ".join(parts)
    return line if len(line) <= _SUMMARY_CHARS else line[: _SUMMARY_CHARS - 1] + "…"


class FleetView:
    """Every node, instance and catalog model of the mesh, and the journal's tail, as the page shows them."""

    def __init__(self, *, journal_limit: int = 500, decision_limit: int = 64, decision_bytes: int = 8 << 20) -> None:
        self.journal_limit = journal_limit
        self.decision_limit = decision_limit
        self.decision_bytes = decision_bytes
        self._nodes: dict[str, NodeResources] = {}
        self._instances: dict[str, InstanceStatus] = {}  # by instance id
        self._ledgers: dict[str, NodeLedger] = {}
        self._doors: dict[str, FrontDoorReport] = {}
        self._l3: dict[str, L3Inventory] = {}
        self._journal: deque[dict[str, Any]] = deque()
        self._seen: set[str] = set()  # ids of the events in the tail (an event read twice shows once)
        self._decisions: OrderedDict[str, bytes] = OrderedDict()  # id -> the stored event, oldest first
        self._decisions_size = 0

    # --- records ---------------------------------------------------------------------------------------------

    def node(self, node_id: str, report: NodeResources | None) -> list[Delta]:
        if report is None:
            self._nodes.pop(node_id, None)
        else:
            self._nodes[node_id] = report
        return [self._node_delta(node_id)]

    def ledger(self, node_id: str, ledger: NodeLedger | None) -> list[Delta]:
        if ledger is None:
            self._ledgers.pop(node_id, None)
        else:
            self._ledgers[node_id] = ledger
        return [self._node_delta(node_id)]

    def l3(self, node_id: str, inventory: L3Inventory | None) -> list[Delta]:
        if inventory is None:
            self._l3.pop(node_id, None)
        else:
            self._l3[node_id] = inventory
        return [self._node_delta(node_id)]

    def instance(self, instance_id: str, status: InstanceStatus | None) -> list[Delta]:
        """An instance's record (None: its key went). Its node's bars change with it."""
        old = self._instances.pop(instance_id, None)
        if status is not None:
            self._instances[instance_id] = status
        nodes = {s.node for s in (old, status) if s is not None}
        value = _instance_view(status) if status is not None else None
        return [
            {"op": "instance", "id": _ident(instance_id), "value": value},
            *(self._node_delta(n) for n in sorted(nodes)),
        ]

    def frontdoor(self, node_id: str, report: FrontDoorReport | None) -> list[Delta]:
        """A front door's report (None: it went): its catalog models, each one delta."""
        old = self._doors.pop(node_id, None)
        if report is not None:
            self._doors[node_id] = report
        before = {_model_id(node_id, m) for m in old.models} if old is not None else set()
        now = {_model_id(node_id, m): _model_view(report, m) for m in report.models} if report is not None else {}
        gone: dict[str, Any] = dict.fromkeys(before - set(now))
        return [{"op": "model", "id": key, "value": v} for key, v in sorted({**gone, **now}.items())]

    # --- the journal -----------------------------------------------------------------------------------------

    def event(self, seq: int | None, subject: str, data: bytes) -> list[Delta]:
        """One event as stored (`seq`: its stream sequence, None when heard live). An event already in the tail
        is not added again; one that is not a JSON object shows as unreadable."""
        try:
            event: Any = json.loads(data)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            event = {"type": "unreadable", "id": "", "actor": "", "node": subject.rsplit(".", 1)[-1]}
        event_id = _ident(event.get("id") or "")
        if event_id and event_id in self._seen:
            return []
        kind = _text(event.get("type") or "?")
        when = event.get("time")
        entry = {
            "id": event_id,
            "seq": seq,
            "time": when
            if isinstance(when, int | float) and not isinstance(when, bool) and abs(when) < _MAX_TIME
            else None,
            "node": _text(event.get("node") or ""),
            "actor": _text(event.get("actor") or ""),
            "type": kind,
            "summary": summary(event),
            "trace": event["trace"][:_TRACE_CHARS] if isinstance(event.get("trace"), str) else "",  # its traceparent
            "decision": kind in DECISION_TYPES and bool(event_id),
        }
        self._journal.append(entry)
        if event_id:
            self._seen.add(event_id)
        while len(self._journal) > self.journal_limit:
            self._seen.discard(self._journal.popleft()["id"])
        if entry["decision"]:
            self._keep_decision(event_id, data)
        return [{"op": "event", "id": event_id, "value": entry}]

    def _keep_decision(self, event_id: str, data: bytes) -> None:
        if len(data) > self.decision_bytes:
            return
        self._decisions[event_id] = data
        self._decisions_size += len(data)
        while len(self._decisions) > self.decision_limit or self._decisions_size > self.decision_bytes:
            _, dropped = self._decisions.popitem(last=False)
            self._decisions_size -= len(dropped)

    def decision(self, event_id: str) -> bytes | None:
        """A kept decision event, as stored (None: not one, or no longer kept)."""
        return self._decisions.get(event_id)

    # --- what a page gets --------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        nodes = set(self._nodes) | set(self._ledgers) | {s.node for s in self._instances.values()}
        return {
            "nodes": {_ident(n): v for n in sorted(nodes) if (v := self._node_view(n)) is not None},
            "instances": {_ident(i): _instance_view(s) for i, s in sorted(self._instances.items())},
            "models": {
                _model_id(node_id, m): _model_view(door, m)
                for node_id, door in sorted(self._doors.items())
                for m in door.models
            },
            "journal": list(self._journal),
        }

    @property
    def journal(self) -> list[dict[str, Any]]:
        return list(self._journal)

    @property
    def kept_decisions(self) -> tuple[int, int]:
        """How many decision events are kept, and their bytes."""
        return len(self._decisions), self._decisions_size

    def _node_delta(self, node_id: str) -> Delta:
        return {"op": "node", "id": _ident(node_id), "value": self._node_view(node_id)}

    def _node_view(self, node_id: str) -> dict[str, Any] | None:
        """A node with its device bars; None when nothing is known of it (no telemetry: it expired)."""
        report = self._nodes.get(node_id)
        if report is None:
            return None
        ledger = self._ledgers.get(node_id)
        reserved: dict[str, int] = {}
        for r in ledger.reservations if ledger is not None else ():
            for device, size in r.held.items():
                reserved[device] = reserved.get(device, 0) + size
        predicted: dict[str, dict[str, int]] = {}
        observed: dict[str, int] = {}
        for status in self._instances.values():
            if status.node != node_id or status.state in _ENDED:
                continue
            for buffer, size in (status.observed_memory.devices if status.observed_memory else {}).items():
                where = device_of(buffer)
                if where is not None:
                    observed[where] = observed.get(where, 0) + size
            for d in status.predicted_memory.devices:
                kinds = predicted.setdefault(d.device, dict.fromkeys((*KINDS, "other"), 0))
                named = 0
                for kind in KINDS:
                    size = getattr(d, f"{kind}_bytes")
                    kinds[kind] += size
                    named += size
                kinds["other"] += max(0, d.total_bytes - named)
        sizes = device_sizes(report)
        free = available(report, ledger)
        gpus = {f"GPU{g.index}": g.name for g in report.gpus}
        devices = []
        for device in sorted(set(sizes) | set(reserved) | set(predicted) | set(observed)):
            size, usable = sizes.get(device, (0, 0))
            devices.append(
                {
                    "device": _text(device),
                    "name": _text(gpus.get(device, "host memory" if device == "CPU" else device)),
                    "size_bytes": size,
                    "usable_bytes": usable,
                    "reserved_bytes": reserved.get(device, 0),
                    "available_bytes": free.get(device, 0),
                    "predicted": predicted.get(device, dict.fromkeys((*KINDS, "other"), 0)),
                    "observed_bytes": observed.get(device, 0),
                }
            )
        store = self._l3.get(node_id)
        return {
            "id": _ident(node_id),
            "sent_at": report.sent_at,
            "started_at": report.started_at,
            "ttl_s": report.ttl_s,
            "cpus": report.host.cpu_count,
            "memory_limit_bytes": report.memory_limit_bytes,
            "llama_server": _text(report.llama_server.version) if report.llama_server else None,
            "settings": msgspec.to_builtins(report.settings) if report.settings else None,
            "devices": devices,
            "l3": {k: getattr(store, k) for k in ("entries", "tokens", "bytes", "budget_bytes", "quarantined")}
            if store is not None
            else None,
            "reservations": len(ledger.reservations) if ledger is not None else 0,
        }


def _instance_view(status: InstanceStatus) -> dict[str, Any]:
    predicted = status.predicted_memory
    observed = status.observed_memory
    kinds = (*KINDS, "output", "total")
    stamp = status.settings
    return {
        "id": _ident(status.id),
        "node": _ident(status.node),
        "state": status.state,
        "port": status.port,
        "model": _text(status.model_path[-_TEXT_CHARS:].rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")),
        "model_path": _text(status.model_path, _TEXT_CHARS),
        "ctx": stamp.ctx,
        "n_gpu_layers": stamp.n_gpu_layers,
        "settings": msgspec.to_builtins(stamp.settings),
        "members": _listed(status.members),
        "restarts": status.restarts,
        "message": _text(status.message, _TEXT_CHARS),
        "updated_at": status.updated_at,
        "predicted": {k: getattr(predicted, f"{k}_bytes") for k in kinds},
        "observed": {k: getattr(observed, f"{k}_bytes") for k in kinds} if observed is not None else None,
        "devices": _listed(d.device for d in predicted.devices),
    }


def _model_id(node_id: str, model: FrontDoorModel) -> str:
    """A catalog model's key in the view: its front door's node and its name (each bounded)."""
    return f"{_ident(node_id)}/{_ident(model.name)}"


def _model_view(door: FrontDoorReport, model: FrontDoorModel) -> dict[str, Any]:
    return {
        "frontdoor": _ident(door.node_id),
        "name": _ident(model.name),
        "path": _text(model.path, _TEXT_CHARS),
        "state": model.state,
        "queued": model.queued,
        "active": model.active,
        "max_queue": model.max_queue,
        "instances": _listed(model.instances),
        "held_bytes": model.held_bytes,
        "pinned": model.pinned,
        "priority": model.priority,
        "idle_ttl_s": model.idle_ttl_s,
        "ctx": model.ctx,
        "settings": msgspec.to_builtins(model.settings) if model.settings else None,
    }


def merge(deltas: Iterable[Delta]) -> list[Delta]:
    """Deltas with only the last of each (op, id) kept, in the order of those last ones (events all kept)."""
    last: dict[tuple[str, str], int] = {}
    items = list(deltas)
    for i, d in enumerate(items):
        if d["op"] != "event":
            last[d["op"], d["id"]] = i
    return [d for i, d in enumerate(items) if d["op"] == "event" or last[d["op"], d["id"]] == i]
