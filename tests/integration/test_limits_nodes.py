"""Per-key limits across two `mesh-actor run` nodes (issue 20): a key issued with `mesh-actor keys issue --rpm 3`
has one budget on both front doors, counted with a node's rights only, and `mesh-actor usage` sums what each door
journaled.

Node `a` runs the embedded NATS server; node `b` joins it with `node:b` credentials. No llama-server is needed:
the model's loads fail (no engine), quickly (`timeout_s = 3`), after the request was admitted, which is what a
requests-per-minute limit counts.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from actors.frontdoor.accounting import REFUSALS_WINDOW_S
from runtime.children import free_port
from tests.conftest import node_process, run_cli
from tests.harness.nodes import joined_node
from tests.tiny_models import write_llama

pytestmark = pytest.mark.timeout(240)


def write_catalog(data_dir: Path, model: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "models.toml").write_text(f'[models.m]\npath = "{model}"\nctx = 512\ntimeout_s = 3\n')


async def status_of(port: int, key: str) -> tuple[int, dict[str, str], dict[str, object]]:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)
    try:
        await client.completions.create(model="m", prompt="hello", max_tokens=1)
    except openai.APIStatusError as exc:
        body = exc.response.json()
        return exc.status_code, dict(exc.response.headers), body.get("error", body)
    except openai.APIConnectionError:  # a node says "running" as its actors start: its door listens a moment later
        return 0, {}, {}
    return 200, {}, {}


async def test_an_rpm_key_has_one_budget_on_two_nodes_and_usage_counts_both(tmp_path: Path) -> None:
    model = write_llama(tmp_path / "m.gguf")
    data_a, data_b = tmp_path / "A", tmp_path / "B"
    write_catalog(data_a, model)
    write_catalog(data_b, model)
    port_a, port_b = free_port(), free_port()
    async with node_process(data_a, "a", "--http", str(port_a), stderr=tmp_path / "a.stderr"):
        async with joined_node(data_a, data_b, "b", "--http", str(port_b), stderr=tmp_path / "b.stderr"):
            code, out, err = await run_cli(
                "keys", "issue", "--tenant", "lab", "--models", "m", "--rpm", "3", "--data-dir", str(data_a), "--json"
            )
            assert code == 0, err
            key = str(json.loads(out)["key"])
            seen = []
            for port in (port_a, port_b, port_a):  # admitted (then failed: no engine), alternating doors
                async with asyncio.timeout(10):
                    status, _, error = await status_of(port, key)
                    while status in (0, 401):  # the door not listening yet, or its watch without the key yet
                        status, _, error = await status_of(port, key)
                seen.append(status)
                assert status != 429, error
            for port in (port_b, port_a):
                status, headers, error = await status_of(port, key)
                assert status == 429 and int(headers["retry-after"]) >= 1, (seen, error)
                assert error["code"] == "rate_limit_exceeded" and error["limit"] == "rpm", error
        # node b has stopped (its journal flushed); node a still runs the server: usage counts both doors (a door
        # journals its refusals together, within `REFUSALS_WINDOW_S`)
        async with asyncio.timeout(REFUSALS_WINDOW_S + 10):
            while True:
                code, out, err = await run_cli("usage", "--tenant", "lab", "--json", "--data-dir", str(data_a))
                assert code == 0, err
                (row,) = json.loads(out)["rows"]
                if row["requests"] >= 5:
                    break
                await asyncio.sleep(0.5)
        assert row["tenant"] == "lab" and row["model"] == "m" and row["requests"] == 5, row
        assert row["refused"] == {"rpm": 2} and row["statuses"]["429"] == 2, row
    for log in ("a.stderr", "b.stderr"):  # neither node needed a right it lacks to count the key
        assert "permissions violation" not in (tmp_path / log).read_text().lower(), log
