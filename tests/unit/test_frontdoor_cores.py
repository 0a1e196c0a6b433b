"""The front door's pure cores: the catalog, OpenAI shapes, and models on demand (what to stop, what idles)."""

from __future__ import annotations

import pytest

from actors.frontdoor import openai_api as oa
from actors.frontdoor.catalog import CatalogError, parse_catalog
from actors.frontdoor.lifecycle import ArrivalOrder, NeverFits, Running, Stop, Wait, idle_expired, plan_room
from messages.generate import GenerateResult
from messages.placement import DeviceShortfall, PreferredSettings
from messages.settings import ServingSettings

MIB = 1 << 20


# ---- catalog ----


def test_a_catalog_lists_models_with_defaults_and_refuses_unknown_fields_and_bad_names() -> None:
    catalog = parse_catalog('[models.a]\npath = "a.gguf"\n[models.b]\npath = "/m/b.gguf"\npinned = true\nctx = 8192\n')
    assert sorted(catalog.models) == ["a", "b"]
    assert catalog.models["a"].ctx == 4096 and not catalog.models["a"].pinned
    assert catalog.models["b"].pinned and catalog.models["b"].ctx == 8192
    with pytest.raises(CatalogError, match=r"\[models.a\].*colour"):
        parse_catalog('[models.a]\npath = "a"\ncolour = "red"\n')
    with pytest.raises(CatalogError, match="model name"):
        parse_catalog('[models."a b"]\npath = "a"\n')
    with pytest.raises(CatalogError, match="not TOML"):
        parse_catalog("[models.a\n")
    with pytest.raises(CatalogError, match="unknown"):
        parse_catalog("[other]\nx = 1\n")
    assert parse_catalog("").models == {}


def test_per_model_serving_settings_become_placement_requirements_and_bad_ones_are_refused() -> None:
    catalog = parse_catalog(
        '[models.q]\npath = "q.gguf"\nparallel = 2\ncache_type_k = "q8_0"\ncache_type_v = "q4_0"\n'
        'flash_attn = "on"\nspec_type = "ngram-simple"\nspec_draft_n_max = 8\nmax_queue = 5\n'
        '[models.plain]\npath = "p.gguf"\n'
    )
    q = catalog.models["q"]
    assert q.required_settings() == PreferredSettings(
        slots=2, cache_type_k="q8_0", cache_type_v="q4_0", flash_attn="on", spec_type="ngram-simple",
        spec_draft_n_max=8,
    )  # fmt: skip
    assert q.max_queue == 5
    assert catalog.models["plain"].required_settings() is None  # whatever the node advertises
    # an instance is one of this model's only when it runs as required
    node = ServingSettings(slots=2, cache_type_k="q8_0", cache_type_v="q4_0", spec_type="ngram-simple",
                           spec_draft_n_max=8)  # fmt: skip
    assert q.runs_on(node) and catalog.models["plain"].runs_on(ServingSettings())
    assert not q.runs_on(ServingSettings(slots=2, spec_type="ngram-simple", spec_draft_n_max=8))  # f16 caches
    for table, field in (
        ('cache_type_k = "q3"', "cache_type_k"),
        ('cache_type_v = "q8_0"\nflash_attn = "off"', "flash_attn"),  # llama-server refuses a quantized V without it
        ('spec_type = "telepathy"', "spec_type"),
        ('spec_type = "draft-mtp,bogus"', "bogus"),
        ("spec_draft_n_max = -1", "spec_draft_n_max"),
        ('flash_attn = "auto"', "flash_attn"),
        ("max_queue = -1", "max_queue"),
    ):
        with pytest.raises(CatalogError, match=rf"\[models.m\].*{field}"):
            parse_catalog(f'[models.m]\npath = "m"\n{table}\n')


# ---- OpenAI shapes ----


def _result(**fields: object) -> GenerateResult:
    base: dict[str, object] = dict(
        request_id="r1", text="hi", tokens=[5, 6], prompt_tokens=10, source="l3_local", tokens_restored=9,
        tokens_cached=9, tokens_evaluated=1, ttft_ms=1.0, total_ms=2.0, node="n", instance="i", slot=0,
        stop_reason="limit", tokens_generated=2,
    )  # fmt: skip
    base.update(fields)
    return GenerateResult(**base)  # type: ignore[arg-type]


def test_requests_decode_leniently_but_refuse_what_changes_the_answer_with_the_field_named() -> None:
    request = oa.decode(b'{"model": "m", "prompt": "x", "user": "u", "logprobs": null}', oa.CompletionRequest)
    assert request.max_tokens == 16
    with pytest.raises(oa.ApiError) as n:
        oa.decode(b'{"model": "m", "prompt": "x", "n": 3}', oa.CompletionRequest)
    assert (n.value.status, n.value.param) == (400, "n")
    with pytest.raises(oa.ApiError) as bad:
        oa.decode(b'{"model": "m", "prompt": "x", "max_tokens": 0}', oa.CompletionRequest)
    assert bad.value.param == "max_tokens"
    with pytest.raises(oa.ApiError) as role:
        oa.decode(b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', oa.ChatRequest)
    assert role.value.status == 400
    with pytest.raises(oa.ApiError, match="not JSON"):
        oa.decode(b"{", oa.ChatRequest)


def test_openai_defaults_and_stop_words_map_onto_a_generation() -> None:
    chat = oa.decode(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": "END"}', oa.ChatRequest)
    order = oa.to_generate(chat, "prompt", timeout_s=60, request_id="r")
    assert order.sampling.temperature == 0.8 and order.sampling.top_k == 40 and order.sampling.stop == ("END",)
    parts = (
        b'{"model": "m", "messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}'
    )
    assert oa.chat_messages(oa.decode(parts, oa.ChatRequest)) == [{"role": "user", "content": "ab"}]


def test_usage_counts_cached_tokens_and_finish_reasons_follow_the_stop() -> None:
    done = oa.completion(_result(), model="m", created=1)
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 9 and done["usage"]["total_tokens"] == 12
    assert done["choices"][0]["finish_reason"] == "length"
    assert oa.chat_completion(_result(stop_reason="eos"), model="m", created=1)["choices"][0]["finish_reason"] == "stop"
    assert oa.usage(_result(tokens=[1], tokens_generated=3))["completion_tokens"] == 3
    error = oa.error_body(oa.ApiError(507, "never fits", "insufficient_memory", extra={"need_bytes": {"CPU": 1}}))
    assert error["error"]["need_bytes"] == {"CPU": 1} and set(error["error"]) >= {"message", "type", "param", "code"}


# ---- models on demand ----


def _run(iid: str, mib: int, *, node: str = "n", **fields: object) -> Running:
    return Running(instance_id=iid, node=node, model=iid, held={"CPU": mib * MIB}, **{"last_used": 0.0, **fields})  # type: ignore[arg-type]


def _short(need: int, have: int) -> dict[str, list[DeviceShortfall]]:
    return {"n": [DeviceShortfall(device="CPU", need_bytes=need * MIB, have_bytes=have * MIB)]}


def test_room_is_made_lowest_priority_then_least_recently_used_first_never_pinned_or_in_use() -> None:
    running = [
        _run("old", 4, last_used=1.0),
        _run("new", 4, last_used=5.0),
        _run("important", 4, last_used=0.5, priority=9),
        _run("pinned", 100, pinned=True),
    ]
    plan = plan_room(_short(6, 3), running, now=100.0)
    assert isinstance(plan, Stop) and plan.instances == ("old",)
    plan = plan_room(_short(10, 3), running, now=100.0)
    assert isinstance(plan, Stop) and plan.instances == ("old", "new")
    busy = [_run("a", 4, in_use=True), _run("b", 4, last_used=99.9)]  # b was used 0.1 s ago
    assert isinstance(plan_room(_short(6, 3), busy, now=100.0), Wait)


def test_a_model_that_cannot_fit_even_with_every_unpinned_instance_stopped_never_fits() -> None:
    plan = plan_room(_short(50, 3), [_run("a", 4), _run("p", 40, pinned=True)], now=100.0)
    assert isinstance(plan, NeverFits)
    assert plan.need == {"CPU": 50 * MIB} and plan.have == {"CPU": 7 * MIB} and plan.node == "n"


def test_the_node_needing_the_fewest_stops_is_chosen() -> None:
    shortfalls = {
        "x": [DeviceShortfall(device="CPU", need_bytes=8 * MIB, have_bytes=0)],
        "y": [DeviceShortfall(device="CPU", need_bytes=8 * MIB, have_bytes=4 * MIB)],
    }
    running = [_run("x1", 4, node="x"), _run("x2", 4, node="x"), _run("y1", 4, node="y")]
    plan = plan_room(shortfalls, running, now=100.0)
    assert isinstance(plan, Stop) and (plan.node, plan.instances) == ("y", ("y1",))


def test_idle_instances_stop_after_their_ttl_unless_pinned_or_in_use() -> None:
    running = [
        _run("idle", 1, last_used=0.0, idle_ttl_s=10.0),
        _run("recent", 1, last_used=95.0, idle_ttl_s=10.0),
        _run("pinned", 1, last_used=0.0, idle_ttl_s=10.0, pinned=True),
        _run("busy", 1, last_used=0.0, idle_ttl_s=10.0, in_use=True),
        _run("forever", 1, last_used=0.0),
    ]
    assert idle_expired(running, now=100.0) == ["idle"]


def test_with_device_sizes_a_lagging_view_is_a_wait_and_never_fits_only_beyond_the_size() -> None:
    stale = _short(5, 3)  # placement still counts an instance our view already saw stop
    assert isinstance(plan_room(stale, [], now=100.0, sizes={"n": {"CPU": 8 * MIB}}), Wait)
    never = plan_room(stale, [_run("p", 4, pinned=True)], now=100.0, sizes={"n": {"CPU": 8 * MIB}})
    assert isinstance(never, NeverFits) and never.have == {"CPU": 4 * MIB}  # the size less what is pinned


def test_without_grouping_requests_go_in_arrival_order_across_models() -> None:
    order = ArrivalOrder()
    a1, b1, a2, b2 = (order.arrive(m) for m in ("a", "b", "a", "b"))
    assert order.may_go(a1) and not order.may_go(b1) and not order.may_go(a2)
    order.leave(a1)  # a1 has its instance
    assert order.may_go(b1) and not order.may_go(a2) and not order.may_go(b2)
    order.leave(b1)
    assert order.may_go(a2) and not order.may_go(b2)
    a3 = order.arrive("a")
    assert not order.may_go(a3)  # b2 came before it: no jumping onto the model that is loaded
    order.leave(a2)
    assert order.may_go(b2) and not order.may_go(a3)
    order.leave(b2)
    order.leave(b2)  # leaving twice is harmless
    assert order.may_go(a3) and len(order) == 1
