"""The OpenAI-compatible front door, driven by the official `openai` client against `mesh-actor run --http`.

Real nats-server (embedded), real llama-servers on generated tiny models. Models come from `models.toml` and
load on demand; a node whose memory fits one model at a time swaps them without losing a request; a model
that can never fit is refused at once with need and have; pinned models stay; idle ones stop; a model loaded
again resumes from L3; bad requests get OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.settings import ServingSettings
from runtime.children import free_port
from tests.harness.frontdoor import _WEDGE, KEY, KEYED, QUIET, _events, client, instances, write_catalog
from tests.harness.nodes import cli, events_of, node, wait_nodes
from tests.llama_harness import require_server
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_server()
    root = tmp_path_factory.mktemp("frontdoor-models")
    return {
        "alpha": write_llama(root / "alpha.gguf"),
        "beta": write_llama(root / "beta.gguf", n_layer=3),
        "huge": write_llama(root / "huge.gguf", n_layer=8, n_embd=1024, n_head=8, n_head_kv=8, n_ff=4096),
        "wide": write_llama(root / "wide.gguf", n_embd=128, n_head=2),  # 64-wide heads: quantized caches allowed
    }


def need(model: Path, ctx: int = 2048) -> int:
    settings = ServingSettings(slots=2, cache_ram_mib=0, ctx_checkpoints=0, swa_full=True)
    return estimate(geometry_from_header(read_header(model)), settings, ctx).total_bytes


async def test_completions_and_chat_whole_and_streamed_with_usage(tmp_path: Path, models: dict[str, Path]) -> None:
    data_dir = tmp_path / "node"
    write_catalog(data_dir, {"alpha": {"path": str(models["alpha"]), "ctx": 2048}})
    port = free_port()
    async with node(data_dir, "door", *QUIET, "--http", str(port), env=KEYED):
        await wait_nodes(data_dir, "door")
        api = client(port)
        assert [m.id for m in (await api.models.list()).data] == ["alpha"]
        done = await api.completions.create(model="alpha", prompt="Hello there", max_tokens=8, temperature=0)
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens > 0
        chat = await api.chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage is not None
        assert chat.usage.completion_tokens == 6
        stream = await api.chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content  # greedy: the same text, streamed
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        assert chunks[-1].usage.prompt_tokens_details is not None
        assert (chunks[-1].usage.prompt_tokens_details.cached_tokens or 0) > 0  # the same chat again: prefix reused
        async with asyncio.timeout(10):  # the front door's report: the model, ready, with its memory
            while True:
                code, out, err = await cli("models", "--json", "--data-dir", str(data_dir))
                assert code == 0, err
                (door,) = json.loads(out)
                (entry,) = door["models"]
                if entry["state"] == "ready":
                    break
                await asyncio.sleep(0.3)
        assert entry["name"] == "alpha" and entry["held_bytes"] > 0 and entry["queued"] == 0
        assert door["address"] == f"http://127.0.0.1:{port}" and door["auth"] is True
        pieces = [c async for c in await api.completions.create(model="alpha", prompt="Hello there", max_tokens=8,
                                                                temperature=0, stream=True)]  # fmt: skip
        assert "".join(p.choices[0].text for p in pieces if p.choices) == done.choices[0].text


async def test_bad_requests_get_openai_errors_and_what_the_server_accepts_passes(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    data_dir = tmp_path / "node"
    write_catalog(data_dir, {"alpha": {"path": str(models["alpha"]), "ctx": 2048}})
    port = free_port()
    async with node(data_dir, "strict", *QUIET, "--http", str(port), env=KEYED):
        await wait_nodes(data_dir, "strict")
        with pytest.raises(openai.AuthenticationError) as unauthorized:
            await client(port, "wrong").models.list()
        assert unauthorized.value.status_code == 401
        api = client(port)
        with pytest.raises(openai.NotFoundError) as missing:
            await api.completions.create(model="nope", prompt="x")
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as two:  # the mesh books one slot a request (issue 30, F4)
            await api.completions.create(model="alpha", prompt="x", n=2, max_tokens=2, temperature=0)
        assert "one completion per request" in two.value.message
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as raw:
            headers = {"Authorization": f"Bearer {KEY}"}
            for body, status in (
                (b"not json", 400),
                (b'{"prompt": "x"}', 400),  # no model
                (b'{"model": "alpha", "prompt": "' + b"x" * (9 << 20) + b'"}', 413),
            ):
                async with raw.post("/v1/completions", data=body, headers=headers) as reply:
                    error = await reply.json()
                    assert reply.status == status, (body[:60], error)
                assert set(error["error"]) >= {"message", "type", "param", "code"}
        assert (await api.completions.create(model="alpha", prompt="still fine", max_tokens=2)).choices


async def test_two_models_take_turns_in_memory_for_one_and_no_request_is_lost(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    data_dir = tmp_path / "node"
    write_catalog(
        data_dir,
        {
            "alpha": {"path": str(models["alpha"]), "ctx": 2048},
            "beta": {"path": str(models["beta"]), "ctx": 2048},
            "huge": {"path": str(models["huge"]), "ctx": 2048},
        },
    )
    limit = max(need(models["alpha"]), need(models["beta"])) * 3 // 2  # one at a time
    assert need(models["alpha"]) + need(models["beta"]) > limit and need(models["huge"]) > limit
    port = free_port()
    async with node(data_dir, "swap", *QUIET, "--memory-limit", str(limit), "--http", str(port), env=KEYED):
        await wait_nodes(data_dir, "swap")
        api = client(port)
        with pytest.raises(openai.APIStatusError) as never:
            await api.completions.create(model="huge", prompt="x", max_tokens=2)
        assert never.value.status_code == 507
        error = never.value.body
        assert isinstance(error, dict) and error["need_bytes"] and error["have_bytes"], error

        async def one(i: int) -> str:
            name = ("alpha", "beta")[i % 2]
            stream = await api.completions.create(model=name, prompt=f"request {i}", max_tokens=4, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(16))), 240)
        assert len(results) == 16  # every request answered
        starts = await events_of(data_dir, "--subject", "runner.instance_starting")
        assert 2 <= len(starts) <= 6, len(starts)  # requests grouped per model: a handful of swaps, not 16
        assert len(await instances(data_dir)) == 1  # never both at once
        made = await events_of(data_dir, "--subject", "frontdoor.room_made")
        assert made and all(m["stopped"] and m["frees"]["CPU"] > 0 for m in made)  # each swap journaled
        (refused,) = await events_of(data_dir, "--subject", "frontdoor.model_refused")
        assert refused["model"] == "huge" and refused["reason"] == "never_fits" and refused["need_bytes"]["CPU"] > 0


async def test_pinned_stays_idle_stops_and_a_model_loaded_again_resumes_from_l3(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    data_dir = tmp_path / "node"
    write_catalog(
        data_dir,
        {
            "alpha": {"path": str(models["alpha"]), "ctx": 2048, "idle_ttl_s": 2},
            "beta": {"path": str(models["beta"]), "ctx": 2048, "pinned": True},
        },
    )
    port = free_port()
    async with node(data_dir, "ttl", *QUIET, "--http", str(port), env=KEYED):
        await wait_nodes(data_dir, "ttl")
        api = client(port)
        prompt = [1 + (i * 7) % 250 for i in range(300)]
        await api.completions.create(model="beta", prompt="pinned", max_tokens=2)
        first = await api.completions.create(model="alpha", prompt=prompt, max_tokens=4, temperature=0)
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        async with asyncio.timeout(30):  # alpha idles out; beta, pinned, stays
            while True:
                running = await instances(data_dir)
                if [Path(i["model_path"]).stem for i in running] == ["beta"]:
                    break
                await asyncio.sleep(0.5)
        again = await api.completions.create(model="alpha", prompt=prompt, max_tokens=4, temperature=0)
        assert again.choices[0].text == first.choices[0].text
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1  # restored from L3


async def test_a_server_whose_completions_fail_while_health_says_ok_is_restarted(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """llama-server runs its task loop (every completion) on its main thread and answers `/health` from its HTTP
    threads. Stopping only the main thread is a server that hangs on every completion while `/health` says ok,
    which is what a wedged backend looks like from outside; the runner's one-token probes must notice it."""
    data_dir = tmp_path / "node"
    write_catalog(data_dir, {"alpha": {"path": str(models["alpha"]), "ctx": 2048}})
    port = free_port()
    probing = ("--health-probe-interval", "1", "--health-probe-timeout", "2")
    async with node(data_dir, "wedge", *QUIET, *probing, "--http", str(port), env=KEYED):
        await wait_nodes(data_dir, "wedge")
        api = client(port)
        assert (await api.completions.create(model="alpha", prompt="before", max_tokens=2)).choices
        (instance,) = await instances(data_dir)
        pid, server_port = instance["pid"], instance["port"]
        wedge = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WEDGE, str(pid), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            assert wedge.stdout is not None
            async with asyncio.timeout(10):
                said = (await wedge.stdout.readline()).decode()
            if "wedged" not in said:
                pytest.skip(f"this machine does not allow ptrace on a child's child ({said.strip()})")
            async with aiohttp.ClientSession(f"http://127.0.0.1:{server_port}") as direct:
                async with direct.get("/health", timeout=aiohttp.ClientTimeout(total=5)) as health:
                    assert health.status == 200  # /health says ok ...
                with pytest.raises(TimeoutError):  # ... while a completion gets no answer
                    async with direct.post("/completion", json={"prompt": "x", "n_predict": 1},
                                           timeout=aiohttp.ClientTimeout(total=3)) as reply:  # fmt: skip
                        await reply.read()
            async with asyncio.timeout(120):  # three failed probes, then SIGTERM (SIGKILL after the grace)
                while not (crashed := await _events(data_dir, "runner.instance_crashed")):
                    await asyncio.sleep(0.5)
        finally:
            if wedge.returncode is None:
                wedge.kill()
            await wedge.wait()
        (crash,) = crashed
        assert crash["instance_id"] == instance["id"]
        assert crash["reason"].startswith("completions failed while /health answered: 3 completions failed in a row")
        assert "no answer" in crash["reason"] and crash["restart_in_s"] is not None
        assert crash["out_of_memory"] is False  # the runner's own SIGKILL of a hung server is not the OOM killer's
        async with asyncio.timeout(120):  # restarted: the same instance, a new server process, ready
            while True:
                again = [i for i in await instances(data_dir) if i["id"] == instance["id"]]
                if again and again[0]["state"] == "ready" and again[0]["pid"] not in (None, pid):
                    break
                await asyncio.sleep(0.5)
        assert again[0]["restarts"] == 1 and await _events(data_dir, "runner.instance_restarted")
        later = await api.completions.create(model="alpha", prompt="after", max_tokens=2)
        assert later.choices and later.usage is not None and later.usage.completion_tokens == 2


async def test_one_default_node_serves_two_models_with_their_own_slots_and_cache_types_at_once(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """Per-model settings within the node's bounds: a node started with defaults runs `alpha` with 2 slots and
    q8_0 caches beside `beta` with 6 slots and f16 caches; each is sized, stamped and pinned with exactly its
    own, and its observed KV equals the prediction. A model asking beyond the node's bounds is refused, the
    bound named."""
    data_dir = tmp_path / "node"
    write_catalog(
        data_dir,
        {
            "alpha": {"path": str(models["wide"]), "ctx": 2048, "parallel": 2, "cache_type_k": "q8_0",
                      "cache_type_v": "q8_0", "flash_attn": "on", "max_queue": 4},
            "beta": {"path": str(models["beta"]), "ctx": 3072, "parallel": 6},
            "greedy": {"path": str(models["alpha"]), "ctx": 2048, "parallel": 16},
        },
    )  # fmt: skip
    port = free_port()
    async with node(data_dir, "mixed", *QUIET, "--max-slots", "8", "--http", str(port), env=KEYED):
        await wait_nodes(data_dir, "mixed")
        api = client(port)
        for name in ("alpha", "beta"):
            done = await api.completions.create(model=name, prompt="Hello there", max_tokens=4, temperature=0)
            assert done.usage is not None and done.usage.completion_tokens == 4
        running = {Path(i["model_path"]).name: i for i in await instances(data_dir)}
        assert set(running) == {"wide.gguf", "beta.gguf"}  # both at once on one node
        for file, (slots, k, v) in {"wide.gguf": (2, "q8_0", "q8_0"), "beta.gguf": (6, "f16", "f16")}.items():
            instance = running[file]
            stamped = instance["settings"]["settings"]
            assert (stamped["slots"], stamped["cache_type_k"], stamped["cache_type_v"]) == (slots, k, v)
            observed, predicted = instance["observed_memory"], instance["predicted_memory"]
            assert observed["kv_bytes"] == sum(d["kv_bytes"] for d in predicted["devices"]) > 0, file
        commands = [e["command"] for e in await _events(data_dir, "runner.instance_starting")]
        by_file = {Path(c[c.index("-m") + 1]).name: c for c in commands}
        wide, beta = by_file["wide.gguf"], by_file["beta.gguf"]
        assert wide[wide.index("-np") + 1] == "2" and wide[wide.index("-ctk") + 1] == "q8_0"
        assert beta[beta.index("-np") + 1] == "6" and beta[beta.index("-ctk") + 1] == "f16"
        with pytest.raises(openai.APIStatusError) as beyond:
            await api.completions.create(model="greedy", prompt="x", max_tokens=2)
        assert beyond.value.status_code == 500 and beyond.value.response.headers["x-should-retry"] == "false"
        body = beyond.value.body
        assert isinstance(body, dict) and body["reason"] == "settings_mismatch" and "max_slots 8" in body["message"]
        code, out, err = await cli("models", "--json", "--data-dir", str(data_dir))
        assert code == 0, err
        (door,) = json.loads(out)
        alpha = next(m for m in door["models"] if m["name"] == "alpha")
        assert alpha["settings"]["cache_type_k"] == "q8_0" and alpha["max_queue"] == 4
        code, out, _ = await cli("models", "--data-dir", str(data_dir))
        assert code == 0 and "-ctk q8_0 -ctv q8_0 -fa on" in out
