"""Usage per tenant: `mesh-actor usage`'s sums of `request_usage` events, and the metrics' bounded tenant label."""

from __future__ import annotations

from typing import Any

import msgspec

from actors.metrics.fold import MAX_TENANTS, NodeMetrics
from messages import events as ev
from runtime.cli.usage import summarize
from tests.harness.metrics import NODE, absent, envelope, scrape, value


def usage(tenant: str, model: str = "m", **fields: Any) -> ev.RequestUsage:
    values: dict[str, Any] = {"key_id": "k" if tenant else "", "endpoint": "chat", "status": 200,
                              "duration_ms": 10.0, **fields}  # fmt: skip
    return ev.RequestUsage(**envelope(), tenant=tenant, model=model, **values)


def as_journal(event: ev.Event) -> dict[str, Any]:
    return dict(msgspec.to_builtins(event))


def test_usage_sums_requests_and_tokens_by_tenant_and_model() -> None:
    events = [
        as_journal(usage("acme", prompt_tokens=10, cached_tokens=4, generated_tokens=5)),
        as_journal(usage("acme", prompt_tokens=7, generated_tokens=3)),
        as_journal(usage("acme", model="n", prompt_tokens=1, generated_tokens=1)),
        as_journal(usage("acme", status=429, refused="rpm")),
        as_journal(usage("", prompt_tokens=2, generated_tokens=2)),
        {"type": "generate_completed", "prompt_tokens": 1000},  # other events are not usage
    ]
    rows, total = summarize(events)
    assert [(r["tenant"], r["model"]) for r in rows] == [("", "m"), ("acme", "m"), ("acme", "n")]
    acme = rows[1]
    assert (acme["requests"], acme["prompt_tokens"], acme["cached_tokens"], acme["generated_tokens"]) == (3, 17, 4, 8)
    assert acme["total_tokens"] == 25 and acme["statuses"] == {"200": 2, "429": 1} and acme["refused"] == {"rpm": 1}
    assert total["requests"] == 5 and total["prompt_tokens"] == 20 and total["generated_tokens"] == 11
    only, only_total = summarize(events, "")
    assert [r["tenant"] for r in only] == [""] and only_total["requests"] == 1


def test_the_tenant_label_counts_requests_and_tokens_and_is_bounded() -> None:
    metrics = NodeMetrics(NODE)
    metrics.event(usage("acme", prompt_tokens=10, cached_tokens=4, generated_tokens=5))
    metrics.event(usage("acme", status=429, refused="rpm"))
    metrics.event(usage("", model=""))
    for i in range(MAX_TENANTS + 5):
        metrics.event(usage(f"t{i}", generated_tokens=1))
    text = scrape(metrics)
    assert value(text, "mesh_frontdoor_tenant_requests_total", tenant="acme", model="m", status="200") == 1
    assert value(text, "mesh_frontdoor_tenant_requests_total", tenant="acme", status="429") == 1
    assert value(text, "mesh_frontdoor_tenant_tokens_total", tenant="acme", kind="prompt") == 10
    assert value(text, "mesh_frontdoor_tenant_tokens_total", tenant="acme", kind="cached") == 4
    assert value(text, "mesh_frontdoor_tenant_tokens_total", tenant="acme", kind="generated") == 5
    assert value(text, "mesh_frontdoor_tenant_requests_total", tenant="", model="unknown") == 1
    # acme and "" came first: 30 more tenants are named, the other 7 are `other`
    assert value(text, "mesh_frontdoor_tenant_requests_total", tenant="other") == 7
    assert not absent(text, "mesh_frontdoor_tenant_requests_total", tenant=f"t{MAX_TENANTS - 3}")
    assert absent(text, "mesh_frontdoor_tenant_requests_total", tenant=f"t{MAX_TENANTS - 2}")
    metrics.event(usage("acme", generated_tokens=2))  # a tenant already named stays named
    assert value(scrape(metrics), "mesh_frontdoor_tenant_tokens_total", tenant="acme", kind="generated") == 7
