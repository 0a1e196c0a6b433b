"""`mesh-actor doctor` and `mesh-actor stop` against a real nats-server (the handlers, in process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from messages.subjects import Subjects
from runtime.bus import Bus
from runtime.cli import runner as runner_cli
from runtime.cli.common import CliError
from tests.conftest import NatsServer
from tests.harness.cli import nats_flags, run_cli
from tests.llama_harness import find_server
from tests.rpc_harness import require_rpc_server


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
    assert "not looked for: no llama-server" in lines["ggml-rpc-server"]


async def test_doctor_reports_the_rpc_server_beside_llama_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The `llama` extra built with -DGGML_RPC=ON puts `ggml-rpc-server` beside llama-server: the doctor finds it
    where the runner does (no NATS here: that check fails, this one does not depend on it)."""
    rpc_server = require_rpc_server()
    engine = str(Path(rpc_server).with_name("llama-server"))
    await run_cli("doctor", "--json", "--data-dir", str(tmp_path), "--llama-server", engine)
    report = json.loads(capsys.readouterr().out)
    assert report["rpc_server"] == {"path": rpc_server, "present": True, "executable": True}
    check = {c["name"]: c for c in report["checks"]}["ggml-rpc-server"]
    assert check["ok"] is True and check["required"] is False
    assert check["detail"].startswith(f"{rpc_server} ")

    await run_cli("doctor", "--data-dir", str(tmp_path), "--llama-server", engine)
    lines = {line.split()[0]: line.split(maxsplit=2) for line in capsys.readouterr().out.splitlines()}
    assert lines["ggml-rpc-server"][1:] == ["ok", check["detail"]]
    assert lines["llama-server"][1] == "ok"


async def test_doctor_passes_without_the_rpc_server_and_says_the_node_cannot_lend(
    nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only lending needs it: a llama-server with no `ggml-rpc-server` beside it (here the real one, linked
    into a directory of its own) is a healthy node that cannot lend memory to split instances."""
    engine = find_server()
    if engine is None:
        pytest.skip("no llama-server installed")
    alone = tmp_path / "bin"
    alone.mkdir()
    (alone / "llama-server").symlink_to(engine)
    argv = ["doctor", "--data-dir", str(tmp_path), "--llama-server", str(alone / "llama-server")]
    code = await run_cli(*argv, "--json", *nats_flags(nats_server))
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] is True
    rpc_path = str(alone / "ggml-rpc-server")
    assert report["rpc_server"] == {"path": rpc_path, "present": False, "executable": False}
    check = {c["name"]: c for c in report["checks"]}["ggml-rpc-server"]
    assert (check["ok"], check["required"]) == (False, False)
    assert check["detail"].startswith(f"not found at {rpc_path}: this node cannot lend memory to split instances")
    assert "-DGGML_RPC=ON" in check["detail"]

    (alone / "ggml-rpc-server").write_bytes(b"")  # present, not executable
    code = await run_cli(*argv, *nats_flags(nats_server))
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert code == 0
    assert lines["ggml-rpc-server"].split()[1] == "-"  # not ok, not required
    assert f"not executable at {rpc_path}" in lines["ggml-rpc-server"]


async def test_stop_of_an_unknown_instance_says_so(nats_server: NatsServer, bus: Bus) -> None:
    with pytest.raises(CliError, match="no instance 'abc123'"):
        await run_cli("stop", "abc123", *nats_flags(nats_server))
    with pytest.raises(CliError) as bad:
        await run_cli("stop", "../etc", *nats_flags(nats_server))
    assert bad.value.code == 2


async def test_fetch_instances_is_empty_without_a_bucket(bus: Bus) -> None:
    assert await runner_cli.fetch_instances(bus, Subjects()) == []
