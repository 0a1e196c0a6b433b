"""Model names from clients are hostile input: through the real `mesh.placement.request` / `fit` subjects,
every bad name is a clear refusal, the actor keeps serving, and relative names mean the models dir."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from actors.placement.actor import PlacementActor
from runtime.bus import Bus
from tests.conftest import JournalReader, node_process, put_telemetry, run_cli, supervised
from tests.harness.nodes import wait_nodes
from tests.harness.placement import GIB, SUBJECTS, ledger, report, wait_view
from tests.tiny_models import write_llama


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    (root / "sub").mkdir(parents=True)
    write_llama(root / "dense.gguf", n_layer=4)
    write_llama(root / "sub" / "nested.gguf", n_layer=4)
    outside = write_llama(tmp_path / "outside.gguf", n_layer=4)  # a real model the client must not reach
    (root / "escape.gguf").symlink_to(outside)
    os.mkfifo(root / "fifo.gguf")  # opening it would block forever
    return root


@pytest.fixture
async def placement(bus: Bus, models_dir: Path) -> AsyncIterator[PlacementActor]:
    actor = PlacementActor(models_dir=models_dir)
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, report("a", 8 * GIB))
        await wait_view(actor, "a")
        yield actor


async def answer(bus: Bus, payload: bytes, *, fit: bool) -> dict[str, Any]:
    subject = SUBJECTS.placement_fit if fit else SUBJECTS.placement_request
    async with asyncio.timeout(10):
        while True:
            try:
                msg = await bus.nc.request(subject, payload, timeout=10)
                break
            except nats.errors.NoRespondersError:  # the view can fill before the actor adds its endpoints
                await asyncio.sleep(0.02)
    body: dict[str, Any] = json.loads(msg.data)
    return body


def ask(model: dict[str, str]) -> bytes:
    return json.dumps({"model": model, "ctx": 2048}).encode()


async def test_hostile_model_names_are_refused_clearly_and_the_actor_keeps_serving(
    bus: Bus, placement: PlacementActor, models_dir: Path, journal_reader: JournalReader
) -> None:
    hostile = {
        "NUL byte": ({"path": str(models_dir / "dense.gguf") + "\x00.txt"}, "NUL byte"),
        "FIFO": ({"path": str(models_dir / "fifo.gguf")}, "not a regular file"),
        "directory": ({"path": str(models_dir)}, "is a directory"),
        "device": ({"path": "/dev/zero"}, "not a regular file"),
        "200 KB path": ({"path": "/" + "a" * 200_000}, "longer than 4096 bytes"),
        "climbs out": ({"path": "../outside.gguf"}, "leaves the models dir"),
        "climbs out deeper": ({"path": "sub/../../outside.gguf"}, "leaves the models dir"),
        "symlink out": ({"path": "escape.gguf"}, "leaves the models dir"),
        "empty": ({"path": ""}, "empty"),
    }
    for i, (case, (model, needle)) in enumerate(hostile.items()):
        body = await answer(bus, ask(model), fit=bool(i % 2))
        assert body.get("admitted") is False, (case, body)
        assert body["reason"] == "model_unreadable", (case, body)
        assert needle in body["message"], (case, body["message"])

    nested = b'{"model": {"path": "dense.gguf"}, "ctx": 2048, "nodes": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    body = await answer(bus, nested, fit=False)
    assert body["code"] == "bad_request" and body["details"]["path"].startswith("$.nodes"), body

    # Names no node can have are refused at decode (see test_placement_hostile); a well-formed unknown one is not_found.
    odd_nodes = json.dumps({"model": {"path": "dense.gguf"}, "ctx": 2048, "nodes": ["a b", "\u0000", "*", ">"]})
    body = await answer(bus, odd_nodes.encode(), fit=False)
    assert body["code"] == "bad_request" and body["details"]["path"] == "$.nodes[0]", body
    ghost = await answer(
        bus, json.dumps({"model": {"path": "dense.gguf"}, "ctx": 2048, "nodes": ["ghost"]}).encode(), fit=False
    )
    assert ghost["reason"] == "not_found" and {r["reason"] for r in ghost["rejections"]} == {"not_found"}, ghost

    good = await answer(bus, ask({"path": "dense.gguf"}), fit=False)  # relative: inside the models dir
    assert good["admitted"] is True, good
    (held,) = (await ledger(bus, "a")).reservations
    assert held.model_path == "dense.gguf"  # as named: each runner finds it in its own models dir
    nested_ok = await answer(bus, ask({"path": "sub/../sub/nested.gguf"}), fit=True)
    assert nested_ok["admitted"] is True, nested_ok

    await journal_reader.wait_for(lambda e: e.get("type") == "placement_decided" and e["decision"]["admitted"])
    assert not [e for e in journal_reader.events if e.get("type") in ("actor_crashed", "actor_restarted")]


async def test_a_relative_model_name_is_refused_where_there_is_no_models_dir(
    bus: Bus, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    actor = PlacementActor()
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, report("a", 8 * GIB))
        await wait_view(actor, "a")
        monkeypatch.chdir(models_dir)  # the actor's working directory holds the file: it must not matter
        body = await answer(bus, ask({"path": "dense.gguf"}), fit=True)
        assert body["admitted"] is False and body["reason"] == "model_unreadable"
        assert "no models dir" in body["message"]
        absolute = await answer(bus, ask({"path": str(models_dir / "dense.gguf")}), fit=True)
        assert absolute["admitted"] is True


async def test_a_stuck_model_read_never_stops_the_actor_answering_others(bus: Bus, placement: PlacementActor) -> None:
    # Header reads run in a worker thread: while one is stuck (here: on the model cache's lock), the event
    # loop still serves the other endpoint.
    with placement.models._lock:
        stuck = asyncio.create_task(answer(bus, ask({"path": "dense.gguf"}), fit=False))
        other = await answer(bus, ask({"path": "../outside.gguf"}), fit=True)
        assert other["reason"] == "model_unreadable"
        assert not stuck.done()
    assert (await stuck)["admitted"] is True


async def test_fit_is_no_file_oracle_outside_the_model_directories(bus: Bus, models_dir: Path, tmp_path: Path) -> None:
    # `placement.fit` named /etc/shadow and answered "bad magic b'root'"; its errors also told whether a file
    # existed. A node that has model directories reads nothing outside them, and says the same for every name
    # outside; inside, a file that is not GGUF is named with where the problem is, never with its bytes.
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:$6$salt$hash:19000:0:99999:7:::\n")
    other_root = tmp_path / "more-models"
    other_root.mkdir()
    write_llama(other_root / "extra.gguf", n_layer=4)
    (models_dir / "notes.gguf").write_bytes(b"root:secret-looking bytes that are no model\n" * 4)
    actor = PlacementActor(models_dir=models_dir, model_roots=(other_root,))
    async with supervised(bus, [actor], node_id="p1"):
        await put_telemetry(bus, report("a", 8 * GIB))
        await wait_view(actor, "a")
        outside = {
            "a secret that exists": str(secret),
            "one that does not": str(tmp_path / "no-such-file"),
            "a system file": "/etc/passwd",
            "a model outside": str(tmp_path / "outside.gguf"),
            "a symlink out of a root": str(models_dir / "escape.gguf"),
            "climbing out by dots": str(models_dir / ".." / "outside.gguf"),
        }
        messages = set()
        for i, (case, path) in enumerate(outside.items()):
            body = await answer(bus, ask({"path": path}), fit=bool(i % 2))
            assert body["admitted"] is False and body["reason"] == "model_unreadable", (case, body)
            assert body["message"] == f"{path!r} is not in this node's model directories", (case, body)
            messages.add(body["message"].replace(repr(path), "PATH"))
        assert len(messages) == 1  # existing or not, readable or not: the same answer

        body = await answer(bus, ask({"path": str(models_dir / "notes.gguf")}), fit=True)
        assert body["reason"] == "model_unreadable" and "not a GGUF file" in body["message"], body
        assert "root" not in body["message"].replace(str(models_dir), "") and "secret" not in body["message"]

        for path in (str(models_dir / "dense.gguf"), str(other_root / "extra.gguf"), "dense.gguf"):
            inside = await answer(bus, ask({"path": path}), fit=True)
            assert inside["admitted"] is True, (path, inside)


async def test_a_node_reads_models_only_from_its_model_directories(tmp_path: Path) -> None:
    # `mesh-actor run` with no --model-root: the models dir (DATA_DIR/models) is the only place a model may be.
    data_dir = tmp_path / "node"
    (data_dir / "models").mkdir(parents=True)
    inside = write_llama(data_dir / "models" / "inside.gguf", n_layer=4)
    outside = write_llama(tmp_path / "outside.gguf", n_layer=4)
    async with node_process(data_dir, "solo", env={"MESH_ACTOR_MODEL_ROOTS": ""}):
        await wait_nodes(data_dir, "solo")
        for path, admitted in ((inside, True), (outside, False), (Path("/etc/passwd"), False)):
            code, out, err = await run_cli(
                "place", str(path), "-c", "512", "--fit", "--json", "--data-dir", str(data_dir)
            )
            decision = json.loads(out)
            assert decision["admitted"] is admitted and code == (0 if admitted else 3), (path, out, err)
            if not admitted:
                assert decision["message"] == f"{str(path)!r} is not in this node's model directories"
