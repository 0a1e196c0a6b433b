"""The dashboard in a real browser: Debian's Chromium driven by Playwright, on a running two-node mesh.

Two `mesh-actor run` nodes share the first one's embedded NATS; the first has the front door (and so `/ui`),
under an API key. One instance runs on each node (placed through the CLI; the front door's catalog model is
served by them). The page, opened after the key was given to its form, loads with no console errors, shows every
node and instance, its bars' figures equal `mesh-actor status --json`, a request's events appear within 2 s, a
routing decision opens with its inputs and its replay, and requests without the key are refused. A screenshot
is saved (under the test's tmp dir, and under `$MESH_TEST_ARTIFACTS` when set).

Needs a Chromium binary (`chromium` on PATH: Debian's package) and the `playwright` package; the test is skipped
with the reason when either is missing. Playwright's own browser downloads are not used.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from runtime.children import free_port
from tests.conftest import processes
from tests.harness.frontdoor import KEY, KEYED, QUIET, client, write_catalog
from tests.harness.generate import wait_ready
from tests.harness.nodes import cli, nats_env, node, status_of, wait_nodes
from tests.llama_harness import require_server
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: How long any one browser wait may take (page loads, selectors), in milliseconds.
WAIT_MS = 20_000
#: How soon an event must show on the page once it happened.
EVENT_MS = 2_000


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_server()
    return write_llama(tmp_path_factory.mktemp("dashboard-models") / "alpha.gguf")


def keep_artifact(path: Path) -> None:
    """A copy of `path` under `$MESH_TEST_ARTIFACTS` when it is set (CI keeps that folder)."""
    artifacts = os.environ.get("MESH_TEST_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / path.name)


async def status_json(data_dir: Path) -> dict[str, Any]:
    record = await status_of(data_dir)
    assert record is not None, f"no status from {data_dir}"
    return record


async def get(url: str, **headers: str) -> tuple[int, str, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(url, headers=headers, allow_redirects=False) as reply,
    ):
        body = await reply.text() if not reply.content_type.startswith("text/event-stream") else ""
        return reply.status, reply.content_type, body


def expected_bar(status: dict[str, Any], node_id: str, device: str) -> dict[str, int]:
    """What `status --json` says of one device of one node: its size, what the ledger holds there, what the live
    instances there are predicted to take, kind by kind, and what their servers allocated there (this machine has
    no GPU: every buffer is host memory, `CPU…` or a pinned `…_Host`)."""
    (report,) = [n for n in status["nodes"] if n["node_id"] == node_id]
    limit = report["memory_limit_bytes"]
    if device == "CPU":
        total = report["host"]["ram_total_bytes"]
    else:
        total = next(g["total_bytes"] for g in report["gpus"] if f"GPU{g['index']}" == device)
    reserved = sum(r["held"].get(device, 0) for r in status["reservations"] if r["node_id"] == node_id)
    predicted = dict.fromkeys(("weights", "kv", "recurrent", "compute"), 0)
    observed = 0
    for instance in status["instances"]:
        if instance["node"] != node_id or instance["state"] in ("stopped", "failed", "rejected"):
            continue
        buffers = (instance["observed_memory"] or {}).get("devices", {})
        assert device == "CPU"
        observed += sum(v for b, v in buffers.items() if b.startswith("CPU") or b.endswith("_Host"))
        for d in instance["predicted_memory"]["devices"]:
            if d["device"] == device:
                for kind in predicted:
                    predicted[kind] += d[f"{kind}_bytes"]
    return {
        "size": total if limit is None else min(total, limit),
        "reserved": reserved,
        "observed": observed,
        **{f"predicted-{k}": v for k, v in predicted.items()},
    }


async def shown_bar(page: Any, node_id: str, device: str) -> dict[str, int]:
    bar = page.locator(f'.device[data-node="{node_id}"][data-device="{device}"]')
    names = ("size", "reserved", "observed", *(f"predicted-{k}" for k in ("weights", "kv", "recurrent", "compute")))
    return {name: int(await bar.get_attribute(f"data-{name}", timeout=WAIT_MS) or -1) for name in names}


async def test_the_dashboard_shows_a_two_node_mesh_live_in_a_real_browser(tmp_path: Path, model: Path) -> None:
    browser_path = chromium()
    playwright_api = pytest.importorskip("playwright.async_api")
    first, second = tmp_path / "door", tmp_path / "edge"
    write_catalog(first, {"alpha": {"path": str(model), "ctx": 2048}})
    http = free_port()
    base = f"http://127.0.0.1:{http}"
    async with node(first, "door", *QUIET, "--http", str(http), env=KEYED):
        env = await nats_env(first)
        async with node(second, "edge", *QUIET, env=env):
            await wait_nodes(first, "door", "edge")
            placed = []
            for node_id in ("edge", "door"):
                code, out, err = await cli("place", str(model), "-c", "2048", "--node", node_id, "--start", "--json",
                                           env=env)  # fmt: skip
                assert code == 0, err + out
                placed.append(json.loads(out)["instance"]["instance_id"])
                await wait_ready(first, placed[-1])
            on_edge = placed[0]
            api = client(http)
            await api.completions.create(model="alpha", prompt="Hello", max_tokens=2, temperature=0)

            # without the key: refused, and the page says how to give it (still an HTML page)
            for path in ("/ui", "/ui/stream", "/ui/static/app.js", "/ui/events/x"):
                code_, _, _ = await get(base + path)
                assert code_ == 401, path
            code_, kind, body = await get(base + "/ui")
            assert kind == "text/html" and 'action="/ui/session"' in body
            code_, _, _ = await get(base + "/ui/stream", Cookie="mesh_ui_session=99999999999.forged")
            assert code_ == 401
            code_, kind, body = await get(base + "/ui", Authorization=f"Bearer {KEY}")
            assert (code_, kind) == (200, "text/html") and "<main>" in body  # the contract: GET /ui is HTML

            async with playwright_api.async_playwright() as driver:
                browser = await driver.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
                try:
                    context = await browser.new_context(viewport={"width": 1600, "height": 1200})
                    context.set_default_timeout(WAIT_MS)
                    login = await context.new_page()
                    await login.goto(base + "/ui", timeout=WAIT_MS)
                    await login.fill('input[name="key"]', "wrong", timeout=WAIT_MS)
                    async with login.expect_navigation(timeout=WAIT_MS):
                        await login.click('button[type="submit"]', timeout=WAIT_MS)
                    assert await login.locator('input[name="key"]').count() == 1  # refused: the form again
                    await login.fill('input[name="key"]', KEY, timeout=WAIT_MS)
                    async with login.expect_navigation(timeout=WAIT_MS):
                        await login.click('button[type="submit"]', timeout=WAIT_MS)
                    await login.wait_for_selector('#connection[data-state="live"]', timeout=WAIT_MS)
                    await login.close()
                    (cookie,) = [c for c in await context.cookies() if c["name"] == "mesh_ui_session"]
                    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and KEY not in cookie["value"]

                    page = await context.new_page()  # the dashboard itself, watched from its first request
                    problems: list[str] = []
                    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                            if m.type in ("error", "warning") else None)  # fmt: skip
                    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                    reply = await page.goto(base + "/ui", timeout=WAIT_MS)
                    assert reply is not None and reply.status == 200
                    await page.wait_for_selector('#connection[data-state="live"]', timeout=WAIT_MS)

                    # every node and instance
                    status = await status_json(first)
                    instances = [i["id"] for i in status["instances"] if i["state"] == "ready"]
                    assert set(placed) <= set(instances), status["instances"]
                    for node_id in ("door", "edge"):
                        await page.wait_for_selector(f'.node[data-node="{node_id}"] .device', timeout=WAIT_MS)
                    for instance_id in instances:
                        row = page.locator(f'#instances tr[data-instance="{instance_id}"]')
                        await row.wait_for(timeout=WAIT_MS)
                        assert "ready" in await row.inner_text(timeout=WAIT_MS)
                    await page.wait_for_selector('#models tr[data-model="alpha"]', timeout=WAIT_MS)

                    # a bar's figures are what status says (read until the page has the same records)
                    async with asyncio.timeout(WAIT_MS / 1000):
                        while True:
                            status = await status_json(first)
                            want = {n: expected_bar(status, n, "CPU") for n in ("door", "edge")}
                            got = {n: await shown_bar(page, n, "CPU") for n in ("door", "edge")}
                            if got == want:
                                break
                            await asyncio.sleep(0.3)
                    assert all(want["edge"][k] > 0 for k in ("predicted-weights", "reserved", "observed"))
                    (edge,) = [i for i in status["instances"] if i["id"] == on_edge]
                    cell = page.locator(f'#instances tr[data-instance="{on_edge}"] td[data-kind="total"]')
                    shown = [int(await cell.get_attribute(f"data-{k}") or -1) for k in ("predicted", "observed")]
                    assert shown == [edge["predicted_memory"]["total_bytes"], edge["observed_memory"]["total_bytes"]]

                    # a new event shows within 2 s of the request that made it
                    rows = page.locator('#journal tr[data-type="generate_completed"]')
                    before = await rows.count()
                    await api.completions.create(model="alpha", prompt="Hello again", max_tokens=2, temperature=0)
                    # a locator's assertion, not wait_for_function: the page's CSP (script-src 'self') forbids the
                    # eval that wait_for_function polls with once its first check is false
                    await playwright_api.expect(rows).not_to_have_count(before, timeout=EVENT_MS)

                    # a routing decision opens with its inputs and today's router's verdict
                    await page.locator('#journal tr[data-type="generate_routed"]').first.click(timeout=WAIT_MS)
                    await page.wait_for_selector("#detail .replay", timeout=WAIT_MS)
                    detail = await page.inner_text("#detail", timeout=WAIT_MS)
                    assert "routing decision" in detail and "decides the same" in detail, detail
                    assert "inputs" in detail
                    # and so does a placement, re-decided by today's admission from its recorded inputs
                    await page.locator('#journal tr[data-type="placement_decided"]').first.click(timeout=WAIT_MS)
                    await page.wait_for_selector("#detail .replay", timeout=WAIT_MS)
                    detail = await page.inner_text("#detail", timeout=WAIT_MS)
                    assert "placement decision" in detail and "decides the same" in detail, detail

                    shot = tmp_path / "dashboard.png"
                    await page.screenshot(path=str(shot), full_page=True, timeout=WAIT_MS)
                    assert shot.stat().st_size > 10_000
                    keep_artifact(shot)
                    assert problems == [], problems
                finally:
                    await browser.close()
    assert processes("llama-server", str(model)) == []
