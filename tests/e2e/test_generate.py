"""The serving path from the outside: `mesh-actor run`, `mesh-actor generate`, and `mesh.generate` over NATS.

Real nats-server (embedded by `mesh-actor run`), real llama-servers on generated tiny models (dense, SWA,
hybrid). A state computed before a full restart of the node is restored from L3 afterwards and continues
exactly like a cold run; routing sends a prompt to the instance that holds it; bad requests get structured
errors; a streaming client that goes away frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from actors.router.routing import route
from messages.events import GenerateRouted
from messages.generate import GenerateChunk, GenerateRequest, GenerateResult
from messages.subjects import Subjects
from runtime.generate_client import generate
from tests.harness.generate import QUIET, client, gen, start_model, wait_captured, wait_ready, wait_serving
from tests.harness.nodes import cli, events_of, nats_env, node, wait_nodes
from tests.llama_harness import call_server, require_server
from tests.tiny_models import write_gemma3, write_llama, write_qwen35

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROMPT = [1 + (i * 7) % 250 for i in range(300)]  # longer than the SWA window and the capture threshold


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_server()
    root = tmp_path_factory.mktemp("generate-models")
    return {
        "dense": write_llama(root / "dense.gguf"),
        "swa": write_gemma3(root / "swa.gguf", n_swa=64),
        "hybrid": write_qwen35(root / "hybrid.gguf", n_layer=4, state_size=16, dt_rank=4),
    }


@pytest.mark.parametrize("kind", ["dense", "swa", "hybrid"])
async def test_a_state_restored_after_a_restart_continues_exactly_like_a_cold_run(
    tmp_path: Path, models: dict[str, Path], kind: str
) -> None:
    data_dir = tmp_path / "node"
    model = models[kind]
    async with node(data_dir, "solo", *QUIET):
        await wait_nodes(data_dir, "solo")
        await start_model(data_dir, model)
        cold = await gen(data_dir, model.name, PROMPT)
        assert cold["source"] == "cold" and cold["tokens_evaluated"] == len(PROMPT), cold
        assert cold["capture"] == "queued" and len(cold["tokens"]) == 32
        turn = [*PROMPT, *cold["tokens"], 11, 12, 13, 14, 15]
        await wait_captured(data_dir, len(PROMPT) - 1)  # the prompt one token short
        await wait_captured(data_dir, len(PROMPT) + 31)  # the prompt and the reply (its last token unevaluated)

    async with node(data_dir, "solo", *QUIET):  # a full restart: nothing resident, the store on disk
        await wait_nodes(data_dir, "solo")
        await start_model(data_dir, model)
        again = await gen(data_dir, model.name, PROMPT)
        assert again["tokens"] == cold["tokens"]  # token for token, greedy
        assert again["source"] == "l3_local", again
        assert (again["tokens_restored"], again["tokens_evaluated"]) == (len(PROMPT) - 1, 1), again

    async with node(data_dir, "solo", *QUIET):
        await wait_nodes(data_dir, "solo")
        await start_model(data_dir, model)
        second_turn = await gen(data_dir, model.name, turn, 8)
        assert second_turn["source"] == "l3_local", second_turn
        assert second_turn["tokens_restored"] == len(PROMPT) + 31
        assert second_turn["tokens_evaluated"] == len(turn) - (len(PROMPT) + 31), second_turn  # only the new ones


async def test_routing_sends_a_prompt_to_the_instance_that_holds_it(tmp_path: Path, models: dict[str, Path]) -> None:
    data_dir = tmp_path / "node"
    async with node(data_dir, "router", *QUIET):
        await wait_nodes(data_dir, "router")
        first = await start_model(data_dir, models["dense"], ctx=2048)
        second = await start_model(data_dir, models["dense"], ctx=2048)
        served = await gen(data_dir, "dense", PROMPT, 4, "--no-capture")
        holder = served["instance"]
        assert holder in (first, second)
        await wait_serving(data_dir, lambda loads: holder in loads and bool(loads[holder].resident))
        for _ in range(3):
            again = await gen(data_dir, "dense", PROMPT, 4, "--no-capture")
            assert again["instance"] == holder and again["source"] == "resident", again
            assert again["tokens_evaluated"] <= 1
        other = [2 + (i * 3) % 200 for i in range(300)]
        assert (await gen(data_dir, "dense", other, 4, "--no-capture"))["source"] == "cold"
        routed = await events_of(data_dir, "--subject", "router.generate_routed")
        assert len(routed) == 5 and {r["decision"]["chosen"] for r in routed[1:4]} == {holder}
        assert all(len(r["candidates"]) == 2 for r in routed)
        code, out, err = await cli("replay", "--json", "--data-dir", str(data_dir))  # today's core agrees
        assert code == 0, err + out
        replay = json.loads(out)
        assert replay["replayed"] >= 5 + 2 and replay["changed"] == [], replay  # and the two placements


async def test_a_shared_prompt_cache_reuses_nothing_once_two_cache_scopes_met(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """Issue 30, F6: llama-server's host-memory prompt cache (`--cache-ram`) is one for all its slots, and a
    request's slot is loaded from it with the best-matching cached prompt of anyone's: a third tenant's right
    guess found the first tenant's prompt there, although both slots were erased. On such an instance a
    request reuses cached prompts only while the server has served no other scope since it started."""
    data_dir = tmp_path / "node"
    subjects = Subjects()
    async with node(data_dir, "shared", "--cache-ram", "16", "--ctx-checkpoints", "0", "--parallel", "2"):
        await wait_nodes(data_dir, "shared")
        await start_model(data_dir, models["dense"])
        async with client(data_dir) as bus:

            async def evaluated(scope: str) -> int:
                request = GenerateRequest(model="dense", prompt=PROMPT, n_predict=2, capture=False, cache_scope=scope)
                return (await generate(bus, subjects, request)).tokens_evaluated

            assert await evaluated("tenant:acme") == len(PROMPT)
            assert await evaluated("tenant:acme") < len(PROMPT)  # one scope so far: its own prompt is reused
            for scope in ("tenant:beta", "tenant:beta", "tenant:gamma", "tenant:acme"):
                assert await evaluated(scope) == len(PROMPT), scope  # two scopes met: nothing is reused


async def test_malformed_generate_requests_get_structured_errors_and_the_node_keeps_serving(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    data_dir = tmp_path / "node"
    subjects = Subjects()
    async with node(data_dir, "strict", *QUIET):
        await wait_nodes(data_dir, "strict")
        await start_model(data_dir, models["dense"])
        async with client(data_dir) as bus:
            cases: list[tuple[bytes, str, str | None]] = [
                (b"not json", "bad_request", None),
                (b'{"prompt": "hi"}', "bad_request", "$"),
                (b'{"model": "dense", "prompt": []}', "bad_request", "$.prompt"),
                (b'{"model": "dense", "prompt": "hi", "n_predict": 0}', "bad_request", "$.n_predict"),
                (b'{"model": "dense", "prompt": [-1]}', "bad_request", "$.prompt[0]"),
                (b'{"model": "dense", "prompt": "hi", "extra": 1}', "bad_request", None),
                (b'{"model": "dense", "prompt": "hi", "sampling": {"temperature": -1}}', "bad_request", None),
                (b'{"model": "dense", "prompt": "hi", "stream": "a b"}', "bad_request", "$.stream"),
                (b'{"model": "dense", "prompt": "hi", "stream": "mesh.events.x"}', "bad_request", "$.stream"),
                # no `stream`: nothing would tell the runner its requester left
                (b'{"model": "dense", "prompt": "hi"}', "bad_request", "$.stream"),
                (b'{"model": "no-such-model", "prompt": "hi", "stream": "_INBOX.t.1"}', "no_instance", None),
                (b'{"model": "dense", "prompt": [1, 2], "request_id": "../x"}', "bad_request", None),
                (b"[" * 5000 + b"]" * 5000, "bad_request", None),
            ]
            for payload, code, path in cases:
                msg = await bus.request_raw(subjects.generate, payload, timeout=10)
                reply = json.loads(msg.data)
                assert reply.get("code") == code, (payload[:60], reply)
                if path is not None:
                    assert reply["details"].get("path") == path, reply
            ok = await generate(bus, subjects, GenerateRequest(model="dense", prompt="hello", n_predict=4))
            assert len(ok.tokens) == 4


async def test_streamed_chunks_arrive_in_order_and_a_client_that_goes_away_frees_the_slot(tmp_path: Path) -> None:
    require_server()
    # A large vocabulary keeps random weights from sampling the end of text early: a long generation that
    # ended by itself would free its slot with nothing cancelled (CI once waited for a cancellation in vain).
    slow = write_llama(tmp_path / "slow.gguf", n_layer=12, n_embd=512, n_head=8, n_head_kv=4, n_ff=2048,
                       n_vocab=32000)  # fmt: skip
    data_dir = tmp_path / "node"
    subjects = Subjects()
    async with node(data_dir, "streamer", "--cache-ram", "0", "--ctx-checkpoints", "0", "--parallel", "1"):
        await wait_nodes(data_dir, "streamer")
        await start_model(data_dir, slow, ctx=8192)
        port = await instance_port(data_dir)  # read while the instance is idle and its record certainly current
        async with client(data_dir) as bus:
            chunks: list[GenerateChunk] = []

            async def keep(chunk: GenerateChunk) -> None:
                chunks.append(chunk)

            request = GenerateRequest(model="slow", prompt="stream me", n_predict=24, capture=False)
            result = await generate(bus, subjects, request, keep)
            assert [c.seq for c in chunks] == list(range(len(chunks))) and chunks
            assert "".join(c.text for c in chunks) == result.text
            assert result.stop_reason in ("limit", "eos")  # random weights may well sample the end of text

            # A long generation, abandoned after a few chunks: the runner's next ping finds nobody listening.
            seen = asyncio.Event()

            async def leave_soon(chunk: GenerateChunk) -> None:
                if chunk.seq >= 3:
                    seen.set()

            long = GenerateRequest(model="slow", prompt="go on", n_predict=7000, capture=False, timeout_s=120)
            abandoned = asyncio.create_task(generate(bus, subjects, long, leave_soon))
            async with asyncio.timeout(30):
                await seen.wait()
            abandoned.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await abandoned
            cancelled_at = loop_time()
            full_s = 7000 * result.total_ms / 1000 / len(result.tokens)  # what the whole generation would take
            async with asyncio.timeout(30):
                while await slot_busy(port):
                    await asyncio.sleep(0.1)
            stopped_after = loop_time() - cancelled_at
            assert stopped_after < min(5.0, full_s / 2), (stopped_after, full_s)
            quick = GenerateRequest(model="slow", prompt="next", n_predict=2, capture=False, timeout_s=60)
            after: GenerateResult = await generate(bus, subjects, quick)  # the one slot is free again
            assert len(after.tokens) == 2

            # A whole (not streamed) generation whose requester leaves stops too: the call's inbox is pinged.
            whole = asyncio.create_task(generate(bus, subjects, long))
            async with asyncio.timeout(30):
                while not await slot_busy(port):
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            whole.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await whole
            cancelled_at = loop_time()
            # llama-server notices a closed connection of a whole answer once it waited a second without any
            # other result, which a /slots request is: the slot is read only every 1.5 s (a loaded machine may
            # take more than one such window to close the connection), and it stops long before its end
            async with asyncio.timeout(full_s / 2):
                while True:
                    await asyncio.sleep(1.5)
                    if not await slot_busy(port):
                        break
            stopped_after = loop_time() - cancelled_at
            assert stopped_after < full_s / 2, (stopped_after, full_s)
            async with asyncio.timeout(10):
                while not (gone := await events(data_dir, "runner.generate_cancelled")):
                    await asyncio.sleep(0.2)
            assert gone[-1]["endpoint"] == "" and gone[-1]["reason"]


def loop_time() -> float:
    return asyncio.get_running_loop().time()


async def instance_port(data_dir: Path) -> int:
    _, out, _ = await cli("status", "--json", "--data-dir", str(data_dir))
    (instance,) = json.loads(out)["instances"]
    return int(instance["port"])


async def slot_busy(port: int) -> bool:
    """Whether any slot of the llama-server on `port` is processing (its own `/slots` report)."""
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/slots") as response:
        slots = await response.json()
    return any(s.get("is_processing") for s in slots)


async def test_a_node_restores_a_prefix_computed_on_another_node_from_its_peer_store(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    model = models["dense"]
    async with node(first, "node-a", *QUIET):
        env = await nats_env(first)
        async with node(second, "node-b", *QUIET, env=env):
            await wait_nodes(first, "node-a", "node-b")
            code, out, err = await cli(
                "place", str(model), "-c", "2048", "--node", "node-a", "--start", "--json", env=env
            )
            assert code == 0, err + out
            on_a = json.loads(out)["instance"]["instance_id"]
            await wait_ready(first, on_a)
            cold = await gen(first, model.name, PROMPT)
            assert cold["node"] == "node-a" and cold["source"] == "cold"
            await wait_captured(first, len(PROMPT) - 1)
            code, _, err = await cli("stop", on_a, "--data-dir", str(first))
            assert code == 0, err

            code, out, err = await cli(
                "place", str(model), "-c", "2048", "--node", "node-b", "--start", "--json", env=env
            )
            assert code == 0, err + out
            await wait_ready(first, json.loads(out)["instance"]["instance_id"])
            fetched = await gen(first, model.name, PROMPT)
            assert fetched["node"] == "node-b" and fetched["source"] == "l3_peer", fetched
            assert (fetched["tokens_restored"], fetched["tokens_evaluated"]) == (len(PROMPT) - 1, 1), fetched
            assert fetched["tokens"] == cold["tokens"]
            code, out, err = await cli("l3", "ls", "--json", "--node", "node-b", "--data-dir", str(first))
            assert code == 0, err
            assert any(e["tokens"] == len(PROMPT) - 1 for e in json.loads(out))  # kept where it was fetched to


async def test_routing_prefers_the_node_whose_store_holds_the_prefix(tmp_path: Path, models: dict[str, Path]) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    model = models["dense"]
    async with node(first, "node-a", *QUIET):
        env = await nats_env(first)
        async with node(second, "node-b", *QUIET, env=env):
            await wait_nodes(first, "node-a", "node-b")

            async def start_on(node_id: str) -> str:
                code, out, err = await cli(
                    "place", str(model), "-c", "2048", "--node", node_id, "--start", "--json", env=env
                )
                assert code == 0, err + out
                instance_id = str(json.loads(out)["instance"]["instance_id"])
                await wait_ready(first, instance_id)
                return instance_id

            on_a = await start_on("node-a")
            assert (await gen(first, model.name, PROMPT, 4))["node"] == "node-a"
            await wait_captured(first, len(PROMPT) - 1)
            code, _, err = await cli("stop", on_a, "--data-dir", str(first))
            assert code == 0, err
            on_b = await start_on("node-b")  # nothing resident anywhere now; node-a's store holds the prefix
            on_a = await start_on("node-a")
            # Both runners' serving reports name their instances' identities (what L3 credit needs).
            await wait_serving(
                first, lambda loads: all(i in loads and loads[i].identity is not None for i in (on_a, on_b))
            )
            routed = await gen(first, model.name, PROMPT, 4)
            assert routed["node"] == "node-a" and routed["source"] == "l3_local", routed
            assert routed["tokens_evaluated"] == 1
            code, out, err = await cli("events", "--json", "--subject", "router.generate_routed", env=env)
            assert code == 0, err
            last = json.loads(out.splitlines()[-1])["event"]
            credits = {c["node"]: (c["source"], c["held_tokens"]) for c in last["candidates"]}
            assert credits == {"node-a": ("l3_local", len(PROMPT) - 1), "node-b": ("l3_peer", len(PROMPT) - 1)}


@pytest.mark.parametrize("kind", ["dense", "swa", "hybrid"])
async def test_prefill_on_one_node_and_decode_on_another_gives_the_local_output(
    tmp_path: Path, models: dict[str, Path], kind: str
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    model = models[kind]
    async with node(first, "node-a", *QUIET):
        env = await nats_env(first)
        async with node(second, "node-b", *QUIET, env=env):
            await wait_nodes(first, "node-a", "node-b")
            for node_id in ("node-a", "node-b"):
                code, out, err = await cli(
                    "place", str(model), "-c", "2048", "--node", node_id, "--start", "--json", env=env
                )
                assert code == 0, err + out
                await wait_ready(first, json.loads(out)["instance"]["instance_id"])
                if node_id == "node-a":  # nothing on node-b yet: the prefill planned there fails, it is done here
                    alone = await gen(first, model.name, [7 + i % 50 for i in range(60)], 4, "--no-capture",
                                      "--prefill-node", "node-b")  # fmt: skip
                    assert (alone["path"], alone["node"], alone["tokens_evaluated"]) == ("local", "node-a", 60)
                    assert alone["prefill_fallback"].startswith("prefill on node-b failed (not_found)"), alone
            other = [3 + (i * 11) % 240 for i in range(300)]
            split = await gen(first, model.name, other, 32, "--no-capture", "--prefill-node", "node-b")
            assert split["path"] == "disaggregated" and split["prefill_node"] == "node-b", split
            assert split["node"] == "node-a" and split["handoff_bytes"] > 0 and split["handoff_ms"] > 0
            assert split["tokens_restored"] == len(other) - 1
            assert split["tokens_evaluated"] == len(other)  # all but one on node-b, the last one here
            # The reference: node-a's own llama-server computing the whole prompt itself, nothing reused.
            _, out, _ = await cli("status", "--json", "--data-dir", str(first))
            (port,) = [i["port"] for i in json.loads(out)["instances"] if i["node"] == "node-a"]
            body = {"prompt": other, "n_predict": 32, "temperature": 0, "cache_prompt": False, "return_tokens": True}
            reply = await call_server(port, "POST", "/completion", body, timeout_s=60)
            assert split["tokens"] == json.loads(reply.body)["tokens"]  # 32 greedy tokens, token for token
            # Whichever node's router takes the request (the queue group's choice) decides with what it has learned
            # of the link: its choice is its core's on those inputs, and with both nodes prefilling alike (the same
            # server on the same cores; a loaded machine may measure one slower for a while) the core keeps the
            # prompt local: the handoff would only add to it.
            third = [5 + (i * 17) % 240 for i in range(300)]
            chosen = await gen(first, model.name, third, 4, "--no-capture")
            (event,) = [
                e for e in await events(first, "router.generate_routed") if e["request_id"] == chosen["request_id"]
            ]
            routed = msgspec.convert(event, GenerateRouted)
            redecided = route(routed.n_prompt, routed.candidates, routed.weights, routed.links, routed.link_fixed_s)
            assert redecided == routed.decision, routed
            assert (chosen["path"] == "local") == (routed.decision.prefill_node is None), (chosen, routed)
            rate = max(c.prefill_tokens_per_s for c in routed.candidates)
            alike = [msgspec.structs.replace(c, prefill_tokens_per_s=rate) for c in routed.candidates]
            assert route(routed.n_prompt, alike, routed.weights, routed.links, routed.link_fixed_s).prefill_node is None
            if kind != "dense":
                return
            # The operator's link probe: real handoffs node-b -> node-a, then the break-even of this model.
            probe = ("handoff", "bench", "node-a", "--from", "node-b", "--size-mib", "4", "--rounds", "1", "--json")
            code, out, err = await cli(*probe, env=env)
            assert code == 0, err + out
            bench = json.loads(out)
            assert (bench["link"]["src"], bench["link"]["dst"]) == ("node-b", "node-a")
            assert bench["link"]["bytes_per_s"] > 0 and len(bench["link"]["samples"]) == 2
            [row] = bench["models"]
            assert row["model"] == str(model) and row["state_bytes_per_token"] > 0
            assert row["prefill_tokens_per_s"] > 0  # node-b prefilled the handed-off prompt
            assert (row["breakeven_tokens"] is None) == bool(row["unmeasured"]) or not row["unmeasured"]
            code, out, err = await cli("events", "--json", "--subject", "handoff.link_measured", env=env)
            assert code == 0 and json.loads(out.splitlines()[-1])["event"]["dst"] == "node-a", err + out
            code, out, err = await cli(*probe[:3], "--from", "node-a", env=env)
            assert code == 2 and "same node" in err
            for bad in (("--size-mib", "1"), ("--rounds", "0")):  # refused here, before any node is asked
                code, out, err = await cli(*probe[:5], *bad, env=env)
                assert code == 2 and "bad probe" in err, (bad, code, err)


async def events(data_dir: Path, kind: str) -> list[dict[str, Any]]:
    return await events_of(data_dir, "--subject", kind)
