"""The runner's start path against a real nats-server, with ledgers written as a (hostile) peer would.

No llama-server here: every start is refused before a spawn, or the "engine" is a small Python script
(through the `rewrite_command` seam), since what is tested is the runner's own reading, claiming and
answering. Each test writes the node's ledger and telemetry directly into the buckets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import blake3
import msgspec
import pytest

from actors.runner.actor import RunnerActor, RunnerLimits
from actors.runner.serving import Serving, ServingLimits
from messages.placement import NodeLedger
from messages.runner import StopInstance
from runtime import buckets
from runtime.bus import Bus, RemoteError, decode
from runtime.children import dying_with_parent
from runtime.model_files import FileDigests
from tests import tiny_models
from tests.conftest import JournalReader, of_type, supervised
from tests.harness.runner import (
    NODE,
    QUICK,
    SLEEPER,
    SUBJECTS,
    _put_ledger,
    _put_telemetry,
    _request,
    _reservation,
    _settings,
    _start,
    _status,
)

SETTINGS = _settings(slots=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.write_llama(tmp_path_factory.mktemp("admission") / "llama.gguf", n_layer=2, n_vocab=300)


@pytest.fixture(scope="module")
def model_digest(model: Path) -> str:
    return str(blake3.blake3(model.read_bytes()).hexdigest())


@contextlib.asynccontextmanager
async def runner(
    bus: Bus, data_dir: Path, *, digests: FileDigests | None = None, limits: RunnerLimits = QUICK
) -> AsyncIterator[RunnerActor]:
    actor = RunnerActor(
        NODE,
        data_dir,
        Path(sys.executable),  # never run as is: the rewrite below replaces the command
        lambda: SETTINGS,
        limits=limits,
        rewrite_command=lambda argv: SLEEPER,
        digests=digests,
    )
    async with supervised(bus, [actor], node_id=NODE):
        yield actor


async def _ledger(bus: Bus) -> NodeLedger:
    entry = await (await buckets.reservations(bus, SUBJECTS)).get(f"node.{NODE}")
    assert entry.value
    return decode(entry.value, NodeLedger)


# --- hostile model paths -------------------------------------------------------------------------------------


async def test_hostile_model_paths_from_a_ledger_are_refused_as_unreadable_and_the_runner_keeps_serving(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path
) -> None:
    """NUL byte, FIFO (whose open would block forever), directory, device, 200 KB name, `../` and a symlink
    out of the models dir, a file that is not GGUF: each a `model_unreadable` refusal with the event that
    releases the memory, never an exception (before: a crash of the actor, or a start that never answered)."""
    data_dir = tmp_path / "data"
    models_dir = data_dir / "models"
    models_dir.mkdir(parents=True)
    outside = tmp_path / "outside.gguf"
    shutil.copyfile(model, outside)  # a valid model, but not inside the models dir
    (models_dir / "link.gguf").symlink_to(outside)
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"not a model at all")
    hostile = {
        "r-nul": f"{model}\x00.gguf",
        "r-fifo": str(fifo),
        "r-dir": str(tmp_path),
        "r-device": "/dev/zero",
        "r-long": "m" * 200_000,
        "r-escape": "../../outside.gguf",
        "r-link": "link.gguf",
        "r-notgguf": str(not_gguf),
    }
    reservations = [
        msgspec.structs.replace(_reservation(rid, model, SETTINGS, 512), model_path=path)
        for rid, path in hostile.items()
    ]
    await _put_ledger(bus, *reservations, _reservation("r-fine", model, SETTINGS, 512))
    await _put_telemetry(bus)
    async with runner(bus, data_dir):
        for rid in hostile:
            with pytest.raises(RemoteError) as refused:
                await _start(bus, rid)
            assert refused.value.code == "model_unreadable", (rid, refused.value.reply.message)
            assert len(refused.value.reply.message) < 1000  # a 200 KB name is not echoed whole
        # still serving, with the same incarnation: a good reservation starts
        ack = await _start(bus, "r-fine")
        assert ack.state == "starting"
        await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))
    for rid in hostile:
        (event,) = await journal_reader.wait_for(of_type("instance_refused", reservation_id=rid))
        assert event["message"].startswith("model_unreadable:")
    refusals = [e for e in journal_reader.events if e["type"] == "instance_refused"]
    messages: dict[str, str] = {e["reservation_id"]: e["message"] for e in refusals}
    assert "NUL" in messages["r-nul"] and "longer than" in messages["r-long"]
    assert "leaves the models dir" in messages["r-escape"] and "leaves the models dir" in messages["r-link"]
    assert "not a regular file" in messages["r-fifo"] and "directory" in messages["r-dir"]
    assert not [e for e in journal_reader.events if e["type"] in ("actor_crashed", "actor_restarted")]


# --- the claim -----------------------------------------------------------------------------------------------


async def test_start_claims_the_reservation_on_the_ledger_and_a_second_start_is_the_same_instance(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path
) -> None:
    other = _reservation("r-other", model, SETTINGS, 512)
    await _put_ledger(bus, _reservation("r-claim", model, SETTINGS, 512), other)
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data"):
        ack = await _start(bus, "r-claim")
        ledger = await _ledger(bus)
        claimed = {r.reservation_id: r for r in ledger.reservations}
        assert (claimed["r-claim"].state, claimed["r-claim"].instance_id) == ("starting", ack.instance_id)
        assert claimed["r-other"] == other  # the rest of the ledger is untouched
        again = await _start(bus, "r-claim")
        assert (again.instance_id, again.message) == (ack.instance_id, "already started")
        record = await _status(bus, ack.instance_id)
        assert (record.reservation_id, record.state) == ("r-claim", "starting")
        stopped = await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))
        assert stopped.state == "stopped"
        assert (await _status(bus, ack.instance_id)).state == "stopped"


async def test_a_reservation_claimed_by_another_instance_is_refused_and_left_alone(
    bus: Bus, journal_reader: JournalReader, model: Path, tmp_path: Path
) -> None:
    taken = msgspec.structs.replace(
        _reservation("r-taken", model, SETTINGS, 512), state="starting", instance_id="someone-else"
    )
    await _put_telemetry(bus)
    async with runner(bus, tmp_path / "data"):
        # Claimed once this runner runs (a claim found at its start is its predecessor's, and released then).
        with pytest.raises(RemoteError) as absent:
            await _start(bus, "r-taken")
        assert absent.value.code == "not_found"
        await _put_ledger(bus, taken)
        with pytest.raises(RemoteError) as refused:
            await _start(bus, "r-taken")
    assert refused.value.code == "reservation_state"
    assert (await _ledger(bus)).reservations == (taken,)
    assert not [e for e in journal_reader.events if e.get("reservation_id") == "r-taken"]


# --- blocking file work stays off the event loop -------------------------------------------------------------


class SlowDisk(FileDigests):
    """Hashing that takes as long as the test wants (a huge file on a slow disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def digest(self, path: Path) -> str:
        self.calls += 1
        self.started.set()
        self.release.wait(60)
        return super().digest(path)


async def test_a_ledger_changed_during_the_checks_is_read_again_and_the_memory_checked_against_it(
    bus: Bus, journal_reader: JournalReader, model: Path, model_digest: str, tmp_path: Path
) -> None:
    """Placement books another reservation on this node while the runner hashes the model: the claim's
    compare-and-set fails on the revision the runner read, so it reads the ledger again and finds that the
    model no longer fits. The memory check and the claim always see the same ledger."""
    signed = msgspec.structs.replace(_reservation("r-late", model, SETTINGS, 512), model_digest=model_digest)
    need = signed.held["CPU"]
    await _put_ledger(bus, signed)
    await _put_telemetry(bus, usable=need + need // 2)  # fits alone, not beside a second one
    disk = SlowDisk()
    async with runner(bus, tmp_path / "data", digests=disk):
        start = asyncio.create_task(_start(bus, "r-late"))
        assert await asyncio.to_thread(disk.started.wait, 30)  # the ledger was read; the hash runs
        rival = _reservation("r-rival", model, SETTINGS, 512)
        await _put_ledger(bus, signed, rival)
        disk.release.set()
        with pytest.raises(RemoteError) as refused:
            await start
    assert refused.value.code == "insufficient_memory"
    assert refused.value.reply.details["have_bytes"] == {"CPU": need // 2}
    ledger = await _ledger(bus)
    assert ledger.reservations == (signed, rival)  # nothing claimed, nothing lost
    (event,) = await journal_reader.wait_for(of_type("instance_refused", reservation_id="r-late"))
    assert event["have_bytes"] == {"CPU": need // 2}


async def test_a_ledger_changed_during_the_checks_is_claimed_on_its_new_revision(
    bus: Bus, model: Path, model_digest: str, tmp_path: Path
) -> None:
    signed = msgspec.structs.replace(_reservation("r-cas", model, SETTINGS, 512), model_digest=model_digest)
    await _put_ledger(bus, signed)
    await _put_telemetry(bus)
    disk = SlowDisk()
    async with runner(bus, tmp_path / "data", digests=disk):
        start = asyncio.create_task(_start(bus, "r-cas"))
        assert await asyncio.to_thread(disk.started.wait, 30)
        rival = _reservation("r-rival", model, SETTINGS, 512)
        await _put_ledger(bus, signed, rival)
        disk.release.set()
        ack = await start
        ledger = {r.reservation_id: r for r in (await _ledger(bus)).reservations}
        assert (ledger["r-cas"].state, ledger["r-cas"].instance_id) == ("starting", ack.instance_id)
        assert ledger["r-rival"] == rival  # the other writer's booking survives the claim
        await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))


async def test_a_slow_digest_answers_retry_within_the_budget_keeps_hashing_and_the_retry_uses_it(
    bus: Bus, journal_reader: JournalReader, model: Path, model_digest: str, tmp_path: Path
) -> None:
    digest = model_digest
    signed = msgspec.structs.replace(_reservation("r-signed", model, SETTINGS, 512), model_digest=digest)
    await _put_ledger(bus, signed)
    await _put_telemetry(bus)
    disk = SlowDisk()
    budget = dataclasses.replace(QUICK, file_budget_s=0.5)
    async with runner(bus, tmp_path / "data", digests=disk, limits=budget):
        with pytest.raises(RemoteError) as pending:
            await _start(bus, "r-signed")
        assert pending.value.code == "unavailable" and "still being computed" in pending.value.reply.message
        # the runner answers other requests while the hash runs (the loop is not blocked)
        with pytest.raises(RemoteError) as unknown:
            await _request(bus, "stop", StopInstance(instance_id="nope"))
        assert unknown.value.code == "not_found"
        with pytest.raises(RemoteError) as again:  # a retry while it runs waits for the same hash
            await _start(bus, "r-signed")
        assert again.value.code == "unavailable" and disk.calls == 1
        disk.release.set()
        async with asyncio.timeout(30):
            while True:
                try:
                    ack = await _start(bus, "r-signed")
                    break
                except RemoteError as exc:
                    assert exc.code == "unavailable"
        assert ack.state == "starting"
        await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))
    assert not [e for e in journal_reader.events if e["type"] == "instance_refused"]


# --- the parent-death wrapper --------------------------------------------------------------------------------


async def test_the_exec_wrapper_refuses_to_run_the_server_when_its_parent_is_already_gone(tmp_path: Path) -> None:
    """The parent died before the parent-death signal was armed: nobody would ever kill the server, so the
    wrapper exits (70) instead of exec'ing it. A parent that is gone is a parent pid that is not ours."""
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()
    marker = tmp_path / "ran"
    program = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    wrapped = await asyncio.create_subprocess_exec(*dying_with_parent(program, signal.SIGKILL, gone.pid))
    assert await wrapped.wait() == 70
    assert not marker.exists()
    ours = await asyncio.create_subprocess_exec(*dying_with_parent(program, signal.SIGKILL, os.getpid()))
    assert await ours.wait() == 0 and marker.exists()


# --- the serving report ----------------------------------------------------------------------------------------


async def test_an_instances_change_reaches_the_serving_report_at_once_and_an_idle_runner_does_not_poll(
    bus: Bus, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The serving loop waits on changes: it looked every 0.1 s, and published only load changes or every
    # report_interval_s (here a minute), so a starting or stopping instance waited for the next look at best.
    syncs: list[int] = []
    sync = RunnerActor._sync_serving

    def counted(self: RunnerActor, serving: Serving) -> None:
        syncs.append(1)
        sync(self, serving)

    monkeypatch.setattr(RunnerActor, "_sync_serving", counted)
    await _put_ledger(bus, _reservation("r-report", model, SETTINGS, 512))
    await _put_telemetry(bus)
    reports = await bus.nc.subscribe(SUBJECTS.serving(NODE))
    actor = RunnerActor(
        NODE, tmp_path / "data", Path(sys.executable), lambda: SETTINGS, limits=QUICK,
        rewrite_command=lambda argv: SLEEPER, serving_limits=ServingLimits(report_interval_s=60.0),
    )  # fmt: skip
    async with supervised(bus, [actor], node_id=NODE):
        await reports.next_msg(timeout=10)  # the first report, at start
        ack = await _start(bus, "r-report")
        await reports.next_msg(timeout=10)  # the instance is starting
        stopped = await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))
        assert stopped.state == "stopped"
        await reports.next_msg(timeout=10)  # and gone
        # A sync per change (the start, the spawn, the digest hashed, the stop, the driver's end), not ten a
        # second: the generous bound holds on a loaded machine, where the old loop looked dozens of times.
        assert len(syncs) <= 12, len(syncs)
    await reports.unsubscribe()
