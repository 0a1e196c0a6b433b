"""`mesh-actor handoff bench PEER`: measure a node pair's handoff link and print the break-even per model.

The probing node (`--from`, default this machine's node id as `mesh-actor run` chooses it) sends real
handoffs of throwaway bytes to PEER (`mesh.handoff.<from>.probe`: two sizes, `--rounds` times each); the
fitted line `seconds = fixed + bytes / rate` is printed, journaled as `link_measured` (every router learns
it) and used with each model's measured prefill rates (the nodes' serving reports) and state size for the
break-even of "prefill on FROM, hand off, decode on PEER": the first prompt length from which that path is
strictly faster (`actors.handoff.cost.breakeven`), or `never`; a model whose prefill rate a node has not
measured yet (it has not computed a prompt of 32 tokens or more) is listed as unmeasured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

import msgspec

from actors.handoff import cost
from messages.generate import InstanceLoad, ServingReport
from messages.handoff import MIB, LinkProbe, LinkProbeResult
from messages.runner import InstanceStatus
from messages.subjects import Subjects
from runtime.bus import BadMessage, Bus, BusError, RemoteError, decode_checked
from runtime.cli.common import EXIT_OK, EXIT_USAGE, CliError, add_client_options, connect, emit_json, prefix
from runtime.cli.runner import fetch_instances
from runtime.config import default_node_id

#: How long to listen for the two nodes' serving reports (they come every few seconds and on change).
REPORT_WAIT_S = 6.0


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("handoff", help="KV handoff between nodes")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    bench = verbs.add_parser("bench", help="measure the link to PEER and print the break-even per model")
    bench.add_argument("peer", metavar="PEER", help="the node that would decode (receives the handoffs)")
    bench.add_argument("--from", dest="src", metavar="NODE", help="the node that would prefill (default: this host's)")
    bench.add_argument("--size-mib", type=int, default=64, metavar="MIB", help="the large probe (64 MiB)")
    bench.add_argument("--rounds", type=int, default=2, help="probes of each size (2)")
    bench.add_argument("--timeout", type=float, default=600.0, metavar="S", help="the whole probe (600 s)")
    add_client_options(bench)
    bench.set_defaults(func=cmd_bench)


async def cmd_bench(args: argparse.Namespace) -> int:
    src = args.src or default_node_id()
    if src == args.peer:
        raise CliError("--from and PEER are the same node", EXIT_USAGE)
    try:  # converted, not constructed: a constructor does not check the fields' bounds
        request = msgspec.convert({"peer": args.peer, "bytes": args.size_mib * MIB, "rounds": args.rounds}, LinkProbe)
    except msgspec.ValidationError as exc:
        raise CliError(f"bad probe (PEER, --size-mib 4-4096, --rounds 1-10): {exc}", EXIT_USAGE) from exc
    subjects = Subjects(prefix(args))
    bus = await connect(args, "handoff bench")
    reports: dict[str, ServingReport] = {}
    every = asyncio.Event()
    try:
        listening = asyncio.create_task(_listen(bus, subjects, {src, args.peer}, reports, every))
        started = time.monotonic()
        try:
            link = await bus.request(subjects.handoff(src, "probe"), request, LinkProbeResult, timeout=args.timeout)
        except RemoteError as exc:
            raise CliError(f"node {src}: {exc.reply.code}: {exc.reply.message}") from exc
        except BusError as exc:
            raise CliError(f"node {src}: {exc}") from exc
        finally:
            await _settle(listening, every, started)
        instances = await fetch_instances(bus, subjects)
    finally:
        await bus.close()
    rows = breakevens(src, args.peer, link, reports, instances)
    if args.json:
        emit_json({"link": _link_json(link), "models": rows})
        return EXIT_OK
    print(f"link {src} -> {args.peer}: {link.bytes_per_s / MIB:.1f} MiB/s, {link.fixed_s * 1000:.1f} ms per handoff")
    for size, seconds in link.samples:
        print(f"  {size / MIB:9.2f} MiB in {seconds * 1000:9.1f} ms")
    if not rows:
        print("no model is served by both nodes: no break-even to show")
    for row in rows:
        if row["unmeasured"]:
            print(f"{row['model']}: prefill rate not measured yet on {', '.join(row['unmeasured'])} (serve a prompt)")
            continue
        be = row["breakeven_tokens"]
        print(
            f"{row['model']}: prefill {row['prefill_tokens_per_s']:.0f} tok/s on {src}, "
            f"{row['decode_node_prefill_tokens_per_s']:.0f} tok/s on {args.peer}, "
            f"{row['state_bytes_per_token']:.0f} B/token + {row['state_floor_bytes']:.0f} B: "
            + (f"disaggregate from {be} tokens" if be is not None else "never disaggregate")
        )
    return EXIT_OK


def breakevens(
    src: str,
    dst: str,
    link: LinkProbeResult,
    reports: dict[str, ServingReport],
    instances: list[InstanceStatus],
) -> list[dict[str, Any]]:
    """For each identity both nodes serve with measured prefill rates: the break-even of prefilling on `src`
    and decoding on `dst` over this link."""
    paths = {i.id: i.model_path for i in instances}
    loads = {node: {load.identity: load for load in r.instances if load.identity} for node, r in reports.items()}
    rows = []
    for identity, there in sorted(loads.get(src, {}).items()):
        here: InstanceLoad | None = loads.get(dst, {}).get(identity)
        if here is None:
            continue
        row: dict[str, Any] = {
            "model": paths.get(here.instance_id, here.instance_id),
            "identity": identity,
            "prefill_tokens_per_s": there.prefill_tokens_per_s,
            "decode_node_prefill_tokens_per_s": here.prefill_tokens_per_s,
            "state_bytes_per_token": here.state_bytes_per_token,
            "state_floor_bytes": here.state_floor_bytes,
            "breakeven_tokens": None,
            "unmeasured": [node for node, load in ((src, there), (dst, here)) if load.prefill_tokens_per_s <= 0],
        }
        if not row["unmeasured"]:
            size = cost.StateSize(bytes_per_token=here.state_bytes_per_token, floor_bytes=here.state_floor_bytes)
            rates = cost.Rates(
                local_tokens_per_s=here.prefill_tokens_per_s,
                remote_tokens_per_s=there.prefill_tokens_per_s,
                link_bytes_per_s=link.bytes_per_s,
                fixed_s=link.fixed_s,
            )
            row["breakeven_tokens"] = cost.breakeven(size, rates)
        rows.append(row)
    return rows


async def _listen(
    bus: Bus, subjects: Subjects, nodes: set[str], found: dict[str, ServingReport], every: asyncio.Event
) -> None:
    """Keeps the latest serving report of each of `nodes` in `found` until cancelled; `every` is set once each
    node has reported."""
    sub = await bus.nc.subscribe(subjects.serving_all)
    try:
        async for msg in sub.messages:
            node = msg.subject.rsplit(".", 1)[-1]
            if node not in nodes:
                continue
            try:
                report = decode_checked(msg.data, ServingReport, "serving report")
            except BadMessage:
                continue
            if report.node_id == node:
                found[node] = report
                if set(found) >= nodes:
                    every.set()
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _settle(task: asyncio.Task[None], every: asyncio.Event, started: float) -> None:
    """Waits until every node has reported or `REPORT_WAIT_S` has passed since listening began; stops it."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(every.wait(), max(0.0, started + REPORT_WAIT_S - time.monotonic()))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _link_json(link: LinkProbeResult) -> dict[str, Any]:
    return {
        "src": link.src,
        "dst": link.dst,
        "bytes_per_s": link.bytes_per_s,
        "fixed_s": link.fixed_s,
        "samples": [list(s) for s in link.samples],
    }
