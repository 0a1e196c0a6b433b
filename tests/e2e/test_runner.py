"""The runner actor end to end: a real nats-server, the actor under a supervisor, real llama-servers.

Each test writes the reservation ledger itself (as placement would: the stamp plus the memory model's
prediction) and the node's telemetry, then talks to the runner over NATS and watches the journal. The
models are tiny generated GGUF files (a dense llama; a hybrid qwen35 with an MTP block), so a server loads
in well under a second. No test leaves a llama-server behind: every runner is stopped by its fixture, and
the last test checks that even a SIGKILLed runner takes its server with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import blake3
import msgspec
import pytest

from actors.runner.instance_lifecycle import Event, Verified
from messages.generate import GenerateRequest, GenerateResult, RunnerGenerate
from messages.placement import RpcMember, SplitPart
from messages.runner import RunnerAck, StopInstance
from runtime import buckets
from runtime.bus import Bus, RemoteError, parse_reply
from runtime.cli.runner import fetch_instances
from runtime.restart import RestartPolicy
from tests import tiny_models
from tests.conftest import JournalReader, NatsServer, of_type, processes
from tests.harness.cli import run_cli
from tests.harness.runner import (
    FAST,
    NODE,
    SUBJECTS,
    Node,
    _predict,
    _put_ledger,
    _put_telemetry,
    _request,
    _reservation,
    _settings,
    _start,
    _status,
    runner,
)
from tests.llama_harness import call_server, require_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def binary() -> str:
    return require_server()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_models.write_hybrid_set(tmp_path_factory.mktemp("runner-models"), n_vocab=400, llama_layers=2)


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, whose cmdline is empty, counts as gone)."""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def _servers_with(text: str) -> list[int]:
    return processes("llama-server", text)


async def _wait_gone(pid: int, timeout: float = 15) -> None:
    async with asyncio.timeout(timeout):
        while _alive(pid):
            await asyncio.sleep(0.05)


# --- tests ------------------------------------------------------------------------------------------------


async def test_dense_instance_serves_completions_and_reports_cache_bytes_exactly(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    settings = _settings(slots=2)
    reservation = _reservation("r-dense", models["llama"], settings, 4096)
    await _put_ledger(bus, reservation)
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data", binary, Node(settings)):
        ack = await _start(bus, "r-dense")
        assert ack.state == "starting" and ack.port is not None
        ready = (await journal_reader.wait_for(of_type("instance_ready", instance_id=ack.instance_id), timeout=60))[0]
        predicted = _predict(models["llama"], settings, 4096)
        observed = ready["observed"]
        assert observed["kv_bytes"] == predicted.kv_bytes > 0
        assert observed["recurrent_bytes"] == predicted.recurrent_bytes == 0
        assert observed["weights_bytes"] == predicted.weights_bytes
        assert observed["output_bytes"] == predicted.output_bytes
        assert ready["predicted"]["kv_bytes"] == predicted.kv_bytes

        reply = await call_server(ack.port, "POST", "/completion", {"prompt": "hello", "n_predict": 4}, timeout_s=30)
        assert reply.status == 200
        assert reply.json()["tokens_predicted"] == 4

        status = await _status(bus, ack.instance_id)
        assert (status.state, status.port, status.node) == ("ready", ack.port, NODE)
        assert status.settings == reservation.stamp and status.observed_memory is not None
        listed = await fetch_instances(bus, SUBJECTS)
        assert [i.id for i in listed] == [ack.instance_id]
        assert status.pid is not None and _alive(status.pid)

        stopped = await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))
        assert stopped.state == "stopped"
        await journal_reader.wait_for(of_type("instance_stopped", instance_id=ack.instance_id))
        assert not _alive(status.pid)
        assert (await _status(bus, ack.instance_id)).state == "stopped"
    log = (tmp_path / "data" / "runner" / ack.instance_id / "llama-server.log").read_text()
    assert "llama_kv_cache: size =" in log
    starting = (await journal_reader.wait_for(of_type("instance_starting", instance_id=ack.instance_id)))[0]
    command = starting["command"]
    for flag, value in (("-c", "4096"), ("-np", "2"), ("--fit", "off"), ("-lv", "4"), ("--host", "127.0.0.1")):
        assert command[command.index(flag) + 1] == value
    assert "-no-kvu" in command


async def test_hybrid_mtp_instance_reports_kv_recurrent_and_draft_bytes_exactly(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    settings = _settings(slots=2, spec_type="draft-mtp", spec_draft_n_max=2)
    await _put_ledger(bus, _reservation("r-hybrid", models["qwen35"], settings, 2048))
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data", binary, Node(settings)):
        ack = await _start(bus, "r-hybrid")
        ready = (await journal_reader.wait_for(of_type("instance_ready", instance_id=ack.instance_id), timeout=60))[0]
    predicted = _predict(models["qwen35"], settings, 2048)
    assert predicted.recurrent_bytes > 0 and predicted.draft_kv_bytes > 0
    observed = ready["observed"]
    assert observed["kv_bytes"] == predicted.kv_bytes
    assert observed["recurrent_bytes"] == predicted.recurrent_bytes
    assert observed["draft_kv_bytes"] == predicted.draft_kv_bytes
    assert observed["output_bytes"] == predicted.output_bytes  # the draft context has its own logits
    # the runner stopped with the instance running: it stopped the server first
    await journal_reader.wait_for(of_type("instance_stopped", instance_id=ack.instance_id, reason="runner stopped"))
    assert not _servers_with(str(models["qwen35"]))


async def test_granite_hybrid_with_unified_kv_reports_kv_and_recurrent_bytes_exactly(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    """Per-layer KV head counts (1, 4, 2) make cache sizes that are no round number of MiB."""
    settings = _settings(slots=3, kv_unified=True, cache_type_k="bf16", cache_type_v="f32")
    await _put_ledger(bus, _reservation("r-granite", models["granitehybrid"], settings, 3000))
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data", binary, Node(settings)):
        ack = await _start(bus, "r-granite")
        ready = (await journal_reader.wait_for(of_type("instance_ready", instance_id=ack.instance_id), timeout=60))[0]
    predicted = _predict(models["granitehybrid"], settings, 3000)
    assert predicted.kv_bytes % (1 << 20) and predicted.recurrent_bytes % (1 << 20)
    assert (ready["observed"]["kv_bytes"], ready["observed"]["recurrent_bytes"]) == (
        predicted.kv_bytes,
        predicted.recurrent_bytes,
    )


async def test_settings_changed_after_admission_refuse_the_start_with_settings_drift(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    stamped = _settings(slots=2)
    await _put_ledger(bus, _reservation("r-drift", models["llama"], stamped, 2048))
    await _put_telemetry(bus)
    node = Node(_settings(slots=4, cache_type_k="q8_0"))  # the node was reconfigured after admission
    async with runner(bus, tmp_path / "data", binary, node):
        with pytest.raises(RemoteError) as refused:
            await _start(bus, "r-drift")
    assert refused.value.code == "settings_drift"
    assert "slots: stamped 2, now 4" in refused.value.reply.message
    event = (await journal_reader.wait_for(of_type("drift_rejected", reservation_id="r-drift")))[0]
    assert event["stage"] == "before_start"
    assert {(d["field"], d["stamped"], d["current"]) for d in event["drift"]} == {
        ("slots", "2", "4"),
        ("cache_type_k", "f16", "q8_0"),
    }
    assert not [e for e in journal_reader.events if e["type"] == "instance_starting"]


async def test_server_that_does_not_run_as_stamped_is_stopped_with_settings_drift(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    """The command line is edited after it was built (a test seam): the real server runs with -c 4096
    instead of the stamped 2048, and /props, /slots and the log say so."""

    def wrong_context(argv: tuple[str, ...]) -> list[str]:
        edited = list(argv)
        edited[edited.index("-c") + 1] = "4096"
        return edited

    settings = _settings(slots=2)
    await _put_ledger(bus, _reservation("r-props", models["llama"], settings, 2048))
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data", binary, Node(settings), rewrite=wrong_context):
        ack = await _start(bus, "r-props")
        event = (await journal_reader.wait_for(of_type("drift_rejected", instance_id=ack.instance_id), timeout=60))[0]
        status = await _status(bus, ack.instance_id)
    assert event["stage"] == "after_start"
    fields = {d["field"]: (d["stamped"], d["current"]) for d in event["drift"]}
    assert fields["props.n_ctx_per_slot"] == ("1024", "2048")
    assert fields["slots.n_ctx"] == ("1024", "2048")
    assert fields["log.n_ctx"] == ("2048", "4096")
    assert status.state == "rejected"
    assert not [e for e in journal_reader.events if e["type"] == "instance_ready"]
    assert not _servers_with(str(models["llama"]))


async def test_cli_stop_finds_the_instance_node_and_stops_it(
    bus: Bus,
    nats_server: NatsServer,
    journal_reader: JournalReader,
    models: dict[str, Path],
    binary: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = _settings(slots=1)
    await _put_ledger(bus, _reservation("r-cli", models["llama"], settings, 1024))
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data", binary, Node(settings)):
        ack = await _start(bus, "r-cli")
        await journal_reader.wait_for(of_type("instance_ready", instance_id=ack.instance_id), timeout=60)
        pid = (await _status(bus, ack.instance_id)).pid
        assert pid is not None
        flags = ["--nats", nats_server.url, "--nats-user", str(nats_server.options.user)]
        secret = tmp_path / "nats-password"
        secret.write_text(f"{nats_server.options.password}\n")  # never in argv
        flags += ["--nats-password-file", str(secret)]
        assert await run_cli("stop", ack.instance_id, "--json", *flags) == 0
        reply = json.loads(capsys.readouterr().out)
        assert (reply["instance_id"], reply["node_id"], reply["state"]) == (ack.instance_id, NODE, "stopped")
        assert not _alive(pid)


async def test_killed_server_is_restarted_and_fails_after_the_restart_limit(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    settings = _settings(slots=1)
    await _put_ledger(bus, _reservation("r-crash", models["llama"], settings, 1024))
    await _put_telemetry(bus)
    policy = RestartPolicy(max_restarts=1, window_s=300, backoff_initial_s=0.05)
    async with runner(bus, tmp_path / "data", binary, Node(settings), policy=policy):
        ack = await _start(bus, "r-crash")
        iid = ack.instance_id
        await journal_reader.wait_for(of_type("instance_ready", instance_id=iid), timeout=60)
        first = await _status(bus, iid)
        assert first.pid is not None
        os.kill(first.pid, signal.SIGKILL)

        crashed = (await journal_reader.wait_for(of_type("instance_crashed", instance_id=iid)))[0]
        assert crashed["exit_code"] == -signal.SIGKILL and crashed["restart_in_s"] == pytest.approx(0.05)
        await journal_reader.wait_for(of_type("instance_restarted", instance_id=iid, attempt=2))
        await journal_reader.wait_for(of_type("instance_ready", instance_id=iid), count=2, timeout=60)
        second = await _status(bus, iid)
        assert second.state == "ready" and second.restarts == 1 and second.pid not in (None, first.pid)
        assert second.pid is not None
        os.kill(second.pid, signal.SIGKILL)

        failed = (await journal_reader.wait_for(of_type("instance_failed", instance_id=iid)))[0]
        assert "gave up after 2 crashes" in failed["reason"]
        assert (await _status(bus, iid)).state == "failed"
        stop = await _request(bus, "stop", StopInstance(instance_id=iid))
        assert stop.state == "failed"
    crashes = [e for e in journal_reader.events if e["type"] == "instance_crashed"]
    assert [c["restart_in_s"] for c in crashes] == [pytest.approx(0.05), None]


async def test_hung_server_is_found_unresponsive_and_restarted(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    settings = _settings(slots=1)
    await _put_ledger(bus, _reservation("r-hang", models["llama"], settings, 1024))
    await _put_telemetry(bus)
    watchful = dataclasses.replace(
        FAST,
        http_timeout_s=0.5,
        timings=dataclasses.replace(
            FAST.timings, liveness_interval_s=0.2, liveness_failures=2, stop_grace_s=1, hung_grace_s=1
        ),
    )
    async with runner(bus, tmp_path / "data", binary, Node(settings), limits=watchful):
        iid = (await _start(bus, "r-hang")).instance_id
        await journal_reader.wait_for(of_type("instance_ready", instance_id=iid), timeout=60)
        hung = await _status(bus, iid)
        assert hung.pid is not None
        os.kill(hung.pid, signal.SIGSTOP)  # alive, holding its memory, answering nothing
        try:
            crashed = (await journal_reader.wait_for(of_type("instance_crashed", instance_id=iid), timeout=30))[0]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung.pid, signal.SIGCONT)
        assert crashed["reason"].startswith("stopped answering /health")
        await journal_reader.wait_for(of_type("instance_ready", instance_id=iid), count=2, timeout=60)
        again = await _status(bus, iid)
        assert again.state == "ready" and again.pid not in (None, hung.pid)
        assert not _alive(hung.pid)


async def test_start_refusals_are_clear_errors(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    settings = _settings(slots=2)
    # a split's head part, on a runner without the cluster's certificates (it cannot reach the members)
    other = _reservation("r-multi", models["llama"], settings, 2048, multi_node=True)
    split_stamp = msgspec.structs.replace(other.stamp, rpc=(RpcMember(node_id="m", layers=(1, 2)),))
    other = msgspec.structs.replace(other, stamp=split_stamp, split=SplitPart(head=NODE, members=("m",)))
    # claimed by another instance; its expiry (placement's clock) passed, which the runner never compares
    taken = msgspec.structs.replace(
        _reservation("r-taken", models["llama"], settings, 2048), state="starting", instance_id="i-other"
    )
    taken = msgspec.structs.replace(taken, expires_at=time.time() - 3600)
    need = _predict(models["llama"], settings, 2048).total_bytes
    # the node has one byte less than this model plus what the other two reservations hold (the one past
    # its expiry included: only placement expires reservations)
    await _put_telemetry(bus, usable=need + other.held["CPU"] + taken.held["CPU"] - 1)
    async with runner(bus, tmp_path / "data", binary, Node(settings)):
        with pytest.raises(RemoteError) as unknown:
            await _start(bus, "r-nope")
        assert unknown.value.code == "not_found" and "r-nope" in unknown.value.reply.message
        # Written once the runner runs: a claim found at its start would be its predecessor's (released then).
        await _put_ledger(bus, other, _reservation("r-big", models["llama"], settings, 2048), taken)

        for payload in (b'{"reservation": "r-big"}', b"not json", b'{"reservation_id": 7}'):
            with pytest.raises(RemoteError) as malformed:
                subject = SUBJECTS.runner(NODE, "start")
                parse_reply(subject, await bus.request_raw(subject, payload, timeout=10), RunnerAck)
            assert malformed.value.code == "bad_request"

        with pytest.raises(RemoteError) as multi:
            await _start(bus, "r-multi")
        assert multi.value.code == "unsupported" and "cannot head a split" in multi.value.reply.message

        with pytest.raises(RemoteError) as big:
            await _start(bus, "r-big")
        assert big.value.code == "insufficient_memory"
        assert big.value.reply.details == {"need_bytes": {"CPU": need}, "have_bytes": {"CPU": need - 1}}

        with pytest.raises(RemoteError) as claimed:
            await _start(bus, "r-taken")
        assert claimed.value.code == "reservation_state" and "starting, not reserved" in claimed.value.reply.message

        await (await buckets.nodes(bus, SUBJECTS)).delete(NODE)  # the node's telemetry is gone
        with pytest.raises(RemoteError) as stale:
            await _start(bus, "r-big")
        assert stale.value.code == "telemetry_stale"

        with pytest.raises(RemoteError) as stop_unknown:
            await _request(bus, "stop", StopInstance(instance_id="nope"))
        assert stop_unknown.value.code == "not_found"
    refused = (await journal_reader.wait_for(of_type("instance_refused", reservation_id="r-big"), count=2))[0]
    assert (refused["need_bytes"], refused["have_bytes"]) == ({"CPU": need}, {"CPU": need - 1})
    # A refusal that makes the reservation unusable is journaled too, so placement releases its memory.
    (multi_refused,) = await journal_reader.wait_for(of_type("instance_refused", reservation_id="r-multi"))
    assert multi_refused["message"].startswith("unsupported:")
    assert not [e for e in journal_reader.events if e["type"] == "instance_starting"]


async def test_registry_admitted_files_are_found_in_the_models_dir_and_checked_by_digest(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    settings = _settings(slots=1)
    data_dir = tmp_path / "data"
    (data_dir / "models").mkdir(parents=True)
    shutil.copy(models["llama"], data_dir / "models" / "named.gguf")
    digest = blake3.blake3(models["llama"].read_bytes()).hexdigest()
    # A registry-only admission names the file; the runner finds it in its models dir and checks the digest.
    named = msgspec.structs.replace(
        _reservation("r-named", models["llama"], settings, 512), model_path="named.gguf", model_digest=digest
    )
    forged = msgspec.structs.replace(
        _reservation("r-forged", models["llama"], settings, 512), model_digest="0" * 64
    )  # admitted from an entry whose digest this file does not have
    await _put_ledger(bus, named, forged)
    await _put_telemetry(bus)
    async with runner(bus, data_dir, binary, Node(settings)):
        with pytest.raises(RemoteError) as mismatch:
            await _start(bus, "r-forged")
        iid = (await _start(bus, "r-named")).instance_id
        await journal_reader.wait_for(of_type("instance_ready", instance_id=iid), timeout=60)
        assert str(data_dir / "models" / "named.gguf") in (await _status(bus, iid)).model_path
        await _request(bus, "stop", StopInstance(instance_id=iid))
    assert mismatch.value.code == "model_mismatch" and "not the file admission was made for" in str(mismatch.value)
    (refused,) = await journal_reader.wait_for(of_type("instance_refused", reservation_id="r-forged"))
    assert refused["message"].startswith("model_mismatch:")


async def test_a_failing_driver_ends_its_instance_only_and_the_others_keep_serving(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    """An exception escaping one instance's driver (here injected when its server is verified) reaps that
    server and ends that instance `failed`; before, it crashed the runner and reaped every instance."""

    def fault(reservation_id: str, event: Event) -> None:
        if reservation_id == "r-bad" and isinstance(event, Verified):
            raise RuntimeError("injected driver fault")

    settings = _settings(slots=1)
    await _put_ledger(
        bus,
        _reservation("r-good", models["llama"], settings, 512),
        _reservation("r-bad", models["llama"], settings, 512),
    )
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data", binary, Node(settings), fault=fault):
        good = await _start(bus, "r-good")
        await journal_reader.wait_for(of_type("instance_ready", instance_id=good.instance_id), timeout=60)
        bad = await _start(bus, "r-bad")
        starting = (await journal_reader.wait_for(of_type("instance_starting", instance_id=bad.instance_id)))[0]
        failed = (await journal_reader.wait_for(of_type("instance_failed", instance_id=bad.instance_id), timeout=60))[0]
        assert "RuntimeError: injected driver fault" in failed["reason"]
        record = await _status(bus, bad.instance_id)
        assert record.state == "failed" and "injected driver fault" in record.message
        assert not _servers_with(f"--port {bad.port}") and bad.port == starting["port"]

        assert good.port is not None
        assert (await call_server(good.port, "GET", "/health", timeout_s=10)).status == 200
        assert (await _status(bus, good.instance_id)).state == "ready"
        # the runner keeps serving: the same incarnation answers and stops the good one
        stopped = await _request(bus, "stop", StopInstance(instance_id=good.instance_id))
        assert stopped.state == "stopped"
        await journal_reader.wait_for(of_type("instance_stopped", instance_id=good.instance_id))
    assert not [e for e in journal_reader.events if e["type"] in ("actor_crashed", "actor_restarted")]
    said = [e["type"] for e in journal_reader.events if e.get("instance_id") == bad.instance_id]
    assert "instance_stopped" not in said and said.count("instance_failed") == 1


@dataclass
class Unkillable:
    """Drops SIGKILL (and SIGTERM) to one reservation's server while `holding`: a server that does not die."""

    reservation_id: str
    holding: bool = True

    def __call__(self, reservation_id: str, sig: signal.Signals) -> bool:
        return not (self.holding and reservation_id == self.reservation_id)


STUBBORN = dataclasses.replace(
    FAST, timings=dataclasses.replace(FAST.timings, stop_grace_s=0.3, kill_grace_s=0.3, kill_retry_s=0.2)
)


async def test_a_server_that_survives_sigkill_is_reported_stuck_and_stopped_only_once_it_is_gone(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    """Before, the instance was reported gone (and its memory released) while the process could live on."""
    settings = _settings(slots=1)
    await _put_ledger(bus, _reservation("r-stuck", models["llama"], settings, 512))
    await _put_telemetry(bus)
    unkillable = Unkillable("r-stuck")
    async with runner(bus, tmp_path / "data", binary, Node(settings), limits=STUBBORN, signal_filter=unkillable):
        iid = (await _start(bus, "r-stuck")).instance_id
        await journal_reader.wait_for(of_type("instance_ready", instance_id=iid), timeout=60)
        pid = (await _status(bus, iid)).pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # and it ignores SIGTERM, too
        try:
            ack = await _request(bus, "stop", StopInstance(instance_id=iid))
            assert ack.state == "stuck" and "did not exit" in ack.message
            record = await _status(bus, iid)
            assert (record.state, record.pid) == ("stuck", pid) and _alive(pid)
            assert not [e for e in journal_reader.events if e["type"] == "instance_stopped"]
            unkillable.holding = False  # the kernel lets it go: the next SIGKILL reaps it
            (stopped,) = await journal_reader.wait_for(of_type("instance_stopped", instance_id=iid), timeout=30)
            assert not _alive(pid)
            assert stopped["reason"] == "stop requested"
            assert (await _status(bus, iid)).state == "stopped"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_a_runner_that_stops_with_a_stuck_server_reports_nothing_final(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    settings = _settings(slots=1)
    await _put_ledger(bus, _reservation("r-left", models["llama"], settings, 512))
    await _put_telemetry(bus)
    pid = None
    try:
        async with runner(
            bus, tmp_path / "data", binary, Node(settings), limits=STUBBORN, signal_filter=Unkillable("r-left")
        ):
            iid = (await _start(bus, "r-left")).instance_id
            await journal_reader.wait_for(of_type("instance_ready", instance_id=iid), timeout=60)
            pid = (await _status(bus, iid)).pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
        # the runner is gone; the journal has everything it said (its actor_stopped is the last word)
        await journal_reader.wait_for(of_type("actor_stopped", actor="runner"))
        said = [e["type"] for e in journal_reader.events if e.get("instance_id") == iid]
        assert "instance_stopped" not in said and "instance_failed" not in said
        assert _alive(pid)
        record = await _status(bus, iid)
        assert record.state == "stuck" and record.pid == pid
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await _wait_gone(pid)


_HOST = """
import asyncio, json, sys
from pathlib import Path
import msgspec
from actors.runner.actor import RunnerActor
from messages.settings import ServingSettings
from messages.subjects import Subjects
from runtime.actor import Supervisor
from runtime.bus import Bus
from runtime.config import NatsOptions
from runtime.journal import Journal

async def main():
    cfg = json.loads(sys.argv[1])
    options = NatsOptions(urls=(cfg["url"],), user=cfg["user"], password=cfg["password"])
    bus = await Bus.connect(options, name="runner-host")
    settings = msgspec.convert(cfg["settings"], ServingSettings)
    actor = RunnerActor(cfg["node"], Path(cfg["data_dir"]), Path(cfg["engine"]), lambda: settings)
    journal = Journal(bus, Subjects(), cfg["node"])
    supervisor = Supervisor(bus=bus, journal=journal, subjects=Subjects(), node_id=cfg["node"])
    async with asyncio.TaskGroup() as tg:
        tg.create_task(journal.run())
        tg.create_task(supervisor.run([actor]))

asyncio.run(main())
"""


async def test_killing_the_runner_process_leaves_no_llama_server(
    bus: Bus,
    nats_server: NatsServer,
    journal_reader: JournalReader,
    models: dict[str, Path],
    binary: str,
    tmp_path: Path,
) -> None:
    model = tmp_path / "orphan-check.gguf"  # a path of its own, to find exactly this test's servers
    model.write_bytes(models["llama"].read_bytes())
    settings = _settings(slots=1)
    await _put_ledger(bus, _reservation("r-orphan", model, settings, 1024))
    await _put_telemetry(bus)
    options = nats_server.options
    config = {
        "url": options.urls[0],
        "user": options.user,
        "password": options.password,
        "settings": msgspec.to_builtins(settings),
        "node": NODE,
        "data_dir": str(tmp_path / "data"),
        "engine": binary,
    }
    host = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOST, json.dumps(config), stdin=subprocess.DEVNULL, cwd=Path(__file__).parents[2]
    )
    try:
        ack = await _start(bus, "r-orphan")
        await journal_reader.wait_for(of_type("instance_ready", instance_id=ack.instance_id), timeout=60)
        pid = (await _status(bus, ack.instance_id)).pid
        assert pid is not None and _servers_with(str(model)) == [pid]
        host.kill()
        await host.wait()
        await _wait_gone(pid)
        assert _servers_with(str(model)) == []
    finally:
        if host.returncode is None:
            host.kill()
            await host.wait()
        for leftover in _servers_with(str(model)):  # never leave one behind, even when the test fails
            os.kill(leftover, signal.SIGKILL)


async def test_a_ready_idle_server_is_probed_with_real_completions_and_a_busy_one_is_left_alone(
    bus: Bus, journal_reader: JournalReader, models: dict[str, Path], binary: str, tmp_path: Path
) -> None:
    settings = _settings(slots=1)
    # Slow enough (about 100 tokens/s here) that probes fall due during one generation; a large vocabulary keeps
    # random weights from sampling the end of text early.
    slow = tiny_models.write_llama(tmp_path / "slow.gguf", n_layer=12, n_embd=512, n_head=8, n_head_kv=4, n_ff=2048,
                                   n_vocab=32000)  # fmt: skip
    await _put_ledger(bus, _reservation("r-probe", slow, settings, 4096))
    await _put_telemetry(bus)
    probing = dataclasses.replace(
        FAST,
        probe_interval_s=0.3,
        probe_timeout_s=0.5,  # a probe queued behind a long generation would fail: none may be sent then
        timings=dataclasses.replace(FAST.timings, liveness_interval_s=0.1, liveness_failures=2),
    )
    async with runner(bus, tmp_path / "data", binary, Node(settings), limits=probing):
        iid = (await _start(bus, "r-probe")).instance_id
        await journal_reader.wait_for(of_type("instance_ready", instance_id=iid), timeout=60)
        log = tmp_path / "data" / "runner" / iid / "llama-server.log"

        def launched() -> int:
            return log.read_text(errors="replace").count("launch_slot_")

        before = launched()
        await asyncio.sleep(1.5)
        assert launched() >= before + 2  # idle: probes ran (a real one-token completion each)
        # Busy: a long generation through the runner on the one slot; no probe may queue behind it.
        order = RunnerGenerate(
            request=GenerateRequest(model=iid, prompt="go on", n_predict=300, capture=False, timeout_s=120),
            request_id="long-one",
            instance_id=iid,
        )
        result = await bus.request(SUBJECTS.runner(NODE, "generate"), order, GenerateResult, timeout=150)
        assert result.tokens_generated > 100 and result.total_ms > 1000, result  # long enough for probes to fall due
        assert (await _status(bus, iid)).restarts == 0
        assert not [e for e in journal_reader.events if e.get("type") == "instance_crashed"]
