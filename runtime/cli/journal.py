"""Journal commands: `events` reads (or follows) the event stream.

Events are shown as stored, decoded as JSON without a schema, so events of a newer producer still show.
`--json` prints one object per line: `{"seq", "subject", "time", "event"}`.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.errors
from nats.js.errors import NotFoundError

from messages.subjects import Subjects
from runtime.bus import Bus
from runtime.cli.common import EXIT_USAGE, CliError, add_client_options, connect, emit_json, prefix, refuse_client
from runtime.direct_get import DirectGetFailed, follow_stored, read_stored

_RELATIVE = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def register(sub: argparse._SubParsersAction[Any]) -> None:
    events = sub.add_parser("events", help="read the event journal")
    add_client_options(events)
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    events.add_argument(
        "--subject",
        metavar="PATTERN",
        help="subject filter, e.g. 'runner.>' or 'placement.placement_decided' (relative to <prefix>.events.; "
        "events are <actor>.<type>.<node>) or a full subject",
    )
    events.add_argument("--since", metavar="SEQ|TIME", help="a stream sequence, an ISO time, or an age like 10m")
    events.add_argument(
        "--usage",
        action="store_true",
        help="the tenants' usage journal (request_usage; `--subject` relative to <prefix>.usage.), which the mesh's "
        "credentials read and a client's do not",
    )
    events.add_argument(
        "--trace", metavar="TRACE", type=_trace_id,
        help="only the events of one trace: its trace id (32 hex digits) or a traceparent of it",
    )  # fmt: skip
    events.set_defaults(func=cmd_events)


def _trace_id(text: str) -> str:
    """The trace id a `--trace` value names: 32 lowercase hex digits, alone or inside a traceparent."""
    value = text.strip().lower()
    candidate = value.split("-")[1] if value.count("-") == 3 else value
    if len(candidate) != 32 or any(c not in "0123456789abcdef" for c in candidate) or not int(candidate, 16):
        raise argparse.ArgumentTypeError(f"{text!r} is not a trace id (32 hex digits) or a traceparent")
    return candidate


def _in_trace(event: Any, trace_id: str) -> bool:
    trace = event.get("trace") if isinstance(event, dict) else None
    return isinstance(trace, str) and trace.count("-") == 3 and trace.split("-")[1] == trace_id


def parse_since(text: str, now: datetime) -> tuple[int | None, datetime | None]:
    """A sequence number, an ISO-8601 time, or a relative age (`90s`, `10m`, `2h`, `1d`)."""
    if text.isdigit():
        return int(text), None
    match = _RELATIVE.match(text)
    if match:
        return None, now - timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise CliError(f"--since {text!r}: use a sequence number, an ISO time or an age like 10m", EXIT_USAGE) from exc
    return None, when if when.tzinfo else when.replace(tzinfo=UTC)


def _filter(subjects: Subjects, pattern: str | None, *, private: bool = False) -> str:
    if not pattern:
        return subjects.usage_all if private else subjects.events_all
    root = f"{subjects.prefix}.usage" if private else f"{subjects.prefix}.events"
    full = pattern if pattern == root or pattern.startswith(root + ".") else f"{root}.{pattern}"
    tokens = full.removeprefix(root + ".").split(".")
    if len(tokens) == 2 and tokens[-1] != ">":  # <actor>.<type>: from any node (the subject's last token)
        full += ".*"
    return full


def _render(seq: int, subject: str, stamp: datetime, data: bytes) -> dict[str, Any]:
    try:
        event: Any = json.loads(data)
    except ValueError:
        event = {"unparsable": data.decode(errors="replace")}
    return {"seq": seq, "subject": subject, "time": stamp.isoformat(), "event": event}


def _summary(event: Any) -> str:
    """One line per event: its node and type, then its scalar fields (nested records are left to --json)."""
    if not isinstance(event, dict):
        return str(event)
    skip = {"id", "time", "node", "actor", "type", "trace"}
    parts = [f"{k}={v}" for k, v in event.items() if k not in skip and not isinstance(v, dict | list)]
    decision = event.get("decision")
    if isinstance(decision, dict):  # placement_decided: the verdict, not the whole record
        model = decision.get("model") or {}
        verdict = "admitted" if decision.get("admitted") else f"refused ({decision.get('reason')})"
        parts = [f"{model.get('path') or model.get('registry')} {verdict} ctx={decision.get('ctx')}", *parts]
    return f"{event.get('node', '?')} {event.get('type', '?')} " + " ".join(parts)


def _start(since: str | None) -> tuple[int, datetime | None]:
    """Where reading starts: a stream sequence, or a time (then the sequence is unused)."""
    if not since:
        return 1, None
    seq, when = parse_since(since, datetime.now(UTC))
    return (max(1, seq), None) if seq is not None else (1, when)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    seq: int
    subject: str
    time: datetime
    data: bytes


async def read_events(
    bus: Bus, subjects: Subjects, pattern: str | None, *, since: str | None, follow: bool, private: bool = False
) -> AsyncIterator[StoredEvent]:
    """Stored events matching `pattern`, oldest first; without `follow`, stops once caught up. `private`: the
    usage stream's (`Event.PRIVATE`), which no client reads.

    Read with direct gets (`runtime.direct_get`), never a consumer: a client's account has no consumer API."""
    start_seq, start_time = _start(since)
    stream = subjects.usage_stream if private else subjects.events_stream
    try:
        info = await bus.js.stream_info(stream)
    except NotFoundError as exc:
        raise CliError(f"no journal: stream {stream} does not exist yet") from exc
    except nats.errors.Error as exc:  # the usage stream asked with a client's credentials: its account has no route
        raise CliError(f"stream {stream} cannot be read with these credentials: {exc!r}") from exc
    if info.state.messages == 0 and not follow:
        return
    read = follow_stored if follow else read_stored
    try:
        async for stored in read(
            bus, stream, _filter(subjects, pattern, private=private), start_seq=start_seq, start_time=start_time
        ):
            yield StoredEvent(stored.seq, stored.subject, stored.time, stored.data)
    except DirectGetFailed as exc:
        raise CliError(f"{exc} (the journal needs allow_direct: a node started with admin rights sets it)") from exc


async def event_rows(args: argparse.Namespace) -> AsyncIterator[dict[str, Any]]:
    """The rows `events` prints (`--json`'s records), as its arguments select them."""
    subjects = Subjects(prefix(args))
    if args.usage:
        refuse_client(args, "the tenants' usage")
    bus = await connect(args, "events")
    try:
        async for stored in read_events(
            bus, subjects, args.subject, since=args.since, follow=args.follow, private=args.usage
        ):
            row = _render(stored.seq, stored.subject, stored.time, stored.data)
            if args.trace is None or _in_trace(row["event"], args.trace):
                yield row
    finally:
        await bus.close()


async def cmd_events(args: argparse.Namespace) -> int:
    async for row in event_rows(args):
        if args.json:
            emit_json(row)
        else:
            print(f"{row['seq']:>8} {row['time'][:23]} {_summary(row['event'])}", flush=True)
    return 0
