"""L3 commands: `mesh-actor l3 ls|stat|verify|gc|evict` (the stores of saved slot states).

`ls` reads every live node's inventory from the `MESH_L3` bucket (`--node` for one). The others act on one
node's store. The store belongs to that node's running L3 actor, so they are requests to it
(`mesh.l3.<node>.stat|verify|gc|evict`); the node is `--node`, or the only node with an inventory. With
`--offline`, no node may run on the data dir: the command takes the data dir's lock (as `mesh-actor run`
does) and works on `DATA_DIR/l3` directly.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import msgspec

from actors.l3 import layout
from actors.l3.store import CorruptEntry, Store, StoreError, UnknownEntry
from messages.l3 import (
    EntryRequest,
    EntryStat,
    EvictReply,
    EvictRequest,
    GcReply,
    GcRequest,
    L3Inventory,
    ManifestList,
    ManifestsRequest,
    VerifyReply,
)
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, BusError, RemoteError
from runtime.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    add_client_options,
    connect,
    data_dir,
    emit_json,
    prefix,
)
from runtime.datadir import DataDirBusy, lock_data_dir
from runtime.sizes import format_size

#: verify re-hashes a whole entry on the node: allow for a large one.
VERIFY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 30.0


def register(sub: argparse._SubParsersAction[Any]) -> None:
    l3 = sub.add_parser("l3", help="the L3 stores of saved slot states: ls, stat, verify, gc, evict")
    verbs = l3.add_subparsers(dest="l3_command", required=True, metavar="VERB", parser_class=type(l3))

    ls = verbs.add_parser("ls", help="entries every live node's store holds (from the MESH_L3 inventories)")
    ls.add_argument("--node", help="only this node")
    add_client_options(ls)
    ls.set_defaults(func=cmd_ls)

    for verb, text in (
        ("stat", "one entry's manifest facts"),
        ("verify", "re-hash an entry (every entry without ENTRY); a corrupt one is quarantined"),
        ("gc", "reconcile the store now: temporary files, bad manifests, orphan segments (--quarantine: and more)"),
        ("evict", "remove an entry (or every entry not in use, with --all)"),
    ):
        parser = verbs.add_parser(verb, help=text)
        if verb in ("stat", "verify", "evict"):
            parser.add_argument("entry", metavar="ENTRY", nargs="?" if verb != "stat" else None, help="entry id")
        if verb == "evict":
            parser.add_argument("--all", action="store_true", help="every entry not in use")
        if verb == "gc":
            parser.add_argument(
                "--quarantine",
                action="store_true",
                help="first delete every quarantined manifest, so the segments only they named are collected "
                "(the store deletes them by itself after a day, or after 10 minutes once it needs the room; an "
                "unreadable one blocks eviction until then)",
            )
        parser.add_argument("--node", help="the node whose store (default: the only node with an L3 inventory)")
        parser.add_argument(
            "--offline", action="store_true", help="no node runs on --data-dir: work on its store directly"
        )
        add_client_options(parser)
        parser.set_defaults(func=cmd_admin)


# --- ls ------------------------------------------------------------------------------------------------------


async def _inventories(bus: Bus, subjects: Subjects) -> list[L3Inventory]:
    found, warnings = await buckets.read_all(bus, subjects.l3_bucket, L3Inventory)
    for warning in warnings:
        print(f"mesh-actor: warning: skipping {warning}", file=sys.stderr)
    return [inventory for key, inventory in found if key == inventory.node_id]


async def read_inventories(args: argparse.Namespace) -> list[L3Inventory]:
    """The live nodes' L3 inventories (`--node`: that node's alone), as `l3 ls` reads them."""
    subjects = Subjects(prefix(args))
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        bus = await connect(args, "l3 ls")
        try:
            return [i for i in await _inventories(bus, subjects) if args.node in (None, i.node_id)]
        finally:
            await bus.close()


def ls_rows(inventories: list[L3Inventory]) -> list[dict[str, Any]]:
    """What `l3 ls --json` prints: one row per entry a node holds."""
    return [
        {
            "node": inv.node_id,
            "entry": item.entry,
            "identity": item.identity,
            "tokens": item.n_tokens,
            "bytes": item.bytes,
        }
        for inv in inventories
        for item in inv.items
    ]


async def cmd_ls(args: argparse.Namespace) -> int:
    inventories = await read_inventories(args)
    rows = ls_rows(inventories)
    if args.json:
        emit_json(rows)
        return EXIT_OK
    if not rows:
        print("no L3 entries" + (f" on node {args.node}" if args.node else ""))
    else:
        print(f"{'NODE':<16} {'ENTRY':<18} {'IDENTITY':<18} {'TOKENS':>8} {'BYTES':>11}")
    for row in rows:
        print(
            f"{row['node']:<16} {row['entry'][:16]:<18} {row['identity'][:16]:<18} {row['tokens']:>8} "
            f"{format_size(row['bytes']):>11}"
        )
    for inv in inventories:
        if inv.truncated:
            print(f"(node {inv.node_id} holds {inv.entries} entries; its inventory lists the {len(inv.items)} newest)")
    return EXIT_OK


def l3_totals(inventories: list[L3Inventory]) -> dict[str, dict[str, int]]:
    """Per node: entries, tokens, bytes, budget (what `mesh-actor status` shows)."""
    return {
        i.node_id: {"entries": i.entries, "tokens": i.tokens, "bytes": i.bytes, "budget_bytes": i.budget_bytes}
        for i in inventories
    }


async def fetch_l3_totals(bus: Bus, subjects: Subjects) -> dict[str, dict[str, int]]:
    return l3_totals(await _inventories(bus, subjects))


# --- stat, verify, gc, evict ---------------------------------------------------------------------------------


def _entry_arg(args: argparse.Namespace) -> str | None:
    entry = getattr(args, "entry", None)
    if entry is not None and not layout.is_digest(entry):
        raise CliError(f"{entry[:80]!r} is not an entry id (64 lowercase hex characters)", EXIT_USAGE)
    return entry


async def cmd_admin(args: argparse.Namespace) -> int:
    entry = _entry_arg(args)
    verb = args.l3_command
    if verb == "evict" and (entry is None) == (not args.all):
        raise CliError("name one ENTRY, or --all", EXIT_USAGE)
    if args.offline:
        results = await asyncio.to_thread(
            _offline, verb, data_dir(args), entry, getattr(args, "all", False), getattr(args, "quarantine", False)
        )
    else:
        results = await _over_bus(args, verb, entry)
    ok = all(r.get("ok", True) for r in results)
    if args.json:
        emit_json(results if verb == "verify" else results[0])
    else:
        for result in results:
            print(" ".join(f"{k}={v}" for k, v in result.items()))
    return EXIT_OK if ok else EXIT_FAILURE


async def _over_bus(args: argparse.Namespace, verb: str, entry: str | None) -> list[dict[str, Any]]:
    subjects = Subjects(prefix(args))
    bus = await connect(args, f"l3 {verb}")
    try:
        node = args.node or await _only_node(bus, subjects)
        subject = subjects.l3(node, verb)
        try:
            if verb == "stat":
                assert entry is not None
                stat = await bus.request(subject, EntryRequest(entry=entry), EntryStat, timeout=REQUEST_TIMEOUT_S)
                return [msgspec.to_builtins(stat)]
            if verb == "verify":
                entries = [entry] if entry else await _entries(bus, subjects, node)
                replies = []
                for one in entries:
                    reply = await bus.request(subject, EntryRequest(entry=one), VerifyReply, timeout=VERIFY_TIMEOUT_S)
                    replies.append(msgspec.to_builtins(reply))
                return replies
            if verb == "gc":
                gc = await bus.request(
                    subject, GcRequest(quarantine=args.quarantine), GcReply, timeout=REQUEST_TIMEOUT_S
                )
                return [msgspec.to_builtins(gc)]
            evicted = await bus.request(
                subject, EvictRequest(entry=entry, all=args.all), EvictReply, timeout=REQUEST_TIMEOUT_S
            )
            return [msgspec.to_builtins(evicted)]
        except RemoteError as exc:
            raise CliError(f"node {node}: {exc.code}: {exc.reply.message}") from exc
        except BusError as exc:
            raise CliError(f"node {node}: {exc}") from exc
    finally:
        await bus.close()


async def _only_node(bus: Bus, subjects: Subjects) -> str:
    nodes = sorted(i.node_id for i in await _inventories(bus, subjects))
    if len(nodes) != 1:
        listed = ", ".join(nodes) or "none"
        raise CliError(f"name the node with --node (nodes with an L3 inventory: {listed})", EXIT_USAGE)
    return nodes[0]


async def _entries(bus: Bus, subjects: Subjects, node: str) -> list[str]:
    listing = await bus.request(
        subjects.l3(node, "manifests"), ManifestsRequest(limit=10_000), ManifestList, timeout=REQUEST_TIMEOUT_S
    )
    return [item.entry for item in listing.items]


def _offline(
    verb: str, directory: Path, entry: str | None, every: bool, quarantine: bool = False
) -> list[dict[str, Any]]:
    """The same verbs on `DATA_DIR/l3` while no node runs there (its lock held meanwhile)."""
    if not (directory / "l3").is_dir():
        raise CliError(f"{directory} has no L3 store")
    try:
        lock = lock_data_dir(directory)
    except DataDirBusy as exc:
        raise CliError(f"{exc}; drop --offline to ask the running node") from exc
    try:
        store = Store(directory / "l3")
        store.clear_incoming()  # no node runs: nothing is being fetched
        reclaimed = store.clear_quarantine()[0] if verb == "gc" and quarantine else 0
        inventory = store.reconcile()
        node = "offline"
        if verb == "gc":
            moved = [q.name for q in inventory.quarantined if q.reason != "found in quarantine"]
            return [
                {
                    "node_id": node,
                    "entries": len(inventory.entries),
                    "bytes": inventory.bytes,
                    "removed_temp": inventory.removed_temp,
                    "removed_orphans": inventory.removed_orphans,
                    "quarantined": moved,
                    "gc_suspended": inventory.gc_suspended,
                    "reclaimed_quarantine": reclaimed,
                }
            ]
        held = {e.entry: e for e in inventory.entries}
        if entry is not None and entry not in held:
            raise CliError(f"no entry {entry} in {directory / 'l3'}")
        if verb == "stat":
            assert entry is not None
            m = store.load_manifest(entry)
            return [
                {
                    "node_id": node,
                    "entry": entry,
                    "identity": m.identity,
                    "n_tokens": m.n_tokens,
                    "bytes": m.total_bytes,
                    "payload_kind": m.payload_kind,
                    "payload_digest": m.payload_digest,
                    "segments": len(m.segments),
                    "last_use": held[entry].mtime_ns / 1e9,
                    "pinned": False,
                }
            ]
        if verb == "verify":
            results = []
            for one in [entry] if entry else sorted(held):
                try:
                    store.verify(store.load_manifest(one))
                    results.append({"node_id": node, "entry": one, "ok": True, "detail": ""})
                except (CorruptEntry, UnknownEntry, StoreError) as exc:
                    results.append({"node_id": node, "entry": one, "ok": False, "detail": str(exc)})
            return results
        chosen = [entry] if entry else sorted(held)
        before = inventory.bytes
        store.remove_entries(chosen)
        after = store.reconcile()  # collects the segments nothing names now (none while gc is suspended)
        return [{"node_id": node, "evicted": chosen, "freed_bytes": before - after.bytes, "pinned": []}]
    finally:
        lock.close()
