"""Replicas that follow the load (issue 21), end to end: two `mesh-actor run` nodes (node `a` with the embedded
NATS server and the front door, node `b` joined with a node's credentials), real llama-servers on generated
tiny models, requests with the official `openai` client.

- `busy` (`max_replicas = 2`): a steady load of concurrent requests makes its one instance's queue wait longer
  than `target_wait_s`; a second instance is added on the other node, its node's L3 store warmed from its
  peer's, and it serves part of the load; once the load stops, one is retired after `replica_idle_s`.
- `kept` (`min_replicas = 1`): running before any request, and started again when its instance is stopped.
- `mesh-actor replay` re-decides every scaling decision identically.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from runtime.children import free_port
from tests.conftest import node_process, run_cli
from tests.harness.nodes import events_of, instances_of, joined_node
from tests.llama_harness import require_server
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

FLAGS = ("--parallel", "2", "--cache-ram", "0", "--ctx-checkpoints", "0", "-t", "1", "--telemetry-interval", "0.5")
WORKERS = 10
PROMPT = " and then the story went on" * 8  # long enough to measure its prefill rate and be kept in L3


def catalog(busy: Path, kept: Path) -> str:
    return (
        f'[models.busy]\npath = "{busy}"\nctx = 2048\nparallel = 2\nmax_replicas = 2\ntarget_wait_s = 0.2\n'
        f"replica_idle_s = 4\n\n"
        f'[models.kept]\npath = "{kept}"\nctx = 512\nparallel = 1\nmin_replicas = 1\n'
    )


async def cli_json(data_dir: Path, *args: str) -> Any:
    code, out, err = await run_cli(*args, "--json", "--data-dir", str(data_dir), timeout=120)
    assert code == 0, f"mesh-actor {' '.join(args)}: {err}"
    return json.loads(out) if out.strip().startswith(("{", "[")) else out


async def live(data_dir: Path, model: Path) -> list[dict[str, Any]]:
    instances = await instances_of(data_dir)
    return [i for i in instances if i["model_path"] == str(model) and i["state"] in ("starting", "ready")]


async def until(check: Any, what: str, timeout: float) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            if result := await check():
                return result
            await asyncio.sleep(0.5)
    raise AssertionError(what)  # pragma: no cover (asyncio.timeout raises first)


async def events(data_dir: Path, subject: str) -> list[dict[str, Any]]:
    return await events_of(data_dir, "--subject", subject)


async def test_the_load_adds_a_replica_on_the_other_node_and_idleness_retires_one(tmp_path: Path) -> None:
    require_server()
    (tmp_path / "models").mkdir()
    busy = write_llama(tmp_path / "models" / "busy.gguf", n_vocab=32000)
    kept = write_llama(tmp_path / "models" / "kept.gguf", n_vocab=4000)
    data_a, data_b = tmp_path / "A", tmp_path / "B"
    data_a.mkdir()
    (data_a / "models.toml").write_text(catalog(busy, kept))
    http = free_port()
    async with node_process(data_a, "a", *FLAGS, "--http", str(http)), joined_node(data_a, data_b, "b", *FLAGS):
        # min_replicas: `kept` runs before anyone asks for it
        (first_kept,) = await until(lambda: live(data_a, kept), "kept started by min_replicas", 120)

        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0,
                                    timeout=300)  # fmt: skip
        served = 0
        stop = asyncio.Event()

        async def worker(n: int) -> None:
            nonlocal served
            i = 0
            while not stop.is_set():
                i += 1
                answer = await client.completions.create(
                    model="busy", prompt=f"{n}.{i}:{PROMPT}", max_tokens=48, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                assert answer.usage is not None and answer.usage.completion_tokens == 48
                served += 1

        async def both_serve() -> list[dict[str, Any]] | None:
            instances = await live(data_a, busy)
            ready = [i for i in instances if i["state"] == "ready"]
            if len(ready) < 2:
                return None
            done = await events(data_a, "runner.generate_completed")
            by_instance = {i["id"]: sum(1 for e in done if e["instance_id"] == i["id"]) for i in ready}
            return ready if all(n >= 3 for n in by_instance.values()) else None

        async with client, asyncio.TaskGroup() as group:
            for n in range(WORKERS):
                group.create_task(worker(n))
            try:
                replicas = await until(both_serve, "a second replica serving part of the load", 240)
            finally:
                stop.set()
        assert {r["node"] for r in replicas} == {"a", "b"}, replicas  # the new one went to the other node
        decided = await events(data_a, "frontdoor.scaling_decided")
        added = [e for e in decided if e["decision"]["action"] == "add" and e["scale"]["model"] == "busy"]
        assert len(added) == 1 and "over the target" in added[0]["decision"]["reason"], added
        assert added[0]["decision"]["expected_wait_s"] > 0.2
        (ready_event,) = [e for e in await events(data_a, "frontdoor.replica_added") if e["model"] == "busy"]
        assert ready_event["instance_node"] != added[0]["scale"]["replicas"][0]["node"] and not ready_event["error"]
        # its node's store was warmed with the states the first replica's completions left in its peer's
        assert ready_event["warmed_entries"] >= 1 and ready_event["warmed_bytes"] > 0, ready_event

        # idle after the load: one of the two is retired after replica_idle_s, never below one
        await until(lambda: _count_is(data_a, busy, 1), "one replica retired after the load", 60)
        decided = await events(data_a, "frontdoor.scaling_decided")
        (retired,) = [e for e in decided if e["decision"]["action"] == "retire"]
        assert retired["decision"]["retire"] in {r["id"] for r in replicas}
        assert "idle for" in retired["decision"]["reason"]

        # min_replicas: a stopped `kept` is started again
        code, _, err = await run_cli("stop", first_kept["id"], "--data-dir", str(data_a), timeout=60)
        assert code == 0, err

        async def restarted() -> list[dict[str, Any]] | None:
            again = [i for i in await live(data_a, kept) if i["id"] != first_kept["id"] and i["state"] == "ready"]
            return again or None

        await until(restarted, "kept started again after its instance was stopped", 120)
        replay = await cli_json(data_a, "replay")
        kinds = await events(data_a, "frontdoor.scaling_decided")
    assert replay["changed"] == [] and replay["replayed"] >= len(kinds) >= 4, replay
    with contextlib.suppress(FileNotFoundError):
        for log in (tmp_path / "A.a.log", tmp_path / "B.b.log"):
            assert "permissions violation" not in log.read_text().lower(), log


async def _count_is(data_dir: Path, model: Path, n: int) -> bool:
    return len(await live(data_dir, model)) == n
