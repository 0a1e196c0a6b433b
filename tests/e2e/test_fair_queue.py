"""Fair queueing end to end (issue 20): a real node (`mesh-actor run` on its embedded NATS, a real llama-server with
2 slots on a generated tiny model), tenants' keys issued with `mesh-actor keys issue`, requests sent with the
official `openai` client.

Tenant `flood` sends 50 long requests at once; tenant `short` then sends 5 short ones. In arrival order they would
wait behind the whole flood; served by fair share of token cost, they go next: all five finish while most of the
flood still waits. No request waited while a slot was free, every waiting request got its slot, the journal says
why each waited, and `mesh-actor replay` re-decides every queue decision identically.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from runtime.children import free_port
from tests.harness.frontdoor import QUIET, write_catalog
from tests.harness.nodes import cli, events_of, node, wait_nodes
from tests.llama_harness import require_server
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

FLOOD, SHORT = 50, 5
LONG_TOKENS, SHORT_TOKENS = 48, 4


async def issue(data_dir: Path, tenant: str) -> str:
    code, out, err = await cli("keys", "issue", "--tenant", tenant, "--json", "--data-dir", str(data_dir))
    assert code == 0, err
    return str(json.loads(out)["key"])


async def events(data_dir: Path, kind: str) -> list[dict[str, Any]]:
    return await events_of(data_dir, "--subject", f"runner.{kind}")


async def test_a_short_tenant_is_not_starved_by_a_flood_and_no_slot_idles(tmp_path: Path) -> None:
    require_server()
    model = write_llama(tmp_path / "m.gguf", n_vocab=32000)
    data_dir = tmp_path / "node"
    write_catalog(data_dir, {"m": {"path": str(model), "ctx": 1024, "parallel": 2}})
    http = free_port()
    async with node(data_dir, "fair", *QUIET, "-t", "1", "--http", str(http)):
        await wait_nodes(data_dir, "fair")
        flood_key, short_key = await issue(data_dir, "flood"), await issue(data_dir, "short")
        finished: dict[str, float] = {}
        used: dict[str, list[int]] = {"flood": [0, 0, 0], "short": [0, 0, 0]}  # requests, prompt, generated

        async def ask(key: str, name: str, tokens: int) -> None:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key=key, max_retries=0,
                                        timeout=300)  # fmt: skip
            async with client:
                answer = await client.completions.create(
                    model="m", prompt=f"Request {name} says", max_tokens=tokens, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
            assert answer.usage is not None and answer.usage.completion_tokens == tokens
            finished[name] = time.monotonic()
            tally = used["flood" if key == flood_key else "short"]
            tally[0] += 1
            tally[1] += answer.usage.prompt_tokens
            tally[2] += answer.usage.completion_tokens

        await ask(flood_key, "warm", 1)  # the model is loaded: what follows measures the queue, not the load
        async with asyncio.TaskGroup() as group:
            for i in range(FLOOD):
                group.create_task(ask(flood_key, f"flood-{i}", LONG_TOKENS))
            async with asyncio.timeout(60):
                while not any(n.startswith("flood-") for n in finished):  # the flood is in, and being served
                    await asyncio.sleep(0.05)
            for i in range(SHORT):
                group.create_task(ask(short_key, f"short-{i}", SHORT_TOKENS))

        last_short = max(t for n, t in finished.items() if n.startswith("short-"))
        flood_after = sum(1 for n, t in finished.items() if n.startswith("flood-") and t > last_short)
        assert flood_after >= FLOOD // 2, f"only {flood_after} of the flood finished after the short tenant"

        queued = await events(data_dir, "generate_queued")
        dequeued = await events(data_dir, "generate_dequeued")
        completed = await events(data_dir, "generate_completed")
        code, out, err = await cli("replay", "--json", "--data-dir", str(data_dir))
        usage_code, usage_out, usage_err = await cli("usage", "--json", "--data-dir", str(data_dir))
    # what the journal sums per tenant is what the answers said
    assert usage_code == 0, usage_err
    rows = {row["tenant"]: row for row in json.loads(usage_out)["rows"]}
    for tenant, (requests, prompt, generated) in used.items():
        row = rows[tenant]
        assert (row["requests"], row["prompt_tokens"], row["generated_tokens"]) == (requests, prompt, generated), row
    assert len(queued) >= FLOOD // 2 and len(dequeued) == len(queued)
    # nobody waited while a slot was free (unless one was finishing its capture, which the reason says)
    for event in queued:
        assert event["busy_slots"] == 2 or "finishing" in event["reason"], event
        assert event["waiter"]["tenant"] in ("flood", "short") and event["reason"], event
    waited_short = [e for e in queued if e["waiter"]["tenant"] == "short"]
    # fair share put each near the queue's head: behind the short tenant's own earlier ones and at most one of the
    # flood's (a short request costs about a third of a long one: its fifth finishes after the flood's next)
    assert all(e["ahead"] <= SHORT for e in waited_short), [(e["ahead"], e["reason"]) for e in waited_short]
    # every dequeue chose the queue's best: the recorded choice is first among the candidates recorded
    for event in dequeued:
        assert event["candidates"][0]["request_id"] == event["request_id"], event
    tenants = {e["tenant"] for e in completed if e["endpoint"]}
    assert {"flood", "short"} <= tenants
    assert code == 0, err
    replay = json.loads(out)
    assert replay["changed"] == [] and replay["replayed"] >= len(queued) + len(dequeued), replay
