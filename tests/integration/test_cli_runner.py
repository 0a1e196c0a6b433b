"""`mesh-actor doctor` and `mesh-actor stop` against a real nats-server (the handlers, in process)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from messages.subjects import Subjects
from runtime.bus import Bus
from runtime.cli import runner as runner_cli
from runtime.cli.common import CliError
from tests.conftest import NatsServer
from tests.llama_harness import find_server


async def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mesh-actor")
    runner_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(await args.func(args))


def nats_flags(server: NatsServer) -> list[str]:
    options = server.options
    assert options.user and options.password
    secret = server.data_dir / "client-password"
    secret.write_text(options.password + "\n")  # never in argv
    return ["--nats", server.url, "--nats-user", options.user, "--nats-password-file", str(secret)]


async def test_doctor_reports_engine_nvml_nats_and_jetstream_as_json(
    nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = find_server()
    if engine is None:
        pytest.skip("no llama-server installed")
    code = await run_cli(
        "doctor", "--json", "--data-dir", str(tmp_path), "--llama-server", engine, *nats_flags(nats_server)
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] is True
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["llama-server"]["ok"] and checks["NATS"]["ok"] and checks["JetStream"]["ok"]
    assert checks["NVML"]["required"] is False  # a CPU node is a healthy node
    assert report["llama_server"]["path"] == engine and report["llama_server"]["version"]
    assert report["nats"] == {
        "url": nats_server.url,
        "connected": True,
        "server_version": report["nats"]["server_version"],
        "jetstream": True,
    }


async def test_doctor_fails_when_the_engine_or_nats_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await run_cli("doctor", "--data-dir", str(tmp_path), "--llama-server", str(tmp_path / "no-such-server"))
    out = capsys.readouterr().out
    assert code == 1
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "FAIL" in lines["llama-server"] and "not found at" in lines["llama-server"]
    assert "FAIL" in lines["NATS"] and "no embedded server record" in lines["NATS"]


async def test_stop_of_an_unknown_instance_says_so(nats_server: NatsServer, bus: Bus) -> None:
    with pytest.raises(CliError, match="no instance 'abc123'"):
        await run_cli("stop", "abc123", *nats_flags(nats_server))
    with pytest.raises(CliError) as bad:
        await run_cli("stop", "../etc", *nats_flags(nats_server))
    assert bad.value.code == 2


async def test_fetch_instances_is_empty_without_a_bucket(bus: Bus) -> None:
    assert await runner_cli.fetch_instances(bus, Subjects()) == []
