"""The front door's pure cores (the catalog, the HTTP surface, models on demand) and the runner's pass-through
core (what is forwarded, rendered, relayed and counted)."""

from __future__ import annotations

import json

import pytest

from actors.frontdoor import shapes
from actors.frontdoor.catalog import CatalogError, parse_catalog
from actors.frontdoor.ondemand_rules import ArrivalOrder, NeverFits, Running, Stop, Wait, idle_expired, plan_room
from actors.runner import passthrough
from messages.errors import INSUFFICIENT_MEMORY, MODEL_NOT_FOUND, NO_INSTANCE, REGISTRY, http_status, retryable
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


# ---- the HTTP surface (shapes) ----


def test_keys_are_taken_from_a_bearer_token_in_any_case_or_x_api_key() -> None:
    assert shapes.presented_key({"Authorization": "Bearer k1"}) == "k1"
    assert shapes.presented_key({"Authorization": "bearer  k1 "}) == "k1"
    assert shapes.presented_key({"Authorization": "BEARER k1"}) == "k1"
    assert shapes.presented_key({"x-api-key": "k2"}) == "k2"
    assert shapes.presented_key({"Authorization": "Basic abc"}) is None
    assert shapes.presented_key({"Authorization": "Bearer "}) is None
    assert shapes.key_matches("k1", "k1") and not shapes.key_matches("k", "k1") and not shapes.key_matches(None, "k")


def test_errors_take_the_endpoints_shape_and_the_registrys_status_and_retry_advice() -> None:
    assert shapes.shape_of("/v1/messages") == shapes.shape_of("/v1/messages/count_tokens") == "anthropic"
    assert shapes.shape_of("/v1/chat/completions") == shapes.shape_of("/v1/nowhere") == "openai"
    never = shapes.ApiError(INSUFFICIENT_MEMORY, "never fits", extra={"need_bytes": {"CPU": 1}})
    body = shapes.error_body(never, "openai")
    assert never.status == 507 and body["error"]["need_bytes"] == {"CPU": 1}
    assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["code"] == "insufficient_memory"
    assert shapes.error_headers(INSUFFICIENT_MEMORY) == {"x-should-retry": "false"}  # 5xx no SDK should retry
    anthropic = shapes.error_body(shapes.ApiError(MODEL_NOT_FOUND, "no such model"), "anthropic")
    assert anthropic == {"type": "error", "error": {"type": "not_found_error", "message": "no such model"}}
    busy = shapes.error_headers(NO_INSTANCE)
    assert busy["x-should-retry"] == "true" and int(busy["Retry-After"]) >= 1
    assert http_status("a_code_from_a_newer_peer") == 502 and not retryable("a_code_from_a_newer_peer")
    for entry in REGISTRY.values():  # 503 only for what a retry can fix
        assert entry.http_status != 503 or entry.retryable, entry.code


def test_a_servers_error_keeps_its_status_and_fields_and_takes_anthropics_shape_on_messages() -> None:
    server = (
        b'{"error":{"code":400,"message":"too long","type":"exceed_context_size_error","n_prompt_tokens":9,"n_ctx":8}}'
    )
    assert shapes.server_error_body(400, server, "openai") == server  # unchanged
    converted = json.loads(shapes.server_error_body(400, server, "anthropic"))
    assert converted == {"type": "error", "error": {"type": "invalid_request_error", "message": "too long",
                                                    "n_prompt_tokens": 9, "n_ctx": 8}}  # fmt: skip
    assert shapes.server_error_body(500, b"not json", "anthropic") == b"not json"


def test_a_relayed_answer_names_the_catalog_model_and_nothing_else_changes() -> None:
    whole = rb'{"id":"x","model":"/models/a.gguf","choices":[{"text":"\u00e9"}],"usage":{"prompt_tokens":3}}'
    renamed = json.loads(shapes.rename_json(whole, "alpha"))
    assert renamed == {**json.loads(whole), "model": "alpha"}
    assert shapes.rename_json(b'{"data":[1]}', "alpha") == b'{"data":[1]}'  # no model: the bytes as they came
    events = (
        b'event: message_start\ndata: {"type":"message_start","message":{"model":"/m.gguf","id":"m1"}}\n\n'
        b'data: {"choices":[],"model":"/m.gguf"}\n\ndata: [DONE]\n\n'
    )
    out = shapes.rename_events(events, "alpha")
    assert b"/m.gguf" not in out and out.count(b'"alpha"') == 2 and out.endswith(b"data: [DONE]\n\n")
    assert out.startswith(b"event: message_start\ndata: ")


def test_a_streams_model_is_renamed_by_bytes_once_its_name_is_known_and_alike_to_parsing() -> None:
    renamer = shapes.ModelRenamer("alpha")
    first = b'data: {"choices":[{"delta":{"role":"assistant"}}],"model":"/m/a.gguf","id":"c1"}\n\n'
    later = b'data: {"choices":[{"delta":{"content":"\\u00e9 x"}}],"model":"/m/a.gguf","id":"c1"}\n\n'
    assert renamer.events(first) == shapes.rename_events(first, "alpha")  # parsed: learns the server's name
    fast = renamer.events(later)
    assert json.loads(fast[6:]) == json.loads(shapes.rename_events(later, "alpha")[6:])
    assert fast == later.replace(b'"/m/a.gguf"', b'"alpha"')  # the bytes as they came, but for the name
    nested = b'event: message_start\ndata: {"type":"message_start","message":{"model":"/m/a.gguf"}}\n\n'
    assert b"/m/a.gguf" not in renamer.events(nested)
    assert renamer.events(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


# ---- pass-through (runner core) ----


def test_a_body_is_a_json_object_and_deep_nesting_is_a_clear_error() -> None:
    assert passthrough.decode_body(b'{"model": "m", "x": [1]}') == {"model": "m", "x": [1]}
    for data, why in ((b"{", "not JSON"), (b"[1]", "JSON object"), (b'{"x":' + b"[" * 10**5 + b"]" * 10**5 + b"}",
                                                                         "nested too deeply")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            passthrough.decode_body(data)


def test_only_the_slot_is_set_in_a_forwarded_body() -> None:
    body = {"model": "m", "messages": [], "tools": [{"x": 1}], "id_slot": 3, "n": 2, "logprobs": True}
    forwarded = passthrough.forward_body(body, 1)
    assert forwarded == {**body, "id_slot": 1, "cache_prompt": True}
    assert passthrough.forward_body({**body, "cache_prompt": False}, 0)["cache_prompt"] is False  # the client's
    assert "id_slot" not in passthrough.forward_body(body, None)  # embeddings: the server picks
    # where no cached prompt may be reused (a shared prompt cache that held two scopes), whatever the client said
    assert passthrough.forward_body({**body, "cache_prompt": True}, 1, reuse=False)["cache_prompt"] is False


def test_bodies_are_rendered_the_way_the_server_renders_them_or_not_at_all() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert passthrough.render_plan("chat", chat) == passthrough.Template(chat)
    assert passthrough.render_plan("completions", {"prompt": "hi"}) == passthrough.PromptText("hi")
    assert passthrough.render_plan("completions", {"prompt": ["hi"]}) == passthrough.PromptText("hi")
    assert passthrough.render_plan("completions", {"prompt": [1, 2]}) == passthrough.Given((1, 2))
    assert passthrough.render_plan("completions", {"prompt": [[1, 2]]}) == passthrough.Given((1, 2))
    for endpoint, body in (
        ("completions", {"prompt": ["a", "b"]}),  # two prompts: two tasks
        ("completions", {"prompt": [1, -2]}),
        ("completions", {"prompt": [True]}),
        ("chat", {"messages": []}),
        ("messages", {"system": "x"}),  # no messages: the server refuses it
        ("embeddings", {"input": "x"}),
    ):
        assert passthrough.render_plan(endpoint, body) is None, (endpoint, body)
    assert [passthrough.endpoint_kind(e) for e in ("chat", "count_tokens", "rerank")] == ["generate", "count", "pooled"]


def test_prompts_holding_media_are_found_in_every_shape() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    assert passthrough.has_media("chat", {"messages": [{"role": "user", "content": [image]}]})
    assert passthrough.has_media("messages", {"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert passthrough.has_media("responses", {"input": [{"content": [{"type": "input_image"}]}]})
    assert not passthrough.has_media("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert not passthrough.has_media("embeddings", {"input": [image]})


def test_events_are_cut_only_between_whole_events() -> None:
    cutter = passthrough.SseCutter(max_pending=64)
    assert cutter.feed(b'data: {"a"') == b""
    assert cutter.feed(b":1}\n\ndata: {") == b'data: {"a":1}\n\n'
    assert cutter.feed(b"}\r\n\r\n") == b"data: {}\n\n"
    assert cutter.feed(b"data: [DONE]") == b"" and cutter.rest() == b"data: [DONE]"
    with pytest.raises(ValueError, match="over 64"):
        cutter.feed(b"x" * 65)
    assert passthrough.sse_data(b'event: e\ndata: {"x":1}\n\ndata: a\ndata: b\n\n') == ['{"x":1}', "a\nb"]


def test_token_counts_are_read_from_each_shape_of_answer() -> None:
    chat = {"usage": {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 7}},
            "timings": {"cache_n": 7, "prompt_n": 3, "predicted_n": 4}}  # fmt: skip
    assert passthrough.answer_tokens([chat]) == passthrough.AnswerTokens(prompt=10, cached=7, evaluated=3, generated=4)
    anthropic = {"usage": {"input_tokens": 1, "cache_read_input_tokens": 172, "output_tokens": 8}}
    assert passthrough.answer_tokens([anthropic]) == passthrough.AnswerTokens(prompt=173, cached=172, generated=8)
    usage = {"input_tokens": 5, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 4}}
    responses = {"type": "response.completed", "response": {"usage": usage}}
    assert passthrough.answer_tokens([None, responses]) == passthrough.AnswerTokens(prompt=5, cached=4, generated=2)
    assert passthrough.answer_tokens([{"usage": {"prompt_tokens": -3}}]) == passthrough.AnswerTokens()
    slots = [{"id": 0, "next_token": [{"n_decoded": 9}], "is_processing": True}, {"id": 1}]
    assert passthrough.slot_decoded(slots, 0) == 9 and passthrough.slot_decoded(slots, 1) == 0
    assert passthrough.slot_decoded({"error": 1}, 0) == 0
    assert passthrough.slot_decoded([{"id": 0, "next_token": 3}], 0) == 0


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


def test_a_higher_class_may_stop_a_lower_classs_idle_instance_within_its_grace_and_nothing_else() -> None:
    just_used = [_run("low", 4, last_used=99.9, used_class=0), _run("high", 4, last_used=99.9, used_class=5)]
    # the default class waits the grace out, whoever used them
    assert isinstance(plan_room(_short(6, 3), just_used, now=100.0), Wait)
    # class 3 may stop what class 0 used a moment ago, not what class 5 used
    plan = plan_room(_short(6, 3), just_used, now=100.0, requester_class=3)
    assert isinstance(plan, Stop) and plan.instances == ("low",)
    assert isinstance(plan_room(_short(10, 3), just_used, now=100.0, requester_class=3), Wait)
    # no class stops a pinned instance or one in use
    kept = [_run("pinned", 4, pinned=True, used_class=0), _run("busy", 4, in_use=True, used_class=0)]
    assert isinstance(plan_room(_short(6, 3), kept, now=100.0, requester_class=9), Wait)
    # among the stoppable, the catalog's priority first, then the lower class of the last use
    idle = [_run("a", 4, used_class=4), _run("b", 4, used_class=1, last_used=50.0)]
    plan = plan_room(_short(6, 3), idle, now=100.0, requester_class=9)
    assert isinstance(plan, Stop) and plan.instances == ("b",)


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


def test_messages_and_responses_bodies_are_rendered_as_the_chat_body_the_server_converts_them_to() -> None:
    messages = {"model": "m", "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    converted = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }
    assert passthrough.render_plan("messages", messages) == passthrough.Template(converted)
    assert passthrough.render_plan("count_tokens", messages) == passthrough.Template(converted)
    responses = {"model": "m", "input": "hi", "instructions": "Be brief."}
    chat = {"model": "m", "messages": converted["messages"]}
    assert passthrough.render_plan("responses", responses) == passthrough.Template(chat)
    assert passthrough.render_plan("responses_input_tokens", responses) == passthrough.Template(chat)
    # a body the server refuses, or one with nothing to render, is not rendered: routed by load, decoded cold
    assert passthrough.render_plan("responses", {"input": [{"type": "item_reference", "id": "x"}]}) is None
    assert passthrough.render_plan("messages", {"messages": []}) is None


def test_a_catalogs_replica_keys_default_to_one_instance_and_refuse_a_minimum_over_the_maximum() -> None:
    plain = parse_catalog('[models.m]\npath = "m.gguf"\n').models["m"]
    assert (plain.min_replicas, plain.max_replicas) == (0, 1)
    scaled = parse_catalog('[models.m]\npath = "m.gguf"\nmin_replicas = 1\nmax_replicas = 3\ntarget_wait_s = 2\n')
    assert (scaled.models["m"].max_replicas, scaled.models["m"].target_wait_s) == (3, 2.0)
    with pytest.raises(CatalogError, match="min_replicas"):
        parse_catalog('[models.m]\npath = "m.gguf"\nmin_replicas = 3\nmax_replicas = 2\n')
    with pytest.raises(CatalogError, match="max_replicas"):
        parse_catalog('[models.m]\npath = "m.gguf"\nmax_replicas = 0\n')


# ---- what one pass-through request may ask (issue 30: F3, F4, F11, F12) ----


def test_the_generation_bound_is_the_one_the_server_obeys() -> None:
    # llama-server reads `n_predict`, else its aliases `max_completion_tokens` then `max_tokens` (F12: a body
    # with `max_tokens: 2` and `n_predict: 200` generates 200)
    assert passthrough.generation_bound("completions", {"max_tokens": 2, "n_predict": 200}) == 200
    assert passthrough.generation_bound("chat", {"max_tokens": 2, "max_completion_tokens": 9}) == 9
    assert passthrough.generation_bound("chat", {"max_tokens": 7}) == 7
    assert passthrough.generation_bound("chat", {"n_predict": -1, "max_tokens": 7}) is None  # -1: unbounded
    assert passthrough.generation_bound("chat", {}) is None
    # the Responses shape's `max_output_tokens` becomes `max_tokens`; `n_predict` still wins
    assert passthrough.generation_bound("responses", {"max_output_tokens": 5, "max_tokens": 50}) == 5
    assert passthrough.generation_bound("responses", {"max_output_tokens": 5, "n_predict": 60}) == 60
    # Anthropic's Messages: `max_tokens` alone (4096 when absent); other fields are not passed to the server
    assert passthrough.generation_bound("messages", {"max_tokens": 3, "n_predict": 900}) == 3
    assert passthrough.generation_bound("messages", {}) == 4096


def test_several_completions_and_too_many_alternatives_per_token_are_refused_before_any_work() -> None:
    limits = passthrough.AskLimits()
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1, "logprobs": True,
          "top_logprobs": 20}  # fmt: skip
    assert passthrough.refused_asks("chat", ok, limits) is None
    assert passthrough.refused_asks("completions", {"prompt": "x", "n_probs": 20, "logprobs": 5}, limits) is None
    # the 79-byte body that made a server answer 62 MB (F3)
    refused = passthrough.refused_asks("completions", {"n_probs": 32000, "max_tokens": 20}, limits)
    assert refused is not None and "n_probs" in refused and "20" in refused
    assert "top_logprobs" in (passthrough.refused_asks("chat", {**ok, "top_logprobs": 21}, limits) or "")
    assert "logprobs" in (passthrough.refused_asks("completions", {"logprobs": 100}, limits) or "")
    # several completions run in slots the mesh did not book, and were charged as one (F4)
    assert "`n` = 2" in (passthrough.refused_asks("chat", {**ok, "n": 2}, limits) or "")
    assert "n_cmpl" in (passthrough.refused_asks("completions", {"prompt": "x", "n_cmpl": 3}, limits) or "")
    # several prompts in one completions request: as many slots (one prompt of token ids is one prompt)
    assert "2 prompts" in (passthrough.refused_asks("completions", {"prompt": ["a", "b"]}, limits) or "")
    assert passthrough.refused_asks("completions", {"prompt": [1, 2, 3]}, limits) is None
    # embeddings and counts generate nothing: their fields are the server's to judge
    assert passthrough.refused_asks("embeddings", {"input": "x", "n": 5}, limits) is None


def test_every_prompt_the_server_would_tokenize_is_sized_before_it_does() -> None:
    # F11: prompt lists and count endpoints were tokenized (612k and 1.22M tokens) before any refusal
    body = {"messages": [{"role": "user", "content": "é" * 10}], "system": "abc", "tools": [{"d": "xy"}]}
    assert passthrough.prompt_sizes("count_tokens", body) == [20 + len("user") + 3 + 2]  # every text it renders
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    with_image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    assert passthrough.prompt_sizes("chat", with_image) == [len("usertexthi")]  # media is not text
    assert passthrough.prompt_sizes("embeddings", {"input": ["ab", "cde"]}) == [2, 3]
    assert passthrough.prompt_sizes("embeddings", {"input": "abcd"}) == [4]
    assert passthrough.prompt_sizes("embeddings", {"input": [5, 6, 7]}) == [3]  # one prompt of token ids
    assert passthrough.prompt_sizes("rerank", {"query": "q", "documents": ["ab", "c"]}) == [3, 2]
    with pytest.raises(ValueError, match="at most 2048"):
        passthrough.prompt_sizes("embeddings", {"input": ["x"] * 2049})
