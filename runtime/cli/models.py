"""`mesh-actor models`: the front doors' catalogs, each model with its state, memory and queue.

Read from the `MESH_FRONTDOORS` bucket (each front door's last report; a node that stopped drops out with its
key's TTL). `--json` prints the reports as they are stored.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from messages.frontdoor import FrontDoorReport
from messages.placement import PreferredSettings
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus
from runtime.cli.common import EXIT_OK, add_client_options, connect, emit_json, prefix
from runtime.sizes import format_size


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("models", help="the front doors' model catalogs: state, memory and queue of each model")
    add_client_options(p)
    p.set_defaults(func=cmd_models)


async def fetch_frontdoors(bus: Bus, subjects: Subjects) -> list[FrontDoorReport]:
    reports, warnings = await buckets.read_all(bus, subjects.frontdoors_bucket, FrontDoorReport)
    for warning in warnings:
        print(f"mesh-actor: warning: skipping {warning}", file=sys.stderr)
    return [report for _, report in reports]


async def cmd_models(args: argparse.Namespace) -> int:
    bus = await connect(args, "models")
    try:
        reports = await fetch_frontdoors(bus, Subjects(prefix(args)))
    finally:
        await bus.close()
    if args.json:
        emit_json([msgspec.to_builtins(r) for r in reports])
        return EXIT_OK
    if not reports:
        print("no front door is running (start one with mesh-actor run --http [HOST:]PORT)")
        return EXIT_OK
    for report in reports:
        key = "key required" if report.auth else "no key"
        print(f"front door on {report.node_id}: {report.address}/v1 ({key})")
        print(f"  {'MODEL':<24} {'STATE':<9} {'MEMORY':>10} {'QUEUED':>6} {'ACTIVE':>6} {'PIN':>3} {'PRIO':>4}  PATH")
        for m in report.models:
            print(
                f"  {m.name:<24} {m.state:<9} {format_size(m.held_bytes):>10} {m.queued:>6} {m.active:>6} "
                f"{'yes' if m.pinned else '-':>3} {m.priority:>4}  {m.path}"
            )
            if m.settings is not None:
                print(f"  {'':<24} requires {_required(m.settings)}")
    return EXIT_OK


def _required(settings: PreferredSettings) -> str:
    """The settings a model's instances must run with, as llama-server flags."""
    flags = (("slots", "-np"), ("cache_type_k", "-ctk"), ("cache_type_v", "-ctv"), ("flash_attn", "-fa"),
             ("kv_unified", "-kvu"), ("spec_type", "--spec-type"), ("spec_draft_n_max", "--spec-draft-n-max"),
             ("swa_full", "--swa-full"), ("pooling", "--pooling"))  # fmt: skip
    kind = {"embedding": "--embeddings", "rerank": "--rerank"}.get(settings.kind or "")
    given = [f"{flag} {getattr(settings, name)}" for name, flag in flags if getattr(settings, name) is not None]
    return " ".join([kind, *given] if kind else given)
