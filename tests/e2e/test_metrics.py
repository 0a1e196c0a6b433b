"""Prometheus metrics of a real node, scraped and parsed as Prometheus would (prometheus-client's parsers).

`mesh-actor run` with a real nats-server (embedded) and real llama-servers on a generated tiny model. Requests go
through the front door with the official `openai` client, and through `mesh.generate` with `mesh-actor generate`;
`/metrics` then says what they did (counters moved by their tokens, the latency histograms with vLLM's buckets),
its memory figures are those `mesh-actor status --json` shows, each instance's own llama-server families come
back labelled, a model name a client invents makes no series, and the API key guards both listeners.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics.families import INTER_TOKEN_BUCKETS, TTFT_BUCKETS
from runtime.children import free_port
from tests.conftest import processes
from tests.harness.frontdoor import _WEDGE, KEY, KEYED, QUIET, client, write_catalog
from tests.harness.generate import wait_ready
from tests.harness.metrics import parse_openmetrics
from tests.harness.nodes import cli, events_of, node, wait_listening, wait_nodes
from tests.llama_harness import require_server
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

Samples = list[tuple[str, dict[str, str], float]]
INVENTED = "no-such-model-4711"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_server()
    return write_llama(tmp_path_factory.mktemp("metrics-models") / "alpha.gguf")


async def scrape(port: int, key: str | None = KEY, accept: str | None = None) -> tuple[int, str, str]:
    """GET /metrics: (status, content type, body)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    if accept is not None:
        headers["Accept"] = accept
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(f"http://127.0.0.1:{port}/metrics", headers=headers) as reply,
    ):
        return reply.status, reply.headers.get("Content-Type", ""), await reply.text()


def parsed(text: str) -> Samples:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())


def series(samples: Samples, name: str, **labels: str) -> list[dict[str, str]]:
    return [ls for n, ls, _ in samples if n == name and labels.items() <= ls.items()]


async def scraped_until(
    port: int, done: Callable[[Samples], bool], key: str | None = KEY, timeout_s: float = 30
) -> Samples:
    """Scrapes until `done` says the figures are in (events and reports arrive asynchronously), for `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while True:
            status, _, text = await scrape(port, key)
            assert status == 200, text
            samples = parsed(text)
            if done(samples):
                return samples
            await asyncio.sleep(0.3)


async def status_json(data_dir: Path) -> dict[str, Any]:
    code, out, err = await cli("status", "--json", "--data-dir", str(data_dir))
    assert code == 0, err
    record: dict[str, Any] = json.loads(out)
    return record


def assert_memory_equals_status(samples: Samples, instance: dict[str, Any], node_id: str) -> None:
    labels = {"node": node_id, "instance": instance["id"]}
    predicted, observed = instance["predicted_memory"], instance["observed_memory"]
    for kind in ("weights", "kv", "recurrent", "compute", "compute_margin", "output", "host_extra", "total"):
        assert value(samples, "mesh_memory_predicted_bytes", **labels, kind=kind) == predicted[f"{kind}_bytes"], kind
    for device in predicted["devices"]:
        for kind in ("weights", "kv", "compute", "total"):
            got = value(samples, "mesh_memory_predicted_device_bytes", **labels, device=device["device"], kind=kind)
            assert got == device[f"{kind}_bytes"], (device["device"], kind)
    for kind in ("weights", "kv", "recurrent", "compute", "output", "total"):
        assert value(samples, "mesh_memory_observed_bytes", **labels, kind=kind) == observed[f"{kind}_bytes"], kind
    for buffer, size in observed["devices"].items():
        assert value(samples, "mesh_memory_observed_buffer_bytes", **labels, buffer=buffer) == size, buffer


async def test_a_front_doors_metrics_move_with_the_openai_clients_requests_and_equal_status(
    tmp_path: Path, model: Path
) -> None:
    data_dir = tmp_path / "node"
    write_catalog(data_dir, {"alpha": {"path": str(model), "ctx": 2048}})
    http, metrics = free_port(), free_port()
    async with node(data_dir, "door", *QUIET, "--http", str(http), "--metrics", str(metrics), env=KEYED):
        await wait_nodes(data_dir, "door")
        await wait_listening(http, metrics)
        for port in (http, metrics):  # the key rule holds on both listeners
            for key in (None, "wrong-key"):
                status, _, body = await scrape(port, key)
                assert status == 401 and "invalid_api_key" in body, (port, key, body)
        status, content_type, text = await scrape(http)
        assert status == 200 and content_type.startswith("text/plain; version=0.0.4"), content_type
        before = parsed(text)
        assert not series(before, "mesh_generation_tokens_total")  # no request yet: the family, no series
        names = {f.name for f in text_string_to_metric_families(text)}
        assert names >= {"mesh_generation_tokens", "mesh_time_to_first_token_seconds"}

        api = client(http)
        whole = await api.completions.create(model="alpha", prompt="Hello there", max_tokens=8, temperature=0)
        stream = await api.chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        usages = [whole.usage, chunks[-1].usage]
        assert all(u is not None for u in usages)
        prompt_tokens = sum(u.prompt_tokens for u in usages if u is not None)
        generated = sum(u.completion_tokens for u in usages if u is not None)
        assert generated == 14
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model=INVENTED, prompt="x", max_tokens=2)
        code, _, err = await cli("generate", INVENTED, "hello", "-n", "2", "--data-dir", str(data_dir))
        assert code != 0 and "no_instance" in err + _, err  # routed through mesh.generate, refused

        def settled(s: Samples) -> bool:
            return (
                value(s, "mesh_request_success_total") == 2
                and value(s, "mesh_routing_refusals_total") == 1
                and bool(series(s, "mesh_num_requests_running"))
                and value(s, "mesh_num_requests_running") == 0
                # the front door's model states come with its next report (each second)
                and value(s, "mesh_frontdoor_model_state", model="alpha", state="ready") == 1
            )

        samples = await scraped_until(http, settled)
        (instance,) = [i for i in (await status_json(data_dir))["instances"] if i["state"] == "ready"]
        labels = {"node": "door", "model": "alpha", "instance": instance["id"]}

        # counters moved as the requests did
        assert value(samples, "mesh_generation_tokens_total", **labels) == generated
        assert value(samples, "mesh_prompt_tokens_total", **labels) == prompt_tokens
        assert value(samples, "mesh_prefix_cache_queries_total", **labels) == prompt_tokens
        assert value(samples, "mesh_requests_total", **labels, endpoint="completions", status="200") == 1
        assert value(samples, "mesh_requests_total", **labels, endpoint="chat", status="200") == 1
        assert value(samples, "mesh_request_success_total", model="alpha", finished_reason="length") == 2
        assert value(samples, "mesh_routed_requests_total", **labels) == 2  # by source, whichever they were
        assert value(samples, "mesh_frontdoor_model_loads_total", model="alpha") == 1
        assert value(samples, "mesh_frontdoor_queued_requests", model="alpha") == 0
        assert value(samples, "mesh_frontdoor_model_state", model="alpha", state="ready") == 1
        assert value(samples, "mesh_placement_decisions_total", outcome="admitted") == 1
        assert value(samples, "mesh_instance_state", **labels, state="ready") == 1

        # histograms have vLLM's buckets and one observation per request (per gap between tokens for ITL)
        ttft = {float(ls["le"]) for ls in series(samples, "mesh_time_to_first_token_seconds_bucket", model="alpha")}
        assert sorted(ttft) == [*TTFT_BUCKETS, float("inf")]
        itl = {float(ls["le"]) for ls in series(samples, "mesh_inter_token_latency_seconds_bucket", model="alpha")}
        assert sorted(itl) == [*INTER_TOKEN_BUCKETS, float("inf")]
        assert value(samples, "mesh_time_to_first_token_seconds_count", model="alpha") == 2
        assert value(samples, "mesh_time_to_first_token_seconds_bucket", model="alpha", le="+Inf") == 2
        assert 0 < value(samples, "mesh_time_to_first_token_seconds_sum", model="alpha") < 60
        assert value(samples, "mesh_inter_token_latency_seconds_count", model="alpha") == generated - 2
        assert value(samples, "mesh_e2e_request_latency_seconds_count", model="alpha") == 2

        # the instance's own llama-server families, labelled
        assert value(samples, "mesh_engine_metrics_up", **labels) == 1
        assert value(samples, "llamacpp:tokens_predicted_total", **labels) >= generated
        assert series(samples, "llamacpp:requests_processing", **labels)

        # memory: what status says, figure for figure
        shown = await status_json(data_dir)
        assert_memory_equals_status(samples, instance, "door")
        held: dict[str, int] = {}
        for r in shown["reservations"]:
            for device, size in r["held"].items():
                held[device] = held.get(device, 0) + size
        for device, size in held.items():
            assert value(samples, "mesh_node_memory_reserved_bytes", node="door", device=device) == size
        (node_status,) = shown["nodes"]
        assert value(samples, "mesh_l3_budget_bytes", node="door") == node_status["l3"]["budget_bytes"]

        # an invented model name is nowhere
        assert not [ls for _, ls, _ in samples if INVENTED in ls.values()]

        # the metrics-only listener says the same; OpenMetrics when asked for
        status_code, content_type, text = await scrape(metrics, accept="application/openmetrics-text; version=1.0.0")
        assert status_code == 200 and content_type.startswith("application/openmetrics-text"), content_type
        open_samples = [(s.name, s.labels, s.value) for f in parse_openmetrics(text) for s in f.samples]
        assert value(open_samples, "mesh_generation_tokens_total", **labels) == generated
    assert processes("llama-server", str(model)) == []  # the node took its servers with it


async def test_a_node_without_a_front_door_serves_metrics_on_loopback_for_mesh_generate(
    tmp_path: Path, model: Path
) -> None:
    data_dir = tmp_path / "node"
    port = free_port()
    code, _, err = await cli("run", "--data-dir", str(tmp_path / "refused"), "--metrics", "0.0.0.0:0", timeout=60)
    assert code == 2 and "beyond loopback" in err, err  # no key, no listener beyond loopback
    async with node(data_dir, "plain", *QUIET, "--metrics", str(port)):
        await wait_nodes(data_dir, "plain")
        await wait_listening(port)
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.get(f"http://127.0.0.1:{port}/v1/models") as other,
        ):
            assert other.status == 404  # only /metrics here
        code, out, err = await cli("place", str(model), "-c", "2048", "--start", "--json", "--data-dir", str(data_dir))
        assert code == 0, err
        await wait_ready(data_dir, json.loads(out)["instance"]["instance_id"])  # the start answers "starting"
        code, out, err = await cli("generate", "alpha", "Hello", "-n", "5", "--json", "--data-dir", str(data_dir))
        assert code == 0, err
        result = json.loads(out)
        samples = await scraped_until(
            port, lambda s: value(s, "mesh_request_success_total") == 1 and bool(series(s, "mesh_engine_metrics_up")),
            key=None,
        )  # fmt: skip
        labels = {"node": "plain", "model": "alpha", "instance": result["instance"]}
        assert value(samples, "mesh_generation_tokens_total", **labels) == result["tokens_generated"] == 5
        assert value(samples, "mesh_prompt_tokens_total", **labels) == result["prompt_tokens"]
        assert value(samples, "mesh_requests_total", **labels, endpoint="completion", status="200") == 1
        assert value(samples, "mesh_routed_requests_total", **labels, source=result["source"]) == 1
        assert value(samples, "mesh_time_to_first_token_seconds_sum", model="alpha") == pytest.approx(
            result["ttft_ms"] / 1000
        )
        assert value(samples, "mesh_e2e_request_latency_seconds_sum", model="alpha") == pytest.approx(
            result["total_ms"] / 1000
        )
        assert value(samples, "mesh_inter_token_latency_seconds_count", model="alpha") == 4
        assert not series(samples, "mesh_frontdoor_queued_requests")  # no front door here
        status = await status_json(data_dir)
        (instance,) = [i for i in status["instances"] if i["state"] == "ready"]
        assert_memory_equals_status(samples, instance, "plain")
        (node_status,) = status["nodes"]
        ram, limit = node_status["host"]["ram_total_bytes"], node_status["memory_limit_bytes"]
        assert value(samples, "mesh_node_memory_size_bytes", node="plain", device="CPU") == min(ram, limit or ram)

        os.kill(instance["pid"], signal.SIGKILL)  # what the kernel's OOM killer sends: a crash, then a restart
        samples = await scraped_until(
            port, lambda s: value(s, "mesh_instance_restarts_total", **labels) == 1
            and value(s, "mesh_instance_state", **labels, state="ready") == 1, key=None,
        )  # fmt: skip
        assert value(samples, "mesh_instance_crashes_total", **labels, out_of_memory="true") == 1
        assert value(samples, "mesh_instance_crashes_total", **labels, out_of_memory="false") == 0
    assert processes("llama-server", str(model)) == []


async def test_failed_probes_of_a_wedged_server_are_counted_then_its_restart(tmp_path: Path, model: Path) -> None:
    """The front door's wedge (its main thread stopped with ptrace: completions hang, /health says ok): each failed
    one-token probe is a `health_check_failed` event and a count, three make a crash, and the server restarts."""
    data_dir = tmp_path / "node"
    port = free_port()
    probing = ("--health-probe-interval", "1", "--health-probe-timeout", "2")
    async with node(data_dir, "wedged", *QUIET, *probing, "--metrics", str(port)):
        await wait_nodes(data_dir, "wedged")
        await wait_listening(port)
        code, _, err = await cli("place", str(model), "-c", "2048", "--start", "--data-dir", str(data_dir))
        assert code == 0, err
        (instance,) = [i for i in (await status_json(data_dir))["instances"] if i["state"] == "ready"]
        labels = {"node": "wedged", "model": "alpha", "instance": instance["id"]}
        wedge = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WEDGE, str(instance["pid"]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            assert wedge.stdout is not None
            async with asyncio.timeout(10):
                said = (await wedge.stdout.readline()).decode()
            if "wedged" not in said:
                pytest.skip(f"this machine does not allow ptrace on a child's child ({said.strip()})")
            samples = await scraped_until(
                port, lambda s: value(s, "mesh_instance_restarts_total", **labels) == 1, key=None, timeout_s=120
            )
        finally:
            if wedge.returncode is None:
                wedge.kill()
            await wedge.wait()
        assert value(samples, "mesh_health_check_failures_total", **labels, check="probe") == 3
        assert value(samples, "mesh_instance_crashes_total", **labels, out_of_memory="false") == 1
        failed = await events_of(data_dir, "--subject", "runner.health_check_failed")
        assert [(e["check"], e["consecutive"]) for e in failed] == [("probe", 1), ("probe", 2), ("probe", 3)]
        assert all(e["instance_id"] == instance["id"] for e in failed)
    assert processes("llama-server", str(model)) == []
