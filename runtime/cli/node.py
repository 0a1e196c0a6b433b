"""Node commands: `run` (the node launcher), `status` (live nodes), `nats-env` (how to connect).

`status` shows the live nodes, instances, reservations, front doors and model files: each version of every file
a front door's catalog or a registry entry names, and the live nodes that hold it (each asked
`mesh.files.<node>.held`, as `models` does; a client's credentials may not ask, so none are shown to a client).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any, get_args

import msgspec

from actors.placement.registry import RegistryUntrusted, check_public_key
from messages.frontdoor import FrontDoorReport
from messages.placement import NodeLedger, Reservation
from messages.runner import InstanceStatus
from messages.settings import CacheType
from messages.subjects import Subjects
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.allocator import keep_large_buffers
from runtime.bus import BusError
from runtime.cli.common import (
    EXIT_USAGE,
    CliError,
    add_client_options,
    add_data_dir,
    add_nats_options,
    client_options,
    connect,
    connection_record,
    emit_json,
    prefix,
    write_nats_context,
)
from runtime.cli.l3 import fetch_l3_totals
from runtime.cli.models import ModelFile, asks_nodes, fetch_frontdoors, model_files, named_files
from runtime.cli.runner import fetch_instances
from runtime.config import ConfigError, NodeConfig, load_config
from runtime.datadir import DataDirBusy
from runtime.embedded import EmbeddedNatsError
from runtime.logging import configure_logging
from runtime.otlp import OtlpUnavailable
from runtime.roles import Role, inbox_prefix, permissions
from runtime.sizes import format_size

CACHE_TYPES = get_args(CacheType)


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """llama-server's own flags for the settings that change allocation (what this node advertises)."""
    group = parser.add_argument_group("serving settings (advertised by this node, pinned on llama-server)")
    group.add_argument("-np", "--parallel", dest="slots", type=int, metavar="N", help="server slots")
    group.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true", default=None)
    group.add_argument("--no-kv-unified", dest="kv_unified", action="store_false")
    group.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", choices=CACHE_TYPES)
    group.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", choices=CACHE_TYPES)
    group.add_argument("-fa", "--flash-attn", dest="flash_attn", choices=("on", "off"))
    group.add_argument("-b", "--batch-size", dest="batch", type=int, metavar="N")
    group.add_argument("-ub", "--ubatch-size", dest="ubatch", type=int, metavar="N")
    group.add_argument("--swa-full", dest="swa_full", action="store_true", default=None)
    group.add_argument("--no-swa-full", dest="swa_full", action="store_false", help="window-sized SWA cache")
    group.add_argument("--spec-type", dest="spec_type", metavar="TYPE")
    group.add_argument("--spec-draft-n-max", dest="spec_draft_n_max", type=int, metavar="N")
    group.add_argument("-ctkd", "--spec-draft-type-k", dest="spec_draft_type_k", choices=CACHE_TYPES)
    group.add_argument("-ctvd", "--spec-draft-type-v", dest="spec_draft_type_v", choices=CACHE_TYPES)
    group.add_argument("--ctx-checkpoints", dest="ctx_checkpoints", type=int, metavar="N")
    group.add_argument("--cache-ram", dest="cache_ram_mib", type=int, metavar="MiB")
    group.add_argument("-t", "--threads", dest="threads", type=int, metavar="N", help="CPU threads (0: all cores)")
    bounds = parser.add_argument_group("bounds of a model's own settings (default: whatever llama-server accepts)")
    bounds.add_argument("--max-slots", dest="bound_max_slots", type=int, metavar="N", help="most slots a model may ask")
    bounds.add_argument("--allow-cache-types", dest="bound_cache_types", metavar="LIST", help="e.g. f16,q8_0")
    bounds.add_argument("--allow-flash-attn", dest="bound_flash_attn", metavar="LIST", help="on, off or on,off")
    bounds.add_argument(
        "--allow-spec-types", dest="bound_spec_types", metavar="LIST", help="e.g. draft-mtp,ngram-simple"
    )
    bounds.add_argument(
        "--allow-kinds", dest="bound_kinds", metavar="LIST", help="what servers are for: generate,embedding,rerank"
    )


SERVING_DESTS = (
    "slots",
    "kv_unified",
    "cache_type_k",
    "cache_type_v",
    "flash_attn",
    "batch",
    "ubatch",
    "swa_full",
    "spec_type",
    "spec_draft_n_max",
    "spec_draft_type_k",
    "spec_draft_type_v",
    "ctx_checkpoints",
    "cache_ram_mib",
    "threads",
)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    run = sub.add_parser("run", help="run this node: embedded NATS (unless --nats) and its actors")
    add_data_dir(run)
    add_nats_options(run)
    run.add_argument("--node-id", help="this node's id (default: the host name)")
    run.add_argument("--memory-limit", metavar="SIZE", help="cap on what each device advertises as usable")
    run.add_argument("--nats-port", type=int, help="preferred port of the embedded server (default 4222)")
    run.add_argument(
        "--nats-listen",
        metavar="HOST[:PORT]",
        help="where the embedded server listens (default loopback); beyond loopback it requires TLS and credentials",
    )
    run.add_argument(
        "--cluster-listen",
        metavar="HOST:PORT",
        help="join the embedded server to a NATS cluster: where it takes routes from the other nodes' servers",
    )
    run.add_argument(
        "--join",
        action="append",
        metavar="HOST:PORT",
        help="another node's --cluster-listen address (repeatable; this node's own may be listed too)",
    )
    run.add_argument(
        "--cluster-secret-file",
        metavar="FILE",
        help="the route secret all nodes of the cluster share (required beyond loopback; or MESH_ACTOR_CLUSTER_SECRET)",
    )
    run.add_argument("--telemetry-interval", type=float, metavar="S", help="seconds between reports (default 5)")
    run.add_argument("--telemetry-ttl", type=float, metavar="S", help="seconds a report stays valid (default 15)")
    run.add_argument("--llama-server", metavar="PATH", help="llama-server binary (default: the llama extra's)")
    run.add_argument(
        "--models-dir", metavar="DIR", help="where relative model paths are found (default DATA_DIR/models)"
    )
    run.add_argument(
        "--model-root",
        action="append",
        metavar="DIR",
        help="another directory model files may be in (repeatable); placement refuses a model outside them and "
        "the models dir",
    )
    run.add_argument(
        "--max-hold",
        type=float,
        metavar="S",
        help="the longest a placement request may hold memory unclaimed (default 3600; longer: hold_too_long)",
    )
    run.add_argument(
        "--client-share",
        type=float,
        metavar="FRACTION",
        help="of each node's devices, what one client may hold booked at once (default 0.5; more: over_client_share)",
    )
    run.add_argument(
        "--clients-share",
        type=float,
        metavar="FRACTION",
        help="of each node's devices, what every client together may hold booked at once (default 0.5)",
    )
    run.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    run.add_argument(
        "--l3-budget",
        metavar="SIZE",
        help="disk the L3 store of saved slot states may use (0: no capture; default: a capped share of the disk)",
    )
    run.add_argument(
        "--http", metavar="[HOST:]PORT", help="serve the OpenAI-compatible front door there (HOST default: loopback)"
    )
    run.add_argument(
        "--metrics", metavar="[HOST:]PORT",
        help="serve the node's Prometheus metrics (GET /metrics) there too (HOST default: loopback; the front door "
        "serves them on --http)",
    )  # fmt: skip
    run.add_argument(
        "--api-key-file", metavar="FILE",
        help="file whose first line is the key the front door and --metrics require (needed beyond loopback; or "
        "MESH_ACTOR_API_KEY)",
    )  # fmt: skip
    run.add_argument(
        "--health-probe-interval",
        type=float,
        metavar="S",
        help="probe a ready, idle llama-server with a one-token completion after S seconds without a successful "
        "one (default 30)",
    )
    run.add_argument(
        "--health-probe-timeout", type=float, metavar="S", help="a probe's deadline in seconds (default 30)"
    )
    # For comparisons (benchmarks/frontdoor_swap.py): the front door serves requests in arrival order, one swap
    # per change of model, instead of grouping a model's requests while a swap is pending.
    run.add_argument(
        "--no-frontdoor-grouping", dest="frontdoor_grouping", action="store_false", default=None,
        help=argparse.SUPPRESS,
    )  # fmt: skip
    run.add_argument(
        "--no-lend", dest="lend", action="store_false", default=None,
        help="lend none of this node's memory to other nodes' split instances (llama.cpp RPC)",
    )  # fmt: skip
    run.add_argument(
        "--lend-host", metavar="HOST",
        help="the address other nodes reach this node's split lending on (default: the --cluster-listen host)",
    )  # fmt: skip
    run.add_argument(
        "--no-direct-path", dest="direct_path", action="store_false", default=None,
        help="move model files, L3 segments and handoffs over NATS only, as to a firewalled peer (default: on a "
        "direct stream beside the bus; docs/datapath.md)",
    )  # fmt: skip
    run.add_argument(
        "--otlp", metavar="URL",
        help="export each request's hops as OpenTelemetry spans to this OTLP/HTTP collector (e.g. "
        "http://127.0.0.1:4318; needs the otlp extra)",
    )  # fmt: skip
    run.add_argument(
        "--no-metrics", dest="metrics_on", action="store_false", default=None,
        help="fold and serve no metrics (no GET /metrics on the front door; --metrics is refused)",
    )  # fmt: skip
    # For comparisons (benchmarks/observability_overhead.py): requests carry no trace context and events none.
    run.add_argument("--no-trace", dest="trace_on", action="store_false", default=None, help=argparse.SUPPRESS)
    run.add_argument("--json", action="store_true", help="print the ready line as one JSON object")
    run.add_argument(
        "--registry-key",
        action="append",
        metavar="PUBKEY",
        help="trust model registry entries signed by this nkey public key (repeatable)",
    )
    add_serving_flags(run)
    run.set_defaults(func=cmd_run)

    status = sub.add_parser("status", help="live nodes with their resources and telemetry age")
    add_client_options(status)
    status.set_defaults(func=cmd_status)

    env = sub.add_parser("nats-env", help="how any NATS client connects to this mesh")
    add_client_options(env)
    env.add_argument("--creds", dest="nats_creds", metavar="FILE", help="a file from `mesh-actor creds issue`")
    env.add_argument(
        "--role", metavar="ROLE", help="say how a client of ROLE (client, node:<id>, admin) connects, and its rights"
    )
    env.add_argument(
        "--context", metavar="NAME", help="also save it as the `nats` CLI context NAME (inbox prefix included)"
    )
    env.set_defaults(func=cmd_nats_env)


async def cmd_run(args: argparse.Namespace) -> int:
    # Imported here, not above: the launcher imports every actor (half a second), which only `run` needs; the
    # client commands of this module (`status`, `nats-env`, `stop`) start without it.
    from runtime.launcher import JetStreamUnavailable, StartupInterrupted, load_catalog, run_node

    flags = {
        "data_dir": args.data_dir,
        "node_id": args.node_id,
        "memory_limit": args.memory_limit,
        "nats_port": args.nats_port,
        "nats_listen": args.nats_listen,
        "cluster_listen": args.cluster_listen,
        "join": ",".join(args.join) if args.join else None,
        "cluster_secret_file": args.cluster_secret_file,
        "telemetry_interval": args.telemetry_interval,
        "telemetry_ttl": args.telemetry_ttl,
        "llama_server": args.llama_server,
        "models_dir": args.models_dir,
        "model_roots": ",".join(args.model_root) if args.model_root else None,
        "registry_keys": ",".join(args.registry_key) if args.registry_key else None,
        "log_level": args.log_level,
        "l3_budget": args.l3_budget,
        "http": args.http,
        "metrics": args.metrics,
        "api_key_file": args.api_key_file,
        "health_probe_interval": args.health_probe_interval,
        "health_probe_timeout": args.health_probe_timeout,
        "frontdoor_grouping": args.frontdoor_grouping,
        "otlp": args.otlp,
        "metrics_on": args.metrics_on,
        "trace_on": args.trace_on,
        "max_hold": args.max_hold,
        "client_share": args.client_share,
        "clients_share": args.clients_share,
        "lend": args.lend,
        "lend_host": args.lend_host,
        "direct_path": args.direct_path,
        "prefix": args.prefix,
        "nats": ",".join(args.nats) if args.nats else None,
        "nats_user": args.nats_user,
        "nats_password_file": args.nats_password_file,
        "nats_token": args.nats_token,
        "nats_creds": args.nats_creds,
        "nats_tls_ca": args.nats_tls_ca,
        "nats_tls_cert": args.nats_tls_cert,
        "nats_tls_key": args.nats_tls_key,
    }
    serving = {name: getattr(args, name) for name in SERVING_DESTS}
    named = ("max_slots", "cache_types", "flash_attn", "spec_types", "kinds")
    bounds = {name: getattr(args, f"bound_{name}") for name in named}
    try:
        config = load_config(flags, os.environ, serving, bounds)
        for key in config.registry_keys:
            check_public_key(key)
        if config.http is not None:
            load_catalog(config.data_dir)  # a bad models.toml stops the node here, with exit code 2
    except (ConfigError, RegistryUntrusted) as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    configure_logging(config.log_level)
    keep_large_buffers()  # this process owns its allocator: KV buffers are reused, not remapped

    def announce(line: str) -> None:
        if args.json:
            emit_json({"ready": True, "node_id": config.node_id, "data_dir": str(config.data_dir), "message": line})
        else:
            print(line, flush=True)

    def reload_settings() -> NodeConfig:
        return load_config(flags, os.environ, serving, bounds)

    try:
        return await run_node(config, announce=announce, reload_settings=reload_settings, handle_signals=True)
    except StartupInterrupted:
        return 130
    except OtlpUnavailable as exc:  # --otlp without the extra: said before anything starts
        raise CliError(str(exc), EXIT_USAGE) from exc
    except (DataDirBusy, EmbeddedNatsError, JetStreamUnavailable, BusError, OSError) as exc:
        raise CliError(str(exc)) from exc


class Status(msgspec.Struct, frozen=True, kw_only=True):
    """What `status` reads of the mesh."""

    nodes: list[NodeResources]
    instances: list[InstanceStatus]
    reservations: list[Reservation]
    l3: dict[str, dict[str, int]]
    doors: list[FrontDoorReport]
    files: list[ModelFile]


async def read_status(args: argparse.Namespace) -> Status:
    subjects = Subjects(prefix(args))
    bus = await connect(args, "status")
    try:
        nodes, warnings = await buckets.read_all(bus, subjects.nodes_bucket, NodeResources)
        ledgers, more = await buckets.read_all(bus, subjects.reservations_bucket, NodeLedger)
        instances = await fetch_instances(bus, subjects)
        l3 = await fetch_l3_totals(bus, subjects)
        doors = await fetch_frontdoors(bus, subjects)
        files: list[ModelFile] = []
        if asks_nodes(args):  # a client may not ask nodes what they hold
            named = await named_files(bus, subjects, doors)
            files = await model_files(bus, subjects, named, sorted(key for key, _ in nodes))
    finally:
        await bus.close()
    for warning in warnings + more:
        print(f"mesh-actor: warning: skipping {warning}", file=sys.stderr)
    reservations = [r for _, ledger in ledgers for r in ledger.reservations]
    return Status(
        nodes=[node for _, node in nodes],
        instances=instances,
        reservations=reservations,
        l3=l3,
        doors=doors,
        files=files,
    )


def status_record(status: Status, now: float) -> dict[str, Any]:
    """`status --json`'s record: each node with its report's age and its store's totals, then the rest."""
    return {
        "nodes": [
            {
                **msgspec.to_builtins(node),
                "age_s": round(max(0.0, now - node.sent_at), 3),
                "l3": status.l3.get(node.node_id),
            }
            for node in status.nodes
        ],
        "instances": [msgspec.to_builtins(i) for i in status.instances],
        "reservations": [msgspec.to_builtins(r) for r in status.reservations],
        "frontdoors": [msgspec.to_builtins(d) for d in status.doors],
        "model_files": [msgspec.to_builtins(f) for f in status.files],
    }


async def cmd_status(args: argparse.Namespace) -> int:
    async with asyncio.timeout(30):
        status = await read_status(args)
    nodes, instances, reservations, l3, doors = (
        status.nodes,
        status.instances,
        status.reservations,
        status.l3,
        status.doors,
    )
    now = time.time()
    if args.json:
        emit_json(status_record(status, now))
        return 0
    if not nodes:
        print("no live nodes")
    else:
        print(
            f"{'NODE':<20} {'AGE':>6} {'CPUS':>4} {'RAM USABLE':>12} {'GPUS':<28} {'LLAMA-SERVER':<24} "
            f"{'L3 (ENTRIES/TOKENS/USED/BUDGET)':<36} SETTINGS"
        )
    for node in nodes:
        gpus = ", ".join(f"{g.index}:{format_size(g.usable_bytes)}" for g in node.gpus) or "-"
        engine = node.llama_server.version[:24] if node.llama_server else "(none)"
        settings = (
            f"np={node.settings.slots} kvu={int(node.settings.kv_unified)} "
            f"ctk={node.settings.cache_type_k} ctv={node.settings.cache_type_v} fa={node.settings.flash_attn} "
            f"spec={node.settings.spec_type}"
            if node.settings
            else "(not advertised)"
        )
        age = f"{max(0.0, now - node.sent_at):.1f}s"
        usable = format_size(node.host.usable_bytes)
        held = l3.get(node.node_id)
        store = (
            f"{held['entries']}/{held['tokens']}/{format_size(held['bytes'])}/{format_size(held['budget_bytes'])}"
            if held
            else "-"
        )
        print(
            f"{node.node_id:<20} {age:>6} {node.host.cpu_count:>4} {usable:>12} {gpus:<28} {engine:<24} "
            f"{store:<36} {settings}"
        )
    if instances:
        print(f"\n{'INSTANCE':<18} {'NODE':<14} {'STATE':<10} {'PORT':>6} {'PREDICTED':>11} {'OBSERVED':>11} MODEL")
    for inst in instances:
        observed = format_size(inst.observed_memory.total_bytes) if inst.observed_memory else "-"
        predicted = format_size(inst.predicted_memory.total_bytes)
        split = f" (split: {inst.node} + {', '.join(inst.members)})" if inst.members else ""
        print(
            f"{inst.id:<18} {inst.node:<14} {inst.state:<10} {inst.port or '-':>6} {predicted:>11} {observed:>11} "
            f"{inst.model_path}{split}"
        )
    if reservations:
        print(f"\n{'RESERVATION':<18} {'NODE':<14} {'STATE':<10} {'HELD':>11} EXPIRES")
    for r in reservations:
        expires = f"in {max(0.0, r.expires_at - now):.0f}s" if r.expires_at is not None else "-"
        print(f"{r.reservation_id:<18} {r.node_id:<14} {r.state:<10} {format_size(sum(r.held.values())):>11} {expires}")
    if doors:
        print(f"\n{'FRONT DOOR':<18} {'NODE':<14} {'MODELS':>6} {'READY':>5} {'QUEUED':>6} ADDRESS")
    for d in doors:
        ready = sum(m.state == "ready" for m in d.models)
        queued = sum(m.queued for m in d.models)
        print(f"{'openai':<18} {d.node_id:<14} {len(d.models):>6} {ready:>5} {queued:>6} {d.address}/v1")
    if status.files:
        print(f"\n{'MODEL FILE':<32} {'SIZE':>10} {'BLAKE3':<17} {'MODELS':<24} HELD ON")
    for f in status.files:
        models = ", ".join(f.models)
        size, digest = (format_size(f.size), f.blake3[:16] + "…") if f.nodes else ("-", "-")
        print(f"{f.path:<32} {size:>10} {digest:<17} {models:<24} {', '.join(f.nodes) or '(no live node)'}")
    return 0


def cmd_nats_env(args: argparse.Namespace) -> int:
    if args.role:
        return _role_env(args)
    record = connection_record(client_options(args))
    if args.context:
        path = write_nats_context(args.context, record, dict(os.environ))
        print(f"saved the nats context {args.context} to {path}: nats --context {args.context} …", file=sys.stderr)
    if args.json:
        emit_json(record)
        return 0
    names = {"url": "NATS_URL", "user": "NATS_USER", "password": "NATS_PASSWORD", "token": "NATS_TOKEN"}
    names.update(creds="NATS_CREDS", tls_ca="NATS_CA", tls_cert="NATS_CERT", tls_key="NATS_KEY")
    names.update(inbox_prefix="NATS_INBOX_PREFIX")
    for key, value in record.items():
        print(f"{names[key]}={value}")
    return 0


def _role_env(args: argparse.Namespace) -> int:
    """How a client of a role connects: the credentials to ask for, its inbox, what nats-server lets it do."""
    try:
        role = Role.parse(args.role)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    subjects = Subjects(prefix(args))
    user = f"node-{role.node}" if role.node else f"{role.kind}-USER"
    node_flag = f" --node {role.node}" if role.node else ""
    issue = f"mesh-actor creds issue --role {role.kind}{node_flag} --out FILE"
    rights = permissions(subjects, role, user)
    record: dict[str, Any] = {
        "role": str(role),
        "issue": issue,
        "connect": "mesh-actor nats-env --creds FILE (or --nats-creds FILE on any command)",
        "inbox_prefix": inbox_prefix(user),
        "account": role.account,
        "permissions": rights if rights is not None else "all",
    }
    if args.json:
        emit_json(record)
        return 0
    print(f"role {role}: issue credentials with `{issue}` (on the node running the embedded server)")
    print(f"connect: {record['connect']}; replies arrive on {record['inbox_prefix']}.> (its inbox prefix)")
    imports = " (it imports what it may request from the mesh)" if role.kind == "client" else ""
    print(f"account: {role.account}{imports}")
    if rights is None:
        print("rights: every subject and JetStream call")
        return 0
    for what, key in (("may publish / request", "publish"), ("may subscribe / serve", "subscribe")):
        print(f"{what}:")
        for subject in rights[key]["allow"]:
            print(f"  {subject}")
    if rights.get("allow_responses"):
        print("and may answer requests it received")
    return 0
