"""`mesh-actor usage [--tenant T] [--since AGE|ISO] [--json]`: requests and tokens summed by tenant and model.

Read from the journal (`request_usage` events, one per request to any node's front door, `messages.events`), as
`mesh-actor events` reads it. A row per (tenant, model): requests, prompt, cached and generated tokens, the time
spent answering, and the requests by HTTP status and by the limit that refused them. The admin key and an open
door are the tenant "" (shown as `-`); a request for a model its key may not use (or none) is the model "".
`--json` prints `{"since", "tenant", "rows": [...], "total": {...}}`, the rows sorted by tenant then model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from messages.subjects import Subjects
from runtime.cli.common import add_client_options, connect, emit_json, prefix, refuse_client
from runtime.cli.journal import parse_since, read_events

__all__ = ["register", "summarize"]

_FIELDS = ("prompt_tokens", "cached_tokens", "generated_tokens")


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("usage", help="requests and tokens by tenant and model, from the journal")
    add_client_options(p)
    p.add_argument("--tenant", help="only this tenant's requests ('' for the admin key and open doors)")
    p.add_argument("--since", metavar="AGE|TIME", help="an age like 10m, 24h, 7d, or an ISO time (default: all)")
    p.set_defaults(func=cmd_usage)


def _row(tenant: str, model: str) -> dict[str, Any]:
    return {"tenant": tenant, "model": model, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
            "generated_tokens": 0, "total_tokens": 0, "duration_ms": 0.0, "statuses": {}, "refused": {}}  # fmt: skip


def _add(row: dict[str, Any], event: dict[str, Any]) -> None:
    count = event.get("count", 1)
    count = count if isinstance(count, int) and count > 0 else 1  # refusals are journaled many to an event
    row["requests"] += count
    for name in _FIELDS:
        value = event.get(name)
        row[name] += value if isinstance(value, int) and value >= 0 else 0
    row["total_tokens"] = row["prompt_tokens"] + row["generated_tokens"]
    duration = event.get("duration_ms")
    row["duration_ms"] += float(duration) if isinstance(duration, int | float) else 0.0
    status = str(event.get("status", "?"))
    row["statuses"][status] = row["statuses"].get(status, 0) + count
    refused = event.get("refused")
    if isinstance(refused, str) and refused:
        row["refused"][refused] = row["refused"].get(refused, 0) + count


def summarize(
    events: Iterable[dict[str, Any]], tenant: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows (one per tenant and model) and their total, from `request_usage` events (others are skipped)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    total = _row("", "")
    for event in events:
        if event.get("type") != "request_usage":
            continue
        who, model = str(event.get("tenant", "")), str(event.get("model", ""))
        if tenant is not None and who != tenant:
            continue
        _add(rows.setdefault((who, model), _row(who, model)), event)
        _add(total, event)
    del total["tenant"], total["model"]
    return [rows[k] for k in sorted(rows)], total


async def cmd_usage(args: argparse.Namespace) -> int:
    since: str | None = None
    if args.since:
        seq, when = parse_since(args.since, datetime.now(UTC))  # a usage error exits here, before connecting
        since = when.isoformat() if when is not None else str(seq)
    subjects = Subjects(prefix(args))
    refuse_client(args, "the tenants' usage")
    bus = await connect(args, "usage")
    events: list[dict[str, Any]] = []
    try:
        async for stored in read_events(
            bus, subjects, "frontdoor.request_usage", since=since, follow=False, private=True
        ):
            try:
                event = json.loads(stored.data)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    finally:
        await bus.close()
    rows, total = summarize(events, args.tenant)
    if args.json:
        emit_json({"since": since, "tenant": args.tenant, "rows": rows, "total": total})
        return 0
    header = f"{'TENANT':<20} {'MODEL':<24} {'REQUESTS':>9} {'PROMPT':>11} {'CACHED':>11} {'GENERATED':>11} REFUSED"
    print(header)
    for row in [*rows, {**total, "tenant": "total", "model": ""}]:
        refused = ",".join(f"{k}={v}" for k, v in sorted(row["refused"].items())) or "-"
        print(f"{row['tenant'] or '-':<20} {row['model'] or '-':<24} {row['requests']:>9} {row['prompt_tokens']:>11} "
              f"{row['cached_tokens']:>11} {row['generated_tokens']:>11} {refused}")  # fmt: skip
    return 0
