"""`mesh-actor replay`: every actor's recorded decisions, re-decided by today's cores from what the journal says.

One replayer per kind of decision, each the pure core that decides it today:

| kind | journal event | core |
|---|---|---|
| placement | `placement.placement_decided` | `actors.placement.replay.recompute` (the model read again if there) |
| routing | `router.generate_routed` | `actors.router.routing.route` |
| queue | `runner.generate_queued`, `runner.generate_dequeued` | `actors.runner.fairqueue.retag`, `rechoose` |
| scaling | `frontdoor.scaling_decided` | `actors.frontdoor.scaling.replay` |

A decision that today's core would make differently is listed with the paths that differ; one this version cannot
read (or whose inputs are gone) is skipped with why. Exits 3 when some decision would now differ.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.frontdoor.scaling import replay as replay_scaling
from actors.placement import decision_records
from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, parse_header
from actors.placement.replay import differences, inputs_of, recompute
from actors.router.routing import ROUTER_VERSION, route
from actors.runner.fairqueue import rechoose, retag
from messages.events import (
    DecisionInputs,
    GenerateDequeued,
    GenerateQueued,
    GenerateRouted,
    PlacementDecided,
    ScalingDecided,
)
from messages.model import ModelGeometry
from messages.subjects import Subjects
from runtime.bus import BadMessage, Bus, decode_checked
from runtime.cli.common import add_client_options, connect, emit_json, prefix
from runtime.cli.journal import read_events
from runtime.model_files import ModelFileError, open_regular

__all__ = ["REPLAYERS", "cmd_replay", "register"]

EXIT_CHANGED = 3


@dataclass(frozen=True)
class Changed:
    """A recorded decision today's core would make differently."""

    decision_id: str
    model: str
    differences: list[dict[str, Any]]  # {path, recorded, now}
    more: dict[str, Any]  # what else explains it (the model's source, the versions)


@dataclass(frozen=True)
class Skipped:
    reason: str
    decision_id: str | None = None


#: What one replayer says of one event: nothing differs (None), a difference, or why it was not replayed.
Verdict = Changed | Skipped | None
Replayer = Callable[[Bus, Subjects, bytes, int], Awaitable[Verdict]]


def _paths(diff: list[Any]) -> list[dict[str, Any]]:
    return [{"path": d.path, "recorded": d.recorded, "now": d.now} for d in diff]


async def _placement(bus: Bus, subjects: Subjects, data: bytes, seq: int) -> Verdict:
    event = decode_checked(data, PlacementDecided, f"event {seq}")
    decision_id = event.decision.decision_id
    try:
        inputs = await _inputs(bus, subjects, event)
    except decision_records.RecordUnavailable as exc:
        return Skipped(str(exc), decision_id)
    geometry, source = await asyncio.to_thread(_geometry_now, inputs)
    if geometry is None:
        return Skipped(f"model unreadable (geometry: {source})", decision_id)
    now = await asyncio.to_thread(recompute, inputs, geometry)
    diff = differences(inputs.decision, now)
    if not diff:
        return None
    model = inputs.request.model.path or inputs.request.model.registry or ""
    return Changed(decision_id, model, _paths(diff), {"geometry": source})


async def _routing(bus: Bus, subjects: Subjects, data: bytes, seq: int) -> Verdict:
    routed = decode_checked(data, GenerateRouted, f"event {seq}")
    rerouted = route(routed.n_prompt, routed.candidates, routed.weights, routed.links, routed.link_fixed_s)
    diff = differences(routed.decision, rerouted)
    if not diff:
        return None
    # A decision made by an older router differs where that version's rules changed.
    versions = {"recorded": routed.router_version, "now": ROUTER_VERSION}
    return Changed(routed.id, routed.model, _paths(diff), {"versions": versions})


def _queue(kind: type[GenerateQueued] | type[GenerateDequeued]) -> Replayer:
    async def replay(bus: Bus, subjects: Subjects, data: bytes, seq: int) -> Verdict:
        queued = decode_checked(data, kind, f"event {seq}")
        diff = _queue_differences(queued)
        return Changed(queued.id, queued.instance_id, diff, {}) if diff else None

    return replay


async def _scaling(bus: Bus, subjects: Subjects, data: bytes, seq: int) -> Verdict:
    scaled = decode_checked(data, ScalingDecided, f"event {seq}")
    diff = replay_scaling(scaled.scale, scaled.memory, scaled.now, scaled.decision)
    if not diff:
        return None
    paths = [{"path": path, "recorded": was, "now": now} for path, was, now in diff]
    return Changed(scaled.id, scaled.scale.model, paths, {})


#: (kind, journal event pattern, replayer), in the order they are replayed.
REPLAYERS: tuple[tuple[str, str, Replayer], ...] = (
    ("placement", "placement.placement_decided", _placement),
    ("routing", "router.generate_routed", _routing),
    ("queue", "runner.generate_queued", _queue(GenerateQueued)),
    ("queue", "runner.generate_dequeued", _queue(GenerateDequeued)),
    ("scaling", "frontdoor.scaling_decided", _scaling),
)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    replay = sub.add_parser(
        "replay", help="recompute recorded placement, routing, queue and scaling decisions with today's cores"
    )
    add_client_options(replay)
    replay.add_argument("--since", metavar="SEQ|TIME", help="a stream sequence, an ISO time, or an age like 1h")
    replay.set_defaults(func=cmd_replay)


async def cmd_replay(args: argparse.Namespace) -> int:
    subjects = Subjects(prefix(args))
    bus = await connect(args, "replay")
    changed: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    replayed = 0
    try:
        for kind, pattern, replayer in REPLAYERS:
            async for stored in read_events(bus, subjects, pattern, since=args.since, follow=False):
                try:
                    verdict = await replayer(bus, subjects, stored.data, stored.seq)
                except BadMessage as exc:
                    skipped.append({"seq": stored.seq, "reason": f"not a {kind} this version can read: {exc.error}"})
                    continue
                if isinstance(verdict, Skipped):
                    skipped.append({"seq": stored.seq, "reason": verdict.reason}
                                   | ({"decision_id": verdict.decision_id} if verdict.decision_id else {}))  # fmt: skip
                    continue
                replayed += 1
                if verdict is not None:
                    changed.append({"seq": stored.seq, "decision_id": verdict.decision_id, "model": verdict.model,
                                    "kind": kind, **verdict.more, "differences": verdict.differences})  # fmt: skip
    finally:
        await bus.close()
    _report(args.json, replayed, changed, skipped)
    return EXIT_CHANGED if changed else 0


def _report(as_json: bool, replayed: int, changed: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> None:
    if as_json:
        emit_json({"replayed": replayed, "changed": changed, "skipped": skipped})
        return
    for item in changed:
        versions = item.get("versions")
        by = f", router {versions['recorded']} -> {versions['now']}" if versions else ""
        print(f"decision {item['decision_id']} (seq {item['seq']}, {item['model']}{by}) would now differ:")
        for d in item["differences"]:
            print(f"  {d['path']}: {d['recorded']!r} -> {d['now']!r}")
    for item in skipped:
        print(f"skipped seq {item['seq']}: {item['reason']}", file=sys.stderr)
    print(f"{replayed} decisions replayed, {len(changed)} would differ, {len(skipped)} skipped")


def _geometry_now(inputs: DecisionInputs) -> tuple[ModelGeometry | None, str]:
    """Today's reading of the model when the file is still there (by absolute path), else the recorded one."""
    path = inputs.model_path
    if path and inputs.request.model.registry is None and Path(path).is_absolute():
        try:
            fd, key = open_regular(Path(path))  # a journal names the file: never block on a FIFO or device
        except ModelFileError:
            return inputs.geometry, "recorded"
        try:
            with os.fdopen(fd, "rb") as handle:
                return geometry_from_header(parse_header(handle, key.size, source=path)), "file"
        except (GGUFFormatError, GeometryError, OSError):
            return None, "file unreadable now"
    return inputs.geometry, "recorded"


async def _inputs(bus: Bus, subjects: Subjects, event: PlacementDecided) -> DecisionInputs:
    """The decision's inputs: inline in the event, or its side record (fetched and checked by digest)."""
    inline = inputs_of(event)
    if inline is not None:
        return inline
    assert event.record is not None
    return await decision_records.fetch(bus, subjects, event.record)


def _queue_differences(event: GenerateQueued | GenerateDequeued) -> list[dict[str, Any]]:
    """How today's queue rules differ from a recorded queue decision: a waiter's tags from their inputs, or the
    choice among the recorded candidates (the recorded choice is the first)."""
    if isinstance(event, GenerateQueued):
        recorded = event.waiter
        now = retag(recorded)
        return [
            {"path": f"waiter.{name}", "recorded": getattr(recorded, name), "now": getattr(now, name)}
            for name in ("start", "finish")
            if getattr(recorded, name) != getattr(now, name)
        ]
    chosen = rechoose(event.candidates)
    if event.candidates and chosen != event.candidates[0].request_id:
        return [{"path": "chosen", "recorded": event.candidates[0].request_id, "now": chosen}]
    return []
