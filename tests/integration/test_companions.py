"""Companion files (a draft model, a multimodal projector) through placement and the runner on a real
nats-server.

Placement reads a request's draft and projector like its model (hostile names refused the same way, with the
companion's role named), stamps each with its blake3 and journals its geometry; the runner starts only the
files admission read (another digest is `model_mismatch`) and pins them on the command line it runs.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import blake3
import msgspec
import pytest

from actors.placement.actor import PlacementActor
from actors.runner.actor import RunnerActor
from messages.placement import Companion, PlacementRequest, Reservation
from messages.runner import StopInstance
from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import HostInfo, LlamaServerInfo, NodeResources
from runtime.bus import Bus, RemoteError
from tests.conftest import JournalReader, of_type, put_telemetry, supervised
from tests.harness.placement import GIB, ledger, place, wait_view
from tests.harness.runner import NODE, QUICK, SLEEPER, _put_ledger, _put_telemetry, _request, _reservation, _start
from tests.tiny_models import write_llama
from tests.tiny_projectors import write_llava_projector

DRAFTING = ServingSettings(slots=2, spec_type="draft-simple", cache_ram_mib=0, ctx_checkpoints=0)


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    write_llama(root / "model.gguf", n_layer=4, n_embd=256, n_head=8, n_ff=512, n_vocab=600)
    write_llama(root / "draft.gguf", n_layer=2, n_embd=128, n_head=2, n_head_kv=1, n_ff=256, n_vocab=600)
    (root / "notes.gguf").write_bytes(b"not a model at all")
    write_llava_projector(root / "mmproj.gguf", text_embd=256)  # the model's width
    write_llava_projector(root / "narrow-mmproj.gguf", text_embd=128)
    write_llama(tmp_path / "outside.gguf", n_layer=2, n_vocab=600)  # a real draft the client must not reach
    return root


def _report(node_id: str) -> NodeResources:
    now = time.time()
    return NodeResources(
        node_id=node_id, seq=1, sent_at=now, started_at=now - 60, ttl_s=600,
        host=HostInfo(ram_total_bytes=64 * GIB, ram_available_bytes=8 * GIB, usable_bytes=8 * GIB, cpu_count=2),
        llama_server=LlamaServerInfo(path="llama-server", version="test", build_info=""),
        settings=ServingSettings(cache_ram_mib=0, ctx_checkpoints=0), bounds=SettingsBounds(),
    )  # fmt: skip


def _ask(draft: str) -> PlacementRequest:
    raw = {"model": {"path": "model.gguf", "draft": draft}, "ctx": 4096, "settings": {"spec_type": "draft-simple"}}
    return msgspec.convert(raw, PlacementRequest)


async def test_placement_reads_stamps_and_journals_a_draft_and_refuses_one_it_may_not_read(
    bus: Bus, models_dir: Path, tmp_path: Path, journal_reader: JournalReader
) -> None:
    actor = PlacementActor(models_dir=models_dir, model_roots=())
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, _report("a"))
        await wait_view(actor, "a")
        decision = await place(bus, _ask("draft.gguf"))
        assert decision.admitted and decision.stamp is not None, decision.message
        digest = blake3.blake3((models_dir / "draft.gguf").read_bytes()).hexdigest()
        assert decision.stamp.draft == Companion(path="draft.gguf", digest=digest)
        (reservation,) = (await ledger(bus, "a")).reservations
        assert reservation.stamp.draft == decision.stamp.draft
        assert decision.placements[0].breakdown.draft_weights_bytes > 0
        (event,) = await journal_reader.wait_for(of_type("placement_decided"))
        assert event["draft_geometry"]["n_layer"] == 2  # replay sizes the draft it recorded

        refusals = {
            "../outside.gguf": "leaves the models dir",
            str(tmp_path / "outside.gguf"): "not in this node's model directories",
            "notes.gguf": "not a GGUF file",
            "missing.gguf": "cannot read",
        }
        for draft, needle in refusals.items():
            refused = await place(bus, _ask(draft), fit=True)
            assert not refused.admitted and refused.reason == "model_unreadable", (draft, refused)
            assert refused.message.startswith("draft: ") and needle in refused.message, (draft, refused.message)
        # still serving
        assert (await place(bus, _ask("draft.gguf"), fit=True)).admitted


def _projecting(mmproj: str) -> PlacementRequest:
    return msgspec.convert({"model": {"path": "model.gguf", "mmproj": mmproj}, "ctx": 4096}, PlacementRequest)


async def test_placement_reads_stamps_and_journals_a_projector_and_refuses_one_it_cannot_size(
    bus: Bus, models_dir: Path, journal_reader: JournalReader
) -> None:
    actor = PlacementActor(models_dir=models_dir, model_roots=())
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, _report("a"))
        await wait_view(actor, "a")
        decision = await place(bus, _projecting("mmproj.gguf"))
        assert decision.admitted and decision.stamp is not None, decision.message
        digest = blake3.blake3((models_dir / "mmproj.gguf").read_bytes()).hexdigest()
        assert decision.stamp.mmproj == Companion(path="mmproj.gguf", digest=digest)
        (reservation,) = (await ledger(bus, "a")).reservations
        assert reservation.stamp.mmproj == decision.stamp.mmproj
        breakdown = decision.placements[0].breakdown
        assert breakdown.projector_weights_bytes > 0 and breakdown.projector_compute_bytes > 0
        (event,) = await journal_reader.wait_for(of_type("placement_decided"))
        assert event["projector_geometry"]["n_mmproj_embd"] == 256  # replay sizes the projector it recorded

        refusals = {
            "draft.gguf": ("model_unreadable", "architecture is 'clip'"),  # a model is not a projector
            "notes.gguf": ("model_unreadable", "not a GGUF file"),
            "../outside.gguf": ("model_unreadable", "leaves the models dir"),
        }
        for mmproj, (reason, needle) in refusals.items():
            refused = await place(bus, _projecting(mmproj), fit=True)
            assert not refused.admitted and refused.reason == reason, (mmproj, refused)
            assert refused.message.startswith("mmproj: ") and needle in refused.message, (mmproj, refused.message)
        # a projector whose embeddings are not the model's width: llama-server refuses the pair, so does admission
        refused = await place(bus, _projecting("narrow-mmproj.gguf"), fit=True)
        assert refused.reason == "unsupported_settings", refused
        (node,) = refused.rejections
        assert node.message.startswith("mmproj: ") and "128 wide, the model's 256" in node.message, node
        assert (await place(bus, _projecting("mmproj.gguf"), fit=True)).admitted


@contextlib.asynccontextmanager
async def _runner(
    bus: Bus, data_dir: Path, commands: list[tuple[str, ...]], settings: ServingSettings = DRAFTING
) -> AsyncIterator[RunnerActor]:
    def rewrite(argv: tuple[str, ...]) -> tuple[str, ...]:
        commands.append(argv)
        return SLEEPER

    actor = RunnerActor(NODE, data_dir, Path(sys.executable), lambda: settings, limits=QUICK, rewrite_command=rewrite)
    async with supervised(bus, [actor], node_id=NODE):
        yield actor


async def test_the_runner_starts_only_the_draft_file_admission_read_and_pins_it(
    bus: Bus, tmp_path: Path, journal_reader: JournalReader
) -> None:
    data_dir = tmp_path / "data"
    models_dir = data_dir / "models"
    models_dir.mkdir(parents=True)
    model = write_llama(models_dir / "model.gguf", n_layer=2, n_vocab=600)
    draft = write_llama(models_dir / "draft.gguf", n_layer=1, n_vocab=600)
    digest = blake3.blake3(draft.read_bytes()).hexdigest()

    def drafted(rid: str, stamped: Companion) -> Reservation:
        # held as the model alone would be: the runner re-sizes it with its draft before the claim
        plain = _reservation(rid, model, msgspec.structs.replace(DRAFTING, spec_type="none"), 1024)
        return msgspec.structs.replace(
            plain, stamp=msgspec.structs.replace(plain.stamp, settings=DRAFTING, draft=stamped)
        )

    await _put_ledger(
        bus,
        drafted("r-changed", Companion(path="draft.gguf", digest="0" * 64)),  # the file changed since admission
        drafted("r-good", Companion(path="draft.gguf", digest=digest)),
    )
    await _put_telemetry(bus)
    commands: list[tuple[str, ...]] = []
    async with _runner(bus, data_dir, commands):
        with pytest.raises(RemoteError) as refused:
            await _start(bus, "r-changed")
        assert refused.value.code == "model_mismatch", refused.value.reply.message
        ack = await _start(bus, "r-good")
        assert ack.state == "starting"
        await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))
    (command,) = commands
    assert command[command.index("--model-draft") + 1] == str(draft.resolve())  # resolved in the models dir
    assert command[command.index("-ngld") + 1] == "0"
    (event,) = await journal_reader.wait_for(of_type("instance_refused", reservation_id="r-changed"))
    assert event["message"].startswith("model_mismatch:")
    shutil.rmtree(models_dir)


async def test_the_runner_starts_only_the_projector_admission_read_and_pins_it(
    bus: Bus, tmp_path: Path, journal_reader: JournalReader
) -> None:
    data_dir = tmp_path / "data"
    models_dir = data_dir / "models"
    models_dir.mkdir(parents=True)
    model = write_llama(models_dir / "model.gguf", n_layer=2, n_vocab=600)
    mmproj = write_llava_projector(models_dir / "mmproj.gguf", text_embd=64)
    digest = blake3.blake3(mmproj.read_bytes()).hexdigest()
    plain = msgspec.structs.replace(DRAFTING, spec_type="none")

    def projecting(rid: str, stamped: Companion) -> Reservation:
        # held as the model alone would be: the runner re-sizes it with its projector before the claim
        reservation = _reservation(rid, model, plain, 1024)
        return msgspec.structs.replace(reservation, stamp=msgspec.structs.replace(reservation.stamp, mmproj=stamped))

    await _put_ledger(
        bus,
        projecting("r-changed", Companion(path="mmproj.gguf", digest="0" * 64)),  # the file changed since admission
        projecting("r-good", Companion(path="mmproj.gguf", digest=digest)),
    )
    await _put_telemetry(bus)
    commands: list[tuple[str, ...]] = []
    async with _runner(bus, data_dir, commands, plain):
        with pytest.raises(RemoteError) as refused:
            await _start(bus, "r-changed")
        assert refused.value.code == "model_mismatch", refused.value.reply.message
        ack = await _start(bus, "r-good")
        assert ack.state == "starting"
        await _request(bus, "stop", StopInstance(instance_id=ack.instance_id))
    (command,) = commands
    assert command[command.index("--mmproj") + 1] == str(mmproj.resolve())  # resolved in the models dir
    assert "--no-mmproj-offload" in command  # a node without GPUs keeps it on the host
    (event,) = await journal_reader.wait_for(of_type("instance_refused", reservation_id="r-changed"))
    assert event["message"].startswith("model_mismatch:")
    shutil.rmtree(models_dir)
