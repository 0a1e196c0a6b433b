"""Placement commands: `place` (ask for a decision) and `registry` (`replay` is `runtime.cli.replay`).

`place` exits 0 when admitted and 3 when refused (1 on errors, 2 on usage), so scripts can branch on it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import nacl.signing
import nkeys

from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, read_header
from actors.placement.registry import RegistryUntrusted, public_key_of, sign
from messages.placement import ModelRef, PlacementDecision, PlacementRequest
from messages.registry import RegistryEntry
from messages.runner import RunnerAck, StartInstance
from messages.subjects import Subjects, check_token
from runtime import buckets
from runtime.bus import BusError, RemoteError, encode, once_listening
from runtime.cli.common import EXIT_USAGE, CliError, add_client_options, connect, emit_json, prefix
from runtime.model_files import FileDigests, ModelFileError
from runtime.sizes import format_size

EXIT_REFUSED = 3


def register(sub: argparse._SubParsersAction[Any]) -> None:
    place = sub.add_parser("place", help="ask placement where a model fits (and reserve it)")
    add_client_options(place)
    place.add_argument("model", nargs="?", metavar="MODEL.gguf", help="GGUF path as the placement nodes see it")
    place.add_argument("--registry", metavar="NAME", help="a signed registry entry instead of (or beside) a path")
    place.add_argument(
        "--draft", metavar="DRAFT.gguf", help="a draft model sharing the model's vocabulary (draft-simple speculation)"
    )
    place.add_argument("--mmproj", metavar="MMPROJ.gguf", help="a multimodal projector (a LLaVA 'mlp' projector)")
    size = place.add_mutually_exclusive_group()
    size.add_argument("-c", "--ctx", type=int, metavar="N", help="context (-c) to admit")
    size.add_argument("--max-ctx", action="store_true", help="the largest context that fits")
    place.add_argument("--node", action="append", default=[], metavar="ID", help="only these nodes (repeatable)")
    place.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1, metavar="N")
    place.add_argument(
        "--multi-node",
        action="store_true",
        help="allow a split over nodes (llama.cpp RPC) when no single node holds the model; the default never splits",
    )
    place.add_argument("--no-multi-node", action="store_true", help=argparse.SUPPRESS)  # the default; kept for scripts
    place.add_argument("--hold", type=float, default=600.0, metavar="S", help="reservation expiry if never started")
    place.add_argument("--fit", action="store_true", help="what-if: decide without reserving (mesh.placement.fit)")
    place.add_argument("--start", action="store_true", help="start the admitted instance on its node")
    place.add_argument("--timeout", type=float, default=30.0, metavar="S")
    place.set_defaults(func=cmd_place)

    registry = sub.add_parser("registry", help="signed model registry")
    verbs = registry.add_subparsers(dest="verb", required=True, metavar="VERB")
    keygen = verbs.add_parser("keygen", help="create a signing key (nkey seed file, mode 0600)")
    keygen.add_argument("--out", required=True, metavar="KEYFILE")
    keygen.add_argument("--json", action="store_true")
    keygen.set_defaults(func=cmd_keygen)
    add = verbs.add_parser("add", help="record a model's header facts and digest, signed")
    add_client_options(add)
    add.add_argument("model", metavar="MODEL.gguf")
    add.add_argument("--key", required=True, metavar="KEYFILE")
    add.add_argument("--name", help="entry name (default: the file name without .gguf)")
    add.set_defaults(func=cmd_registry_add)
    listing = verbs.add_parser("list", help="entries in the registry")
    add_client_options(listing)
    listing.set_defaults(func=cmd_registry_list)


def _request(args: argparse.Namespace) -> PlacementRequest:
    if not args.model and not args.registry:
        raise CliError("name a model: MODEL.gguf and/or --registry NAME", EXIT_USAGE)
    path = str(Path(args.model).resolve()) if args.model else None
    companions = {name: str(Path(value).resolve()) for name in ("draft", "mmproj") if (value := getattr(args, name))}
    raw: dict[str, Any] = {
        "model": {"path": path, "registry": args.registry, **companions},
        # a draft model speculates with draft-simple, the one type that uses it
        "settings": {"spec_type": "draft-simple"} if args.draft else None,
        "ctx": args.ctx,
        "max_ctx": args.max_ctx,
        "nodes": args.node,
        "n_gpu_layers": args.n_gpu_layers,
        "allow_multi_node": args.multi_node,
        "hold_s": args.hold,
    }
    try:
        return msgspec.convert(raw, PlacementRequest)
    except msgspec.ValidationError as exc:
        raise CliError(f"invalid request: {exc}", EXIT_USAGE) from exc


def print_decision(decision: PlacementDecision) -> None:
    model = decision.model.path or decision.model.registry
    if not decision.admitted:
        print(f"REFUSED {model}: {decision.reason}")
        for rejection in decision.rejections:
            print(f"  {rejection.node_id:<16} {rejection.reason:<22} {rejection.message}")
        if not decision.rejections:
            print(f"  {decision.message}")
        return
    assert decision.stamp is not None
    s = decision.stamp.settings
    print(f"ADMITTED {model} ({decision.architecture}) -c {decision.ctx} (ceiling {decision.context_ceiling})")
    if decision.reservation_id:
        print(f"  reservation {decision.reservation_id}")
    print(
        f"  stamp: -np {s.slots} {'-kvu ' if s.kv_unified else ''}-ctk {s.cache_type_k} -ctv {s.cache_type_v} "
        f"-fa {s.flash_attn} -ub {s.ubatch} --spec-type {s.spec_type} --spec-draft-n-max {s.spec_draft_n_max} "
        f"-ngl {decision.stamp.n_gpu_layers}"
    )
    header = f"  {'NODE':<14} {'DEVICE':<6} {'LAYERS':<8} {'WEIGHTS':>11} {'COPIES':>11} {'KV':>11} {'RECURRENT':>11}"
    print(header + f" {'DRAFT KV':>11} {'COMPUTE':>11} {'MARGIN':>11} {'HOST EXTRA':>11} {'TOTAL':>11} {'HAVE':>11}")
    for placement in decision.placements:
        for d in placement.breakdown.devices:
            layers = f"{d.layers[0]}-{d.layers[1] - 1}" if d.layers else "-"
            cells = [d.weights_bytes, d.repack_bytes + d.amx_bytes, d.kv_bytes, d.recurrent_bytes, d.draft_kv_bytes]
            cells += [d.compute_bytes, d.compute_margin_bytes]
            sizes = " ".join(f"{format_size(n):>11}" for n in (*cells, d.host_extra_bytes, d.total_bytes))
            have = format_size(d.budget_bytes) if d.budget_bytes is not None else "-"
            print(f"  {placement.node_id:<14} {d.device:<6} {layers:<8} {sizes} {have:>11}")


async def run_place(args: argparse.Namespace) -> tuple[PlacementDecision, RunnerAck | None]:
    """Placement's decision on the request `place` makes, and with `--start` the runner's answer to the start of
    what it admitted."""
    request = _request(args)
    subjects = Subjects(prefix(args))
    bus = await connect(args, "place")
    try:
        subject = subjects.placement_fit if args.fit else subjects.placement_request
        deadline = asyncio.get_running_loop().time() + args.timeout
        try:  # a node just started may not have its placement actor listening yet: wait for it, as for the runner
            decision = await once_listening(
                lambda: bus.request(subject, request, PlacementDecision, timeout=args.timeout), deadline
            )
        except BusError as exc:
            raise CliError(str(exc)) from exc
        ack: RunnerAck | None = None
        if args.start and decision.admitted and decision.reservation_id:
            node, order = decision.placements[0].node_id, StartInstance(reservation_id=decision.reservation_id)
            wait = max(args.timeout, 120.0)
            try:  # the node's runner may still be starting (telemetry answers first): wait for it to listen
                ack = await once_listening(
                    lambda: bus.request(subjects.runner(node, "start"), order, RunnerAck, timeout=wait),
                    asyncio.get_running_loop().time() + args.timeout,
                )
            except BusError as exc:
                raise CliError(f"admitted, but the start on {node} failed: {exc}") from exc
    finally:
        await bus.close()
    return decision, ack


def place_record(decision: PlacementDecision, ack: RunnerAck | None) -> dict[str, Any]:
    """What `place --json` prints."""
    out: dict[str, Any] = msgspec.to_builtins(decision)
    if ack is not None:
        out["instance"] = msgspec.to_builtins(ack)
    return out


async def cmd_place(args: argparse.Namespace) -> int:
    decision, ack = await run_place(args)
    if args.json:
        emit_json(place_record(decision, ack))
    else:
        print_decision(decision)
        if ack is not None:
            print(f"  instance {ack.instance_id} on {ack.node_id}: {ack.state} port {ack.port} {ack.message}")
    return 0 if decision.admitted else EXIT_REFUSED


def cmd_keygen(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():
        raise CliError(f"{out} exists; refusing to overwrite a key", EXIT_USAGE)
    seed = nkeys.encode_seed(bytes(nacl.signing.SigningKey.generate()), nkeys.PREFIX_BYTE_ACCOUNT)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed + b"\n")
    public = public_key_of(seed)
    if args.json:
        emit_json({"key_file": str(out), "public_key": public})
    else:
        print(f"wrote {out} (keep it secret); public key, for --registry-key on placement nodes:\n{public}")
    return 0


def _build_entry(path: Path, name: str, key_file: Path) -> RegistryEntry:
    seed = key_file.read_bytes()
    public_key_of(seed)  # a clear error for a file that is not an nkey seed
    geometry = geometry_from_header(read_header(path))
    try:
        digest = FileDigests().digest(path)
    except ModelFileError as exc:
        raise CliError(str(exc)) from exc
    unsigned = RegistryEntry(
        name=name,
        file_name=path.name,
        size_bytes=path.stat().st_size,
        blake3=digest,
        geometry=geometry,
        created_at=time.time(),
        public_key="",
    )
    return sign(unsigned, seed)


async def cmd_registry_add(args: argparse.Namespace) -> int:
    path = Path(args.model)
    name = args.name or path.name.removesuffix(".gguf")
    try:
        check_token(name, "registry entry name")  # it is a KV key
        print(f"reading and hashing {path} …", file=sys.stderr, flush=True)
        entry = await asyncio.to_thread(_build_entry, path, name, Path(args.key))
    except (OSError, GGUFFormatError, GeometryError, RegistryUntrusted, ValueError) as exc:
        raise CliError(str(exc)) from exc
    bus = await connect(args, "registry")
    try:
        kv = await buckets.registry(bus, Subjects(prefix(args)))
        await kv.put(name, encode(entry))
    finally:
        await bus.close()
    if args.json:
        emit_json(
            {"name": name, "blake3": entry.blake3, "size_bytes": entry.size_bytes, "public_key": entry.public_key}
        )
    else:
        print(f"registered {name}: {entry.size_bytes} bytes, blake3 {entry.blake3}, signed by {entry.public_key}")
    return 0


async def cmd_registry_list(args: argparse.Namespace) -> int:
    bus = await connect(args, "registry")
    try:  # read without a consumer (a client's account has none); a missing registry is empty
        found, warnings = await buckets.read_all(bus, Subjects(prefix(args)).registry_bucket, RegistryEntry)
    except RemoteError as exc:
        raise CliError(str(exc)) from exc
    finally:
        await bus.close()
    for warning in warnings:
        print(f"mesh-actor: warning: {warning}", file=sys.stderr)
    entries = [entry for _, entry in found]
    if args.json:
        rows = [msgspec.to_builtins(e) for e in entries]
        for row in rows:
            row["architecture"] = row.pop("geometry")["architecture"]
        emit_json({"entries": rows})
    else:
        for e in entries:
            print(f"{e.name:<24} {e.geometry.architecture:<14} {format_size(e.size_bytes):>11} {e.blake3[:16]}…")
    return 0


__all__ = ["ModelRef", "register"]
