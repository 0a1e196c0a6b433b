"""Runner commands: `stop` (an instance, wherever it runs) and `doctor` (is this node able to serve, and to lend
memory to split instances?).

`fetch_instances` reads every instance record from the instances bucket; `status` lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from actors.runner.engine import EngineNotFound, find_llama_server, probe_llama_server, rpc_server_beside
from actors.telemetry.probes import Nvml
from messages.runner import InstanceStatus, RunnerAck, StopInstance
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, BusError, RemoteError
from runtime.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    add_client_options,
    client_options,
    connect,
    data_dir,
    emit_json,
    prefix,
)
from runtime.config import ConfigError, load_config

_INSTANCE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The runner answers a stop once the server is gone (SIGTERM, then SIGKILL): allow for both deadlines.
STOP_TIMEOUT_S = 35.0
FINAL_STATES = ("stopped", "failed", "rejected")


def register(sub: argparse._SubParsersAction[Any]) -> None:
    stop = sub.add_parser("stop", help="stop a llama-server instance (SIGTERM, then SIGKILL)")
    stop.add_argument("instance", metavar="INSTANCE", help="instance id, as `mesh-actor status` lists it")
    add_client_options(stop)
    stop.set_defaults(func=cmd_stop)

    doctor = sub.add_parser("doctor", help="check this node: llama-server, ggml-rpc-server, NVML, NATS and JetStream")
    doctor.add_argument("--llama-server", metavar="PATH", help="llama-server binary to check (as `run` takes it)")
    add_client_options(doctor)
    doctor.set_defaults(func=cmd_doctor)


async def fetch_instances(bus: Bus, subjects: Subjects) -> list[InstanceStatus]:
    """Every instance record in the instances bucket, by node then id (expired ones are gone)."""
    records, warnings = await buckets.read_all(bus, subjects.instances_bucket, InstanceStatus)
    for warning in warnings:
        print(f"mesh-actor: warning: skipping {warning}", file=sys.stderr)
    return sorted((record for _, record in records), key=lambda i: (i.node, i.id))


async def _find_instance(bus: Bus, subjects: Subjects, instance_id: str) -> InstanceStatus | None:
    # Keys are <node>.<instance id>: the record is found by its id among every node's.
    records, warnings = await buckets.read_all(bus, subjects.instances_bucket, InstanceStatus)
    found = [record for key, record in records if key.rsplit(".", 1)[-1] == instance_id]
    if not found:
        if warnings:
            raise CliError("; ".join(warnings))
        return None
    return found[0]


async def cmd_stop(args: argparse.Namespace) -> int:
    instance_id = args.instance
    if not _INSTANCE_ID.match(instance_id):
        raise CliError(f"{instance_id!r} is not an instance id", EXIT_USAGE)
    subjects = Subjects(prefix(args))
    bus = await connect(args, "stop")
    try:
        record = await _find_instance(bus, subjects, instance_id)
        if record is None:
            raise CliError(f"no instance {instance_id!r} (not in {subjects.instances_bucket}; see mesh-actor status)")
        try:
            ack = await bus.request(
                subjects.runner(record.node, "stop"),
                StopInstance(instance_id=instance_id),
                RunnerAck,
                timeout=STOP_TIMEOUT_S,
            )
        except RemoteError as exc:
            raise CliError(f"node {record.node}: {exc.code}: {exc.reply.message}") from exc
        except BusError as exc:
            raise CliError(f"node {record.node}: {exc}") from exc
    finally:
        await bus.close()
    if args.json:
        emit_json(msgspec.to_builtins(ack))
    else:
        detail = f" ({ack.message})" if ack.message else ""
        print(f"instance {ack.instance_id} on {ack.node_id}: {ack.state}{detail}")
    return EXIT_OK if ack.state in FINAL_STATES else EXIT_FAILURE


# --- doctor ------------------------------------------------------------------------------------------------


class _Checks:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, detail: str, *, required: bool = True) -> None:
        self.items.append({"name": name, "ok": ok, "required": required, "detail": detail})

    @property
    def ok(self) -> bool:
        return all(item["ok"] for item in self.items if item["required"])


async def _check_engine(args: argparse.Namespace, checks: _Checks) -> dict[str, Any] | None:
    try:
        config = load_config({"data_dir": args.data_dir, "llama_server": args.llama_server}, os.environ)
        path = find_llama_server(config.llama_server)
        info = await probe_llama_server(path)
    except (ConfigError, EngineNotFound, OSError) as exc:
        checks.add("llama-server", False, str(exc))
        return None
    checks.add("llama-server", True, f"{info.path} (version {info.version})")
    return {"path": info.path, "version": info.version, "build_info": info.build_info}


def _check_rpc_server(engine: dict[str, Any] | None, checks: _Checks) -> dict[str, Any] | None:
    """`ggml-rpc-server` beside llama-server, where the runner looks for it (`launcher.split_serving`). Needed
    only to lend this node's memory to other nodes' split instances, so its absence is no failure."""
    if engine is None:
        checks.add("ggml-rpc-server", False, "not looked for: no llama-server to look beside", required=False)
        return None
    path = rpc_server_beside(engine["path"])
    present = path.is_file()
    executable = present and os.access(path, os.X_OK)
    if executable:
        detail = f"{path} (needed to lend this node's memory to split instances)"
    else:
        state = "not executable" if present else "not found"
        detail = (
            f"{state} at {path}: this node cannot lend memory to split instances "
            "(build the llama extra with -DGGML_RPC=ON)"
        )
    checks.add("ggml-rpc-server", executable, detail, required=False)
    return {"path": str(path), "present": present, "executable": executable}


def _check_nvml(checks: _Checks) -> dict[str, Any] | None:
    nvml = Nvml()
    nvml.open()
    try:
        reading = nvml.read()
    finally:
        nvml.close()
    if reading.driver is None:
        # a CPU node has no NVML; that is a fact about the node, not a fault
        checks.add("NVML", False, reading.error or nvml.error or "not available", required=False)
        return None
    gpus = [{"index": g.index, "name": g.name, "total_bytes": g.total_bytes} for g in reading.gpus]
    names = ", ".join(f"{g['index']}: {g['name']}" for g in gpus) or "no GPUs"
    checks.add("NVML", reading.error is None, f"driver {reading.driver}; {names}", required=False)
    return {"driver": reading.driver, "gpus": gpus, "error": reading.error}


async def _check_nats(args: argparse.Namespace, checks: _Checks) -> dict[str, Any] | None:
    try:
        options = client_options(args)
    except CliError as exc:
        checks.add("NATS", False, str(exc))
        return None
    url = ",".join(options.urls)
    try:
        bus = await Bus.connect(options, name="mesh-actor doctor", deadline_s=5.0)
    except BusError as exc:
        checks.add("NATS", False, str(exc))
        return {"url": url, "connected": False, "jetstream": False}
    try:
        server = bus.nc.connected_server_version
        checks.add("NATS", True, f"{url} (nats-server {server})")
        try:
            async with asyncio.timeout(5.0):
                account = await bus.js.account_info()
            jetstream, detail = True, f"streams {account.streams}, consumers {account.consumers}"
        except (nats.errors.Error, TimeoutError) as exc:
            jetstream, detail = False, f"not available: {str(exc) or type(exc).__name__}"
        checks.add("JetStream", jetstream, detail)
        return {"url": url, "connected": True, "server_version": str(server), "jetstream": jetstream}
    finally:
        await bus.close()


async def cmd_doctor(args: argparse.Namespace) -> int:
    checks = _Checks()
    engine = await _check_engine(args, checks)
    rpc_server = _check_rpc_server(engine, checks)
    nvml = await asyncio.to_thread(_check_nvml, checks)
    nats_info = await _check_nats(args, checks)
    if args.json:
        emit_json(
            {
                "ok": checks.ok,
                "data_dir": str(data_dir(args)),
                "checks": checks.items,
                "llama_server": engine,
                "rpc_server": rpc_server,
                "nvml": nvml,
                "nats": nats_info,
            }
        )
    else:
        for item in checks.items:
            mark = "ok" if item["ok"] else ("FAIL" if item["required"] else "-")
            print(f"{item['name']:<15} {mark:<5} {item['detail']}")
    return EXIT_OK if checks.ok else EXIT_FAILURE
