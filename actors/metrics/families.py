"""Every metric family a node exports: its name, type, meaning, labels and buckets (metrics core, pure).

One table, read by the fold (which values each family holds), the docs (docs/operations.md lists every name;
a test holds them together) and the tests. Rules it keeps:

* Names the ecosystem already scrapes are mirrored with our prefix, same meaning and same buckets: vLLM's
  `vllm:num_requests_running` is `mesh_num_requests_running`, its time-to-first-token and inter-token-latency
  histograms keep vLLM's bucket bounds, and the front door's gauges mirror NVIDIA Dynamo's
  `dynamo_frontend_queued_requests` / `_inflight_requests`. What only this mesh knows has names of its own.
* Labels are bounded: `node` is this node, `instance` an instance this node runs (its series go when its record
  does), `model` the model file an instance runs or a catalog model of this node's front door; never a name a
  client sent. Free-text reasons are cut to a short token and capped in number (`fold.BoundedLabel`).
* Counters are named without `_total` here (the exposition adds it), as prometheus-client's families are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "E2E_BUCKETS",
    "ENGINE_PREFIX",
    "ENGINE_UP",
    "FAMILIES",
    "INTER_TOKEN_BUCKETS",
    "TOKEN_BUCKETS",
    "TTFT_BUCKETS",
    "Spec",
    "exported_name",
]

#: vLLM's bounds (vllm/v1/metrics/loggers.py): time to first token, in seconds.
TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
#: vLLM's bounds for its inter-token latency (and time per output token), in seconds.
INTER_TOKEN_BUCKETS: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                              20.0, 40.0, 80.0)  # fmt: skip
#: vLLM's bounds for a request's end-to-end latency (and its queue, prefill and decode times), in seconds.
E2E_BUCKETS: Final = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                      480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
#: vLLM's 1-2-5 series for a request's prompt and generation tokens (it stops at the model's context; a node
#: serves several models, so here it stops at a million).
TOKEN_BUCKETS: Final = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)

#: The prefix of llama-server's own families, re-exported as they are with node, model and instance labels.
ENGINE_PREFIX: Final = "llamacpp:"

Kind = Literal["counter", "gauge", "histogram"]

NODE: Final = ("node",)
INSTANCE: Final = ("node", "model", "instance")
MODEL: Final = ("node", "model")


@dataclass(frozen=True, slots=True)
class Spec:
    name: str  # counters without `_total`
    kind: Kind
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def per_instance(self) -> bool:
        return "instance" in self.labels


def exported_name(spec: Spec) -> str:
    """The name a scraper sees (a counter's samples end in `_total`)."""
    return f"{spec.name}_total" if spec.kind == "counter" else spec.name


def _c(name: str, help: str, labels: tuple[str, ...]) -> Spec:
    return Spec(name, "counter", help, labels)


def _g(name: str, help: str, labels: tuple[str, ...]) -> Spec:
    return Spec(name, "gauge", help, labels)


def _h(name: str, help: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Spec:
    return Spec(name, "histogram", help, labels, buckets)


#: What an instance's memory is made of, predicted (a `MemoryBreakdown`, in total and per device).
PREDICTED_KINDS: Final = ("weights", "kv", "recurrent", "draft_kv", "compute", "compute_margin", "output", "repack",
                          "amx", "host_extra", "draft_weights", "projector_weights", "total")  # fmt: skip
#: What its server reported it allocated (an `ObservedMemory`).
OBSERVED_KINDS: Final = ("weights", "kv", "recurrent", "draft_kv", "compute", "output", "draft_weights",
                         "projector_weights", "pending", "total")  # fmt: skip
RESERVATION_STATES: Final = ("reserved", "starting", "running")
INSTANCE_STATES: Final = ("starting", "ready", "restarting", "stopping", "stuck", "stopped", "failed", "rejected")
FRONTDOOR_STATES: Final = ("ready", "starting", "stopped")

FAMILIES: Final[tuple[Spec, ...]] = (
    # --- serving, as vLLM and Dynamo name it ---------------------------------------------------------------
    _g("mesh_num_requests_running", "Requests generating on the instance's slots (vLLM's num_requests_running).",
       INSTANCE),
    _g("mesh_num_requests_waiting", "Requests waiting for one of the instance's slots (vLLM's num_requests_waiting).",
       INSTANCE),
    _g("mesh_kv_cache_usage_perc", "KV cache usage, 1 is full: the cells its slots hold over the context's cells "
       "(vLLM's kv_cache_usage_perc).", INSTANCE),
    _c("mesh_prompt_tokens", "Prompt tokens of the requests the instance answered (vLLM's prompt_tokens).", INSTANCE),
    _c("mesh_generation_tokens", "Tokens the instance generated (vLLM's generation_tokens).", INSTANCE),
    _c("mesh_prefix_cache_queries", "Prompt tokens looked up in the instance's caches (vLLM's prefix_cache_queries).",
       INSTANCE),
    _c("mesh_prefix_cache_hits", "Prompt tokens the server reused instead of computing, restored ones included "
       "(vLLM's prefix_cache_hits).", INSTANCE),
    _c("mesh_requests", "Requests the instance answered, by endpoint (`completion`: a prompt generation) and the "
       "server's HTTP status.", (*INSTANCE, "endpoint", "status")),
    _c("mesh_request_success", "Requests answered, by why generation stopped: stop, length or abort "
       "(vLLM's request_success).", (*MODEL, "finished_reason")),
    _h("mesh_time_to_first_token_seconds", "From the router's receipt of a request to its first generated token "
       "(vLLM's buckets).", MODEL, TTFT_BUCKETS),
    _h("mesh_inter_token_latency_seconds", "Time between generated tokens, one observation per gap: a request's "
       "decode time spread evenly over its tokens (vLLM's buckets).", MODEL, INTER_TOKEN_BUCKETS),
    _h("mesh_e2e_request_latency_seconds", "From the router's receipt of a request to its answer's end "
       "(vLLM's buckets).", MODEL, E2E_BUCKETS),
    _h("mesh_request_prompt_tokens", "Prompt tokens per request.", MODEL, TOKEN_BUCKETS),
    _h("mesh_request_generation_tokens", "Generated tokens per request.", MODEL, TOKEN_BUCKETS),
    _c("mesh_generations_cancelled", "Generations stopped because their requester left.", INSTANCE),
    # --- where each prompt's state came from ----------------------------------------------------------------
    _c("mesh_routed_requests", "Requests answered, by where the reused prefix came from: resident in a slot, "
       "l3_local, l3_peer, or cold (nothing reused).", (*INSTANCE, "source")),
    _c("mesh_restored_tokens", "Prompt tokens restored into a slot from an L3 store before the completion, by "
       "source.", (*INSTANCE, "source")),
    _c("mesh_routing_refusals", "Generate requests this node's router refused for want of a ready instance (the "
       "model a client named is not a label).", NODE),
    # --- memory: predicted, observed, reserved, available -------------------------------------------------
    _g("mesh_memory_predicted_bytes", "What admission predicted the instance allocates, by kind (the breakdown's "
       "totals).", (*INSTANCE, "kind")),
    _g("mesh_memory_predicted_device_bytes", "What admission predicted the instance allocates on each device, by "
       "kind.", (*INSTANCE, "device", "kind")),
    _g("mesh_memory_observed_bytes", "What the instance's server reported it allocated, by kind (from its log).",
       (*INSTANCE, "kind")),
    _g("mesh_memory_observed_buffer_bytes", "What the instance's server reported it allocated, by backend buffer.",
       (*INSTANCE, "buffer")),
    _g("mesh_node_memory_size_bytes", "Each device's size, capped by the node's memory limit.", (*NODE, "device")),
    _g("mesh_node_memory_usable_bytes", "Each device's free memory now (telemetry), capped by the memory limit.",
       (*NODE, "device")),
    _g("mesh_node_memory_reserved_bytes", "Memory the node's ledger holds, by reservation state (reserved: "
       "admitted, starting: its server loading, running: the observed footprint).", (*NODE, "device", "state")),
    _g("mesh_node_memory_available_bytes", "What a new reservation may take on each device now (what placement "
       "offers).", (*NODE, "device")),
    # --- instances -------------------------------------------------------------------------------------
    _g("mesh_instance_state", "1 for the state the instance is in, 0 for the others.", (*INSTANCE, "state")),
    _g("mesh_instance_slots", "The instance's slots (-np).", INSTANCE),
    _g("mesh_instance_context_tokens", "The instance's context cells over all its slots (llama.cpp's n_ctx).",
       INSTANCE),
    _c("mesh_instance_restarts", "Times the instance's server was started again after a crash.", INSTANCE),
    _c("mesh_instance_crashes", "Times the instance's server crashed, by whether it ran out of memory.",
       (*INSTANCE, "out_of_memory")),
    _c("mesh_health_check_failures", "Failed liveness checks of a ready server: a one-token probe, its /health, or "
       "a real completion the server failed.", (*INSTANCE, "check")),
    _g("mesh_engine_metrics_up", "1 when the instance's llama-server answered its /metrics for this scrape.",
       INSTANCE),
    # --- placement -------------------------------------------------------------------------------------
    _c("mesh_placement_decisions", "Placement decisions this node made, by outcome (admitted or rejected) and "
       "reason (`none` when admitted).", (*NODE, "outcome", "reason")),
    _c("mesh_reservations_released", "Reservations released, by reason.", (*NODE, "reason")),
    # --- the L3 store ----------------------------------------------------------------------------------
    _g("mesh_l3_stored_bytes", "Bytes the node's L3 store holds (every segment once).", NODE),
    _g("mesh_l3_budget_bytes", "The L3 store's budget.", NODE),
    _g("mesh_l3_entries", "Saved slot states the L3 store holds.", NODE),
    _g("mesh_l3_tokens", "Tokens those states hold.", NODE),
    _g("mesh_l3_quarantined_entries", "Manifests moved aside because they failed to load or verify.", NODE),
    _g("mesh_l3_eviction_blocked", "1 while unreadable quarantined manifests keep the store from shrinking.", NODE),
    _c("mesh_l3_captures", "Slot states captured into the store.", NODE),
    _c("mesh_l3_captured_bytes", "Bytes of the captured states.", NODE),
    _c("mesh_l3_written_bytes", "Bytes of segments the store did not hold before (the rest deduplicated).", NODE),
    _c("mesh_l3_capture_drops", "Captures not stored, by reason.", (*NODE, "reason")),
    _c("mesh_l3_evictions", "Entries evicted to keep the store within its budget.", NODE),
    _c("mesh_l3_evicted_bytes", "Bytes those evictions freed.", NODE),
    _c("mesh_l3_quarantines", "Manifests quarantined.", NODE),
    _c("mesh_l3_peer_fetches", "Entries fetched from a peer's store.", (*NODE, "peer")),
    _c("mesh_l3_peer_fetched_bytes", "Bytes moved by those fetches (the segments this node lacked).",
       (*NODE, "peer")),
    # --- handoff -----------------------------------------------------------------------------------------
    _c("mesh_handoffs", "Handoffs this node received, verified and restored, by sending node.", (*NODE, "peer")),
    _c("mesh_handoff_bytes", "Payload bytes of those handoffs.", (*NODE, "peer")),
    _h("mesh_handoff_seconds", "A handoff's transfer, from its opening to its commit.", (*NODE, "peer"),
       TTFT_BUCKETS),
    _c("mesh_handoff_aborts", "Handoff sessions ended without a restore, by the side that recorded it and reason.",
       (*NODE, "peer", "role", "reason")),
    # --- the front door --------------------------------------------------------------------------------
    _g("mesh_frontdoor_queued_requests", "Requests waiting at this front door for an instance of the model "
       "(Dynamo's queued_requests).", MODEL),
    _g("mesh_frontdoor_inflight_requests", "Requests of the model generating from this front door (Dynamo's "
       "inflight_requests).", MODEL),
    _g("mesh_frontdoor_model_state", "1 for the catalog model's state (ready, starting, stopped), 0 for the others.",
       (*MODEL, "state")),
    _g("mesh_frontdoor_model_held_bytes", "What the catalog model's ready instances hold, all devices.", MODEL),
    _c("mesh_frontdoor_model_loads", "Instances started for the catalog model on demand.", MODEL),
    _h("mesh_frontdoor_model_load_seconds", "From the request that found no instance to the started one's "
       "readiness.", MODEL, E2E_BUCKETS),
    _c("mesh_frontdoor_swaps", "Times instances were stopped to make room for the model.", MODEL),
    _c("mesh_frontdoor_refusals", "Requests for the model refused: never_fits (HTTP 507), or why placement refused "
       "it.", (*MODEL, "reason")),
    _c("mesh_frontdoor_idle_stops", "Instances of the model stopped after their idle time.", MODEL),
    _c("mesh_frontdoor_tenant_requests", "Requests to this front door's API, by tenant (its key's; empty for the "
       "admin key or an open door; at most 32 tenants, the rest `other`), catalog model (`unknown`: none it may "
       "use) and HTTP status (499: the client left).", (*MODEL, "tenant", "status")),
    _c("mesh_frontdoor_tenant_tokens", "Tokens of those requests' answers, by tenant and kind: prompt, cached (of "
       "the prompt, reused by the server), generated.", (*MODEL, "tenant", "kind")),
    # --- the node itself --------------------------------------------------------------------------------
    _c("mesh_actor_crashes", "Crashes of the node's actors (each restarts within its restart intensity).",
       (*NODE, "actor")),
)  # fmt: skip

#: Whether an instance's llama-server answered its /metrics (listed above; named here for the shell).
ENGINE_UP: Final = "mesh_engine_metrics_up"
