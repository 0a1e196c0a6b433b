"""Per-key limits shared by several front doors, and every request's usage, on a real nats-server.

Two front door actors share one bus (as two nodes' front doors share a NATS cluster), driven by the official
`openai` client; the mesh's router is played by a responder that answers every pass-through at once (or holds
them, for concurrency) with `usage` in the body and the same counts in its result. Keys are records in the keys
bucket, as `mesh-actor keys issue` writes them. The shared limits are also driven directly (`SharedLimits`), many
admissions at once from several front doors, to show the compare-and-set keeps the counts exact.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import time
from pathlib import Path
from typing import TypedDict, Unpack

import aiohttp
import openai
import pytest

from actors.frontdoor.keys import format_key, secret_digest
from messages.tenants import TenantKey
from runtime import buckets
from runtime.bus import Bus, decode, encode
from runtime.cli import usage as usage_cli
from runtime.cli.journal import read_events
from runtime.key_limits import KeyState
from runtime.shared_limits import LimitsUnavailable, SharedLimits
from tests.conftest import NatsServer
from tests.harness.cli import nats_flags
from tests.harness.doors import SUBJECTS, Router, client, complete, doors, ready_instance

pytestmark = pytest.mark.timeout(120)


class Limits(TypedDict, total=False):
    """A key's limits (`TenantKey`'s own fields): those not given are unlimited."""

    rpm: int
    tpm: int
    max_concurrent: int


# --- the mesh, played --------------------------------------------------------------------------------------------


async def issue(bus: Bus, tenant: str, **limits: Unpack[Limits]) -> tuple[str, TenantKey]:
    """A tenant key (what a client presents, and its record) stored in the keys bucket."""
    key_id, secret = secrets.token_hex(8), secrets.token_hex(32)
    record = TenantKey(
        key_id=key_id, tenant=tenant, secret_sha256=secret_digest(secret), created_at=time.time(), **limits
    )
    kv = await buckets.keys(bus, SUBJECTS)
    await kv.create(key_id, encode(record))
    return format_key(key_id, secret), record


async def refused(port: int, key: str, prompt: str = "one two three", max_tokens: int = 2) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        await complete(port, key, prompt, max_tokens)
    return caught.value


async def record_of(bus: Bus, key: TenantKey) -> KeyState | None:
    kv = await buckets.limits(bus, SUBJECTS)
    try:
        return decode((await kv.get(key.key_id)).value or b"", KeyState)
    except Exception:
        return None


# --- through the front doors ---------------------------------------------------------------------------------------


async def test_rpm_is_one_budget_for_two_front_doors_then_429_with_retry_after(bus: Bus, tmp_path: Path) -> None:
    model = await ready_instance(bus, tmp_path)
    key, _ = await issue(bus, "acme", rpm=3)
    other, _ = await issue(bus, "other", rpm=3)
    async with Router(bus), doors(bus, model) as (a, b):
        for port in (a, b, a):  # three requests, alternating doors: the budget
            done = await complete(port, key)
            assert done.usage is not None and done.usage.completion_tokens == 2
        for port in (b, a):  # the fourth is refused whichever door gets it
            error = await refused(port, key)
            assert error.status_code == 429, error
            assert int(error.response.headers["Retry-After"]) in range(1, 21)  # a token every 20 s
            body = error.response.json()["error"]
            assert body["code"] == "rate_limit_exceeded" and body["type"] == "rate_limit_error"
            assert body["limit"] == "rpm" and "requests per minute" in body["message"], body
        assert (await complete(b, other)).usage is not None  # another key has its own budget
        async with aiohttp.ClientSession() as session:  # Anthropic's shape on the Messages endpoint
            payload = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(f"http://127.0.0.1:{a}/v1/messages", json=payload,
                                    headers={"x-api-key": key}) as response:  # fmt: skip
                answer = await response.json()
                assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
        assert answer["type"] == "error" and answer["error"]["type"] == "rate_limit_error"
        assert "rpm" in answer["error"]["message"]


async def test_tpm_a_request_over_the_budget_refuses_the_next_until_refilled(bus: Bus, tmp_path: Path) -> None:
    model = await ready_instance(bus, tmp_path)
    key, record = await issue(bus, "acme", tpm=600)  # 10 tokens a second
    async with Router(bus), doors(bus, model) as (a, b):
        # nothing is taken before the answer: 3 + 617 tokens charged after it, 20 over the budget
        await complete(a, key, max_tokens=617)
        error = await refused(a, key)  # the same door knows its own charge at once
        assert error.status_code == 429 and error.response.json()["error"]["limit"] == "tpm"
        retry = int(error.response.headers["Retry-After"])
        assert 1 <= retry <= 2
        async with asyncio.timeout(5):  # the charge reaches the shared record: the other door refuses too
            while (state := await record_of(bus, record)) is None or state.tpm is None or state.tpm.level >= 0:
                await asyncio.sleep(0.02)
        assert (await refused(b, key)).status_code == 429
        await asyncio.sleep(retry)  # as the client was told
        assert (await complete(b, key, max_tokens=1)).usage is not None


async def test_max_concurrent_holds_across_two_front_doors(bus: Bus, tmp_path: Path) -> None:
    model = await ready_instance(bus, tmp_path)
    key, _ = await issue(bus, "acme", max_concurrent=2)
    async with Router(bus, hold=True) as router, doors(bus, model) as (a, b):
        first = asyncio.create_task(complete(a, key))
        second = asyncio.create_task(complete(b, key))
        async with asyncio.timeout(10):
            while router.held < 2:
                await asyncio.sleep(0.01)
        for port in (a, b):
            error = await refused(port, key)
            assert error.status_code == 429 and error.response.json()["error"]["limit"] == "max_concurrent"
            assert error.response.headers["Retry-After"] == "1"
        router.gate.set()
        async with asyncio.timeout(10):
            await asyncio.gather(first, second)
        assert (await complete(a, key)).usage is not None  # released: in again


async def test_usage_sums_equal_the_answers_own_usage(
    bus: Bus, nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = await ready_instance(bus, tmp_path)
    acme, _ = await issue(bus, "acme", rpm=100)
    beta, _ = await issue(bus, "beta")
    sums: dict[str, list[int]] = {"acme": [0, 0, 0], "beta": [0, 0, 0]}
    async with Router(bus), doors(bus, model) as (a, b):
        for i, (tenant, key) in enumerate([("acme", acme), ("beta", beta), ("acme", acme), ("acme", acme)]):
            done = await complete((a, b)[i % 2], key, prompt=" ".join(["w"] * (i + 2)), max_tokens=i + 1)
            sums[tenant][0] += 1
            sums[tenant][1] += done.usage.prompt_tokens
            sums[tenant][2] += done.usage.completion_tokens
        chat = await client(b, beta).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a b c d"}], max_tokens=3
        )
        assert chat.usage is not None
        sums["beta"] = [sums["beta"][0] + 1, sums["beta"][1] + chat.usage.prompt_tokens,
                        sums["beta"][2] + chat.usage.completion_tokens]  # fmt: skip
        with pytest.raises(openai.NotFoundError):  # refused: journaled too, with no tokens
            await client(a, beta).completions.create(model="absent", prompt="x", max_tokens=1)
        url, headers = f"http://127.0.0.1:{b}/v1/completions", {"Authorization": f"Bearer {beta}"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url=url, data=b"{not json", headers=headers) as response,  # not JSON: journaled too
        ):
            assert response.status == 400
    parser = argparse.ArgumentParser(prog="mesh-actor")
    usage_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["usage", "--json", "--since", "10m", *nats_flags(nats_server)])
    capsys.readouterr()
    assert await args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["tenant"], r["model"]): r for r in report["rows"]}
    for tenant, (requests, prompt, generated) in sums.items():
        row = rows[(tenant, "m")]
        assert (row["requests"], row["prompt_tokens"], row["generated_tokens"]) == (requests, prompt, generated), row
        assert row["cached_tokens"] == requests
    assert rows[("beta", "")]["requests"] == 1 and rows[("beta", "")]["prompt_tokens"] == 0
    assert rows[("beta", "")]["statuses"] == {"400": 1}
    assert rows[("beta", "absent")]["statuses"] == {"404": 1}  # the name it asked for, though none such exists
    args = parser.parse_args(["usage", "--json", "--tenant", "acme", *nats_flags(nats_server)])
    assert await args.func(args) == 0
    only = json.loads(capsys.readouterr().out)
    assert {r["tenant"] for r in only["rows"]} == {"acme"}
    assert only["total"]["requests"] == sums["acme"][0]
    args = parser.parse_args(["usage", "--since", "1h", *nats_flags(nats_server)])  # the table, for people
    assert await args.func(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["TENANT", "MODEL", "REQUESTS"] and table[-1].split()[:3] == ["total", "-", "7"]
    assert any(line.split()[:3] == ["acme", "m", "3"] for line in table), table


async def test_a_flood_of_refused_requests_is_journaled_as_a_few_events_and_counted_against_the_key(
    bus: Bus, nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 30, F5: every refused request journaled ~510 bytes of its own (6,000 events in 8 s) and a 404 cost
    no rpm. Refusals are journaled one event per kind per window, with their count; a 404 spends the key's rpm."""
    model = await ready_instance(bus, tmp_path)
    key, _ = await issue(bus, "acme", rpm=30)
    async with Router(bus), doors(bus, model, count=1) as (a,):
        api = client(a, key)
        statuses = []
        for _ in range(40):
            try:
                await api.completions.create(model="absent", prompt="x", max_tokens=1)
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)
        # 30 requests of a minute's budget were spent on a model that does not exist; then the key is refused
        assert statuses == [404] * 30 + [429] * 10, statuses
    events = []
    async for stored in read_events(bus, SUBJECTS, "frontdoor.request_usage", since=None, follow=False, private=True):
        events.append(json.loads(stored.data))
    refused = [e for e in events if e["tenant"] == "acme"]
    assert 1 <= len(refused) <= 4, refused  # one per kind (404, 429) per window: not one per request
    assert sum(e["count"] for e in refused if e["status"] == 404) == 30
    assert sum(e["count"] for e in refused if e["status"] == 429 and e["refused"] == "rpm") == 10
    parser = argparse.ArgumentParser(prog="mesh-actor")
    usage_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["usage", "--json", "--tenant", "acme", *nats_flags(nats_server)])
    capsys.readouterr()
    assert await args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["total"]["requests"] == 40


async def test_nats_unavailable_is_a_503_and_the_front_door_serves_again_after(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    model = await ready_instance(bus, tmp_path)
    key, _ = await issue(bus, "acme", rpm=100, tpm=100_000, max_concurrent=4)
    async with Router(bus), doors(bus, model, count=1) as (a,):
        assert (await complete(a, key)).usage is not None
        await nats_server.stop()
        error = await refused(a, key)
        assert error.status_code == 503 and "Retry-After" in error.response.headers
        assert "limits cannot be checked" in error.response.json()["error"]["message"]
        await nats_server.start()
        async with asyncio.timeout(30):  # the bus reconnects; the door never stopped serving
            while True:
                try:
                    await complete(a, key)
                    break
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503, exc
                    await asyncio.sleep(0.2)


# --- the shared limits, driven directly ------------------------------------------------------------------------


def key_record(**limits: Unpack[Limits]) -> TenantKey:
    return TenantKey(
        key_id=secrets.token_hex(8), tenant="acme", secret_sha256="0" * 64, created_at=time.time(), **limits
    )


async def test_concurrent_admissions_from_three_front_doors_take_exactly_the_budget(bus: Bus) -> None:
    key = key_record(rpm=25, max_concurrent=7)
    rpm_only = key_record(rpm=25)
    shared = [SharedLimits(bus, SUBJECTS, f"door-{i}") for i in range(3)]
    verdicts = await asyncio.gather(*(s.admit(rpm_only) for s in shared for _ in range(12)))
    assert sum(v is None for v in verdicts) == 25  # 36 asked at once: exactly the budget passes
    verdicts = await asyncio.gather(*(s.admit(key) for s in shared for _ in range(5)))
    assert sum(v is None for v in verdicts) == 7  # none released: at most max_concurrent in flight
    assert {v.limit for v in verdicts if v is not None} == {"max_concurrent"}


async def test_a_crashed_front_doors_count_expires_with_its_lease(bus: Bus) -> None:
    key = key_record(max_concurrent=1)
    crashed = SharedLimits(bus, SUBJECTS, "crashed", lease_s=1.0)
    alive = SharedLimits(bus, SUBJECTS, "alive", lease_s=1.0)
    assert await crashed.admit(key) is None  # and never released, nor renewed
    verdict = await alive.admit(key)
    assert verdict is not None and verdict.limit == "max_concurrent"
    async with asyncio.timeout(5):
        while (verdict := await alive.admit(key)) is not None:
            await asyncio.sleep(0.1)


async def test_a_live_front_door_renews_its_lease(bus: Bus) -> None:
    key = key_record(max_concurrent=1)
    serving = SharedLimits(bus, SUBJECTS, "serving", lease_s=1.5)
    other = SharedLimits(bus, SUBJECTS, "other", lease_s=1.5)
    flusher = asyncio.create_task(serving.run())
    try:
        assert await serving.admit(key) is None
        for _ in range(5):  # well past the lease (renewed every 0.5 s): still counted
            await asyncio.sleep(0.5)
            assert await other.admit(key) is not None
        serving.release(key, 0)
        async with asyncio.timeout(5):  # its release is written by its flusher: the other front door gets in
            while await other.admit(key) is not None:
                await asyncio.sleep(0.05)
    finally:
        flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flusher


async def test_owed_tokens_are_written_once_the_bus_is_back(bus: Bus, nats_server: NatsServer) -> None:
    key = key_record(tpm=1000)
    shared = SharedLimits(bus, SUBJECTS, "door")
    other = SharedLimits(bus, SUBJECTS, "other")
    assert await shared.admit(key) is None
    await nats_server.stop()
    with pytest.raises(LimitsUnavailable):
        await shared.admit(key)
    shared.release(key, 1500)
    await shared.flush()  # fails: kept
    await nats_server.start()
    async with asyncio.timeout(20):
        while not bus.nc.is_connected:
            await asyncio.sleep(0.1)
        while True:
            with contextlib.suppress(LimitsUnavailable):
                await shared.flush()
                verdict = await other.admit(key)
                if verdict is not None:
                    break
            await asyncio.sleep(0.2)
    assert verdict.limit == "tpm"


async def test_a_refusal_on_what_a_door_last_saw_is_checked_against_the_bucket(bus: Bus) -> None:
    key = key_record(max_concurrent=1)
    a, b = SharedLimits(bus, SUBJECTS, "a"), SharedLimits(bus, SUBJECTS, "b")
    assert await b.admit(key) is None
    assert await a.admit(key) is not None  # a now remembers b's request in flight
    b.release(key, 0)
    await b.flush()
    assert await a.admit(key) is None  # refused on its memory, admitted on the bucket's record
