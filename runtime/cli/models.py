"""`mesh-actor models`: the front doors' catalogs, each model with its state, memory and queue.

Read from the `MESH_FRONTDOORS` bucket (each front door's last report; a node that stopped drops out with its
key's TTL). `--json` prints the reports as they are stored. Under each model, the live nodes that hold its file
(each node asked `mesh.files.<node>.held`; a client's credentials may not ask, and then nothing is shown).

`mesh-actor models pull NAME [--node ID] [--from PEER]` asks node ID's files actor (`mesh.files.<id>.pull`) to
fetch the file of catalog model (or registry entry) NAME from a peer that holds it into its models dir, verified
(actors/files/); it exits 0 once the file is there, 1 with the reason when the node refused.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import msgspec
import nats.errors

from actors.files import transfer
from messages.files import FileHeld, HeldRequest, PullReply, PullRequest
from messages.frontdoor import FrontDoorReport
from messages.placement import PreferredSettings
from messages.registry import RegistryEntry
from messages.subjects import Subjects
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.bus import Bus, BusError, RemoteError
from runtime.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    add_client_options,
    client_options,
    connect,
    emit_json,
    prefix,
)
from runtime.creds import CredentialsError, with_creds_file
from runtime.roles import is_client_user
from runtime.sizes import format_size

#: How long `models pull` waits by default (a large file over a slow link takes a while).
PULL_TIMEOUT_S = 6 * 3600.0


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("models", help="the front doors' model catalogs: state, memory and queue of each model")
    add_client_options(p)
    p.set_defaults(func=cmd_models)
    verbs = p.add_subparsers(dest="models_command", metavar="{pull}")
    pull = verbs.add_parser("pull", help="fetch a catalog model's file from a peer into a node's models dir")
    pull.add_argument("name", help="the catalog model (or registry entry) whose file to fetch")
    pull.add_argument("--node", help="the node that fetches it (default: the only live node)")
    pull.add_argument("--from", dest="peer", help="fetch from this node only (default: any live node holding it)")
    pull.add_argument("--timeout", type=float, default=PULL_TIMEOUT_S, help="seconds to wait for the file")
    add_client_options(pull)
    pull.set_defaults(func=cmd_pull)


async def cmd_pull(args: argparse.Namespace) -> int:
    bus = await connect(args, "models pull")
    subjects = Subjects(prefix(args))
    try:
        node = args.node or await _only_node(bus, subjects)
        try:
            reply = await bus.request(
                subjects.files(node, "pull"),
                PullRequest(name=args.name, peer=args.peer),
                PullReply,
                timeout=args.timeout,
            )
        except RemoteError as exc:
            reason = (exc.reply.details or {}).get("reason", exc.code)
            raise CliError(f"node {node} did not pull {args.name} ({reason}): {exc.reply.message}") from exc
        except BusError as exc:
            raise CliError(f"node {node}: {exc}") from exc
    finally:
        await bus.close()
    if args.json:
        emit_json(msgspec.to_builtins(reply))
    elif reply.already:
        print(f"{reply.path} is already on {reply.node_id} ({format_size(reply.size)}, blake3 {reply.blake3[:16]}…)")
    else:
        resumed = f", {format_size(reply.resumed_from)} kept from an interrupted pull" if reply.resumed_from else ""
        print(
            f"{reply.path} pulled to {reply.node_id} from {reply.peer}: {format_size(reply.size)}, "
            f"{format_size(reply.moved_bytes)} moved in {reply.fetch_ms / 1000:.1f}s{resumed}, "
            f"blake3 {reply.blake3[:16]}… verified"
        )
    return EXIT_OK


async def _only_node(bus: Bus, subjects: Subjects) -> str:
    reports, _ = await buckets.read_all(bus, subjects.nodes_bucket, NodeResources)
    nodes = sorted(key for key, _ in reports)
    if len(nodes) != 1:
        raise CliError(f"name the node with --node (live nodes: {', '.join(nodes) or 'none'})", EXIT_USAGE)
    return nodes[0]


async def fetch_frontdoors(bus: Bus, subjects: Subjects) -> list[FrontDoorReport]:
    reports, warnings = await buckets.read_all(bus, subjects.frontdoors_bucket, FrontDoorReport)
    for warning in warnings:
        print(f"mesh-actor: warning: skipping {warning}", file=sys.stderr)
    return [report for _, report in reports]


def asks_nodes(args: argparse.Namespace) -> bool:
    """Whether this command's credentials may ask nodes' files actors (`files.<id>.held`): a client's may not
    (nats-server refuses each request, and each would wait out its deadline), so it asks nothing."""
    try:
        options = with_creds_file(client_options(args))
    except CredentialsError:
        return False
    return not (options.user and is_client_user(options.user))


async def held_answers(
    bus: Bus, subjects: Subjects, paths: set[str], timeout_s: float = 5.0, nodes: list[str] | None = None
) -> list[FileHeld]:
    """What each live node (or each of `nodes`) says of each file (by relative name): the answers of the nodes
    that hold it, asked a few at a time, each under `timeout_s`; a node that does not answer, holds no such
    file or may not be asked is left out. Absolute names are never asked (peers know only relative ones)."""
    if nodes is None:
        reports, _ = await buckets.read_all(bus, subjects.nodes_bucket, NodeResources)
        nodes = sorted(key for key, _ in reports)
    limit = asyncio.Semaphore(16)

    async def ask(node: str, path: str) -> FileHeld | None:
        async with limit:
            try:
                return await bus.request(
                    subjects.files(node, "held"), HeldRequest(path=path), FileHeld, timeout=timeout_s
                )
            except (BusError, nats.errors.Error, msgspec.ValidationError):
                return None

    wanted = [(node, path) for path in sorted(paths) if transfer.check_relative(path) is None for node in nodes]
    return [a for a in await asyncio.gather(*(ask(node, path) for node, path in wanted)) if a is not None]


async def holders(bus: Bus, subjects: Subjects, paths: set[str], timeout_s: float = 5.0) -> dict[str, list[str]]:
    """The live nodes that hold each file (by relative name); see `held_answers`."""
    found: dict[str, list[str]] = {path: [] for path in paths}
    for answer in await held_answers(bus, subjects, paths, timeout_s):
        found[answer.path].append(answer.node_id)
    return found


class ModelFile(msgspec.Struct, frozen=True, kw_only=True):
    """One version of a catalog's or registry entry's file and the live nodes holding it (`status`)."""

    path: str  # relative to each node's models dir
    size: int  # 0 with no holder
    blake3: str  # "" with no holder
    models: tuple[str, ...]  # the catalog models and registry entries naming the path
    nodes: tuple[str, ...]


async def named_files(bus: Bus, subjects: Subjects, doors: list[FrontDoorReport]) -> dict[str, set[str]]:
    """Relative file name -> the names that name it: every front door's catalog model and every registry entry
    (a registry that cannot be read, e.g. with a client's credentials, names nothing)."""
    named: dict[str, set[str]] = {}
    for door in doors:
        for model in door.models:
            named.setdefault(model.path, set()).add(model.name)
    try:
        entries, _ = await buckets.read_all(bus, subjects.registry_bucket, RegistryEntry)
    except (BusError, nats.errors.Error) as exc:
        print(f"mesh-actor: warning: registry entries not read: {exc}", file=sys.stderr)
        entries = []
    for key, entry in entries:
        named.setdefault(entry.file_name, set()).add(key)
    return named


async def model_files(
    bus: Bus, subjects: Subjects, named: dict[str, set[str]], nodes: list[str], timeout_s: float = 5.0
) -> list[ModelFile]:
    """Each version (size, blake3) of each named file that some of `nodes` hold, with its holders, and each
    named file none of them holds (no holders, size and digest unknown). A node answers only for files its own
    catalog or a registry entry it trusts names (actors/files/)."""
    versions: dict[tuple[str, str, int], list[str]] = {}
    for answer in await held_answers(bus, subjects, set(named), timeout_s, nodes):
        versions.setdefault((answer.path, answer.blake3, answer.size), []).append(answer.node_id)
    held = {path for path, _, _ in versions}
    for path in set(named) - held:  # named, but no live node holds it (size and digest unknown)
        versions[(path, "", 0)] = []
    return [
        ModelFile(path=path, size=size, blake3=digest, models=tuple(sorted(named[path])), nodes=tuple(sorted(on)))
        for (path, digest, size), on in sorted(versions.items())
    ]


async def cmd_models(args: argparse.Namespace) -> int:
    subjects = Subjects(prefix(args))
    bus = await connect(args, "models")
    try:
        reports = await fetch_frontdoors(bus, subjects)
        paths = {m.path for r in reports for m in r.models}
        held = await holders(bus, subjects, paths) if not args.json and asks_nodes(args) else {}
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
            if held.get(m.path):
                print(f"  {'':<24} file held on {', '.join(held[m.path])}")
    return EXIT_OK


def _required(settings: PreferredSettings) -> str:
    """The settings a model's instances must run with, as llama-server flags."""
    flags = (("slots", "-np"), ("cache_type_k", "-ctk"), ("cache_type_v", "-ctv"), ("flash_attn", "-fa"),
             ("kv_unified", "-kvu"), ("spec_type", "--spec-type"), ("spec_draft_n_max", "--spec-draft-n-max"),
             ("swa_full", "--swa-full"), ("pooling", "--pooling"))  # fmt: skip
    kind = {"embedding": "--embeddings", "rerank": "--rerank"}.get(settings.kind or "")
    given = [f"{flag} {getattr(settings, name)}" for name, flag in flags if getattr(settings, name) is not None]
    return " ".join([kind, *given] if kind else given)
