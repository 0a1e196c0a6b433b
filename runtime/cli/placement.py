"""Placement commands: `place` (ask for a decision), `replay` (recompute recorded decisions: placement,
routing, queue order and scaling), `registry`.

`place` exits 0 when admitted and 3 when refused (1 on errors, 2 on usage), so scripts can branch on it.
`replay` exits 3 when some recorded decision would now be different.
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

from actors.frontdoor.scaling import replay as replay_scaling
from actors.placement import decision_records
from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, parse_header, read_header
from actors.placement.registry import RegistryUntrusted, public_key_of, sign
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
from messages.placement import ModelRef, PlacementDecision, PlacementRequest
from messages.registry import RegistryEntry
from messages.runner import RunnerAck, StartInstance
from messages.subjects import Subjects, check_token
from runtime import buckets
from runtime.bus import BadMessage, Bus, BusError, RemoteError, decode_checked, encode, once_listening
from runtime.cli.common import EXIT_USAGE, CliError, add_client_options, connect, emit_json, prefix
from runtime.cli.journal import read_events
from runtime.model_files import FileDigests, ModelFileError, open_regular
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

    replay = sub.add_parser(
        "replay", help="recompute recorded placement, routing, queue and scaling decisions with today's cores"
    )
    add_client_options(replay)
    replay.add_argument("--since", metavar="SEQ|TIME", help="a stream sequence, an ISO time, or an age like 1h")
    replay.set_defaults(func=cmd_replay)

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
    header = f"  {'NODE':<14} {'DEVICE':<6} {'LAYERS':<8} {'WEIGHTS':>11} {'REPACK':>11} {'KV':>11} {'RECURRENT':>11}"
    print(header + f" {'DRAFT KV':>11} {'COMPUTE':>11} {'MARGIN':>11} {'HOST EXTRA':>11} {'TOTAL':>11} {'HAVE':>11}")
    for placement in decision.placements:
        for d in placement.breakdown.devices:
            layers = f"{d.layers[0]}-{d.layers[1] - 1}" if d.layers else "-"
            cells = [d.weights_bytes, d.repack_bytes, d.kv_bytes, d.recurrent_bytes, d.draft_kv_bytes]
            cells += [d.compute_bytes, d.compute_margin_bytes]
            sizes = " ".join(f"{format_size(n):>11}" for n in (*cells, d.host_extra_bytes, d.total_bytes))
            have = format_size(d.budget_bytes) if d.budget_bytes is not None else "-"
            print(f"  {placement.node_id:<14} {d.device:<6} {layers:<8} {sizes} {have:>11}")


async def cmd_place(args: argparse.Namespace) -> int:
    request = _request(args)
    subjects = Subjects(prefix(args))
    bus = await connect(args, "place")
    try:
        subject = subjects.placement_fit if args.fit else subjects.placement_request
        try:
            decision = await bus.request(subject, request, PlacementDecision, timeout=args.timeout)
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
    if args.json:
        out: dict[str, Any] = msgspec.to_builtins(decision)
        if ack is not None:
            out["instance"] = msgspec.to_builtins(ack)
        emit_json(out)
    else:
        print_decision(decision)
        if ack is not None:
            print(f"  instance {ack.instance_id} on {ack.node_id}: {ack.state} port {ack.port} {ack.message}")
    return 0 if decision.admitted else EXIT_REFUSED


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


async def cmd_replay(args: argparse.Namespace) -> int:
    subjects = Subjects(prefix(args))
    bus = await connect(args, "replay")
    changed: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    replayed = 0
    try:
        pattern = "placement.placement_decided"
        async for stored in read_events(bus, subjects, pattern, since=args.since, follow=False):
            try:
                event = decode_checked(stored.data, PlacementDecided, f"event {stored.seq}")
            except BadMessage as exc:
                skipped.append({"seq": stored.seq, "reason": f"not a decision this version can read: {exc.error}"})
                continue
            decision_id = event.decision.decision_id
            try:
                inputs = await _inputs(bus, subjects, event)
            except decision_records.RecordUnavailable as exc:
                skipped.append({"seq": stored.seq, "decision_id": decision_id, "reason": str(exc)})
                continue
            geometry, source = await asyncio.to_thread(_geometry_now, inputs)
            if geometry is None:
                reason = f"model unreadable (geometry: {source})"
                skipped.append({"seq": stored.seq, "decision_id": decision_id, "reason": reason})
                continue
            replayed += 1
            now = await asyncio.to_thread(recompute, inputs, geometry)
            diff = differences(inputs.decision, now)
            if diff:
                changed.append(
                    {
                        "seq": stored.seq,
                        "decision_id": decision_id,
                        "model": inputs.request.model.path or inputs.request.model.registry,
                        "kind": "placement",
                        "geometry": source,
                        "differences": [{"path": d.path, "recorded": d.recorded, "now": d.now} for d in diff],
                    }
                )
        async for stored in read_events(bus, subjects, "router.generate_routed", since=args.since, follow=False):
            try:
                routed = decode_checked(stored.data, GenerateRouted, f"event {stored.seq}")
            except BadMessage as exc:
                skipped.append({"seq": stored.seq, "reason": f"not a routing this version can read: {exc.error}"})
                continue
            replayed += 1
            rerouted = route(routed.n_prompt, routed.candidates, routed.weights, routed.links, routed.link_fixed_s)
            diff = differences(routed.decision, rerouted)
            if diff:
                changed.append(
                    {
                        "seq": stored.seq,
                        "decision_id": routed.id,
                        "model": routed.model,
                        "kind": "routing",
                        # A decision made by an older router differs where that version's rules changed.
                        "versions": {"recorded": routed.router_version, "now": ROUTER_VERSION},
                        "differences": [{"path": d.path, "recorded": d.recorded, "now": d.now} for d in diff],
                    }
                )
        kinds: tuple[tuple[str, type[GenerateQueued] | type[GenerateDequeued]], ...] = (
            ("runner.generate_queued", GenerateQueued), ("runner.generate_dequeued", GenerateDequeued),
        )  # fmt: skip
        for pattern, kind in kinds:
            async for stored in read_events(bus, subjects, pattern, since=args.since, follow=False):
                try:
                    queued = decode_checked(stored.data, kind, f"event {stored.seq}")
                except BadMessage as exc:
                    why = f"not a queue decision this version can read: {exc.error}"
                    skipped.append({"seq": stored.seq, "reason": why})
                    continue
                replayed += 1
                if queue_diff := _queue_differences(queued):
                    changed.append({"seq": stored.seq, "decision_id": queued.id, "model": queued.instance_id,
                                    "kind": "queue", "differences": queue_diff})  # fmt: skip
        async for stored in read_events(bus, subjects, "frontdoor.scaling_decided", since=args.since, follow=False):
            try:
                scaled = decode_checked(stored.data, ScalingDecided, f"event {stored.seq}")
            except BadMessage as exc:
                skipped.append({"seq": stored.seq, "reason": f"not a scaling this version can read: {exc.error}"})
                continue
            replayed += 1
            if scale_diff := replay_scaling(scaled.scale, scaled.memory, scaled.now, scaled.decision):
                changed.append({"seq": stored.seq, "decision_id": scaled.id, "model": scaled.scale.model,
                                "kind": "scaling", "differences": [{"path": path, "recorded": was, "now": now}
                                                                   for path, was, now in scale_diff]})  # fmt: skip
    finally:
        await bus.close()
    if args.json:
        emit_json({"replayed": replayed, "changed": changed, "skipped": skipped})
    else:
        for item in changed:
            versions = item.get("versions")
            by = f", router {versions['recorded']} -> {versions['now']}" if versions else ""
            print(f"decision {item['decision_id']} (seq {item['seq']}, {item['model']}{by}) would now differ:")
            for d in item["differences"]:
                print(f"  {d['path']}: {d['recorded']!r} -> {d['now']!r}")
        for item in skipped:
            print(f"skipped seq {item['seq']}: {item['reason']}", file=sys.stderr)
        print(f"{replayed} decisions replayed, {len(changed)} would differ, {len(skipped)} skipped")
    return EXIT_REFUSED if changed else 0


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
