"""Generation: `mesh.generate` (any node's router) and `mesh.runner.<node>.generate` (the chosen runner).

A client sends a `GenerateRequest` to `mesh.generate` (a queue group on every node). The router picks a ready
instance of the model (the one holding the longest prefix of the prompt, resident in a slot or in its node's
L3 store, traded against its load), journals the decision (`generate_routed`), and forwards a
`RunnerGenerate` to that instance's runner. The runner tokenizes, restores the longest stored prefix into a
free slot, runs the completion on its llama-server and answers a `GenerateResult`; the slot's state is captured
into L3 afterwards, without delaying the reply.

With `stream` set to a subject the client subscribes to, the runner also publishes `GenerateChunk`s there as
tokens come (`seq` 0, 1, 2, … with no gaps; the reply still carries the whole result and ends the stream).
Every `STREAM_PING_S` the runner sends a `StreamPing` there as a request: a client must answer it (any
payload); when nobody listens any more (no responders), the generation stops and its slot is freed.

A pass-through request carries `api` instead of a prompt: one of llama-server's own endpoints and the client's
own JSON body, forwarded unchanged to the chosen instance (with its slot pinned). Its answer is relayed on the
`stream` subject, which such a request must name: a `RELAY_HEADER: head` message (`RelayHead`: the server's
HTTP status and content type), then the body's bytes as it sent them (`RELAY_HEADER: data`, raw payloads, in
order by `RELAY_SEQ_HEADER`; server-sent events are cut only between events). The reply ends the relay and says
how many data messages were sent (`GenerateResult.relayed`).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from messages.l3 import PrefixSource
from messages.placement import PreferredSettings
from messages.tenants import MAX_PRIORITY

#: Longest accepted prompt: text (characters) or token ids.
MAX_PROMPT_CHARS: Final = 4 << 20
MAX_PROMPT_TOKENS: Final = 1 << 20
#: How often a streaming runner checks that its client still listens.
STREAM_PING_S: Final = 0.25
#: Header a stream ping carries (chunks carry none).
STREAM_PING_HEADER: Final = "Mesh-Stream-Ping"
#: Header of a relayed answer's messages: "head" (a `RelayHead`) or "data" (raw bytes of the server's body).
RELAY_HEADER: Final = "Mesh-Relay"
#: Header giving a relayed data message's place (0, 1, 2, …).
RELAY_SEQ_HEADER: Final = "Mesh-Relay-Seq"
#: Largest client body a pass-through request carries (the bus's `max_payload` may be lower: the sender checks).
MAX_API_BODY_BYTES: Final = 8 << 20

#: llama-server's endpoints a pass-through request may name, by the mesh's name for each: its OpenAI and Anthropic
#: endpoints, its own (`completion`, `infill`, `embedding`), its token counts and its tokenizer.
ApiEndpoint = Literal[
    "chat", "completions", "responses", "responses_input_tokens", "messages", "count_tokens", "embeddings", "rerank",
    "chat_input_tokens", "completion", "infill", "embedding", "tokenize", "detokenize", "apply_template",
]  # fmt: skip
#: The endpoints that decode a prompt in a slot (routed by prefix, restored, captured).
GENERATING_ENDPOINTS: Final = frozenset({"chat", "completions", "responses", "messages", "completion", "infill"})
API_PATHS: Final[dict[str, str]] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "responses_input_tokens": "/v1/responses/input_tokens",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "embeddings": "/v1/embeddings",
    "rerank": "/v1/rerank",
    "chat_input_tokens": "/v1/chat/completions/input_tokens",
    "completion": "/completion",
    "infill": "/infill",
    "embedding": "/embedding",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "apply_template": "/apply-template",
}

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
StopReason = Literal["eos", "limit", "stop_word", "cancelled"]


class Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """llama-server's sampling parameters (same names, same defaults). `temperature` 0 is greedy."""

    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 0.8
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 40
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.95
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.05
    seed: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)] | None = None  # None: a random seed
    stop: Annotated[
        tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=256)], ...], msgspec.Meta(max_length=16)
    ] = ()


class ApiCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A client's request to one of llama-server's own endpoints: `body` is its JSON object, as it sent it."""

    endpoint: ApiEndpoint
    body: msgspec.Raw

    def __post_init__(self) -> None:
        if len(self.body) > MAX_API_BODY_BYTES:
            raise ValueError(f"the body is {len(self.body)} bytes, over {MAX_API_BODY_BYTES}")
        if not bytes(self.body).lstrip().startswith(b"{"):
            raise ValueError("the body is a JSON object")


class RelayHead(msgspec.Struct, frozen=True, kw_only=True):
    """The first message of a relayed answer: the server's HTTP status and content type."""

    status: int
    content_type: str


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`model`: a registry name, a model path as placed, or an instance id. `prompt`: text, or token ids; or
    `api`: a client's body for one of the instance's own endpoints. `stream` is required by `mesh.generate`: an
    inbox of the requester that answers the runner's pings (and receives chunks, or a pass-through's relayed
    answer), so that a requester that left stops its generation at once, streamed or not."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    prompt: (
        Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
        | None
    ) = None
    api: ApiCall | None = None
    # Only instances whose stamp meets these serve it (a catalog model's required settings and kind: an embedding
    # server of a generation model's file serves another catalog model); None: any instance of `model`.
    serves: PreferredSettings | None = None
    n_predict: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 128
    sampling: Sampling = Sampling()
    # The subject for chunks: an inbox (`_INBOX.` and tokens), so no request can make a runner publish elsewhere.
    # Its pings also tell the runner the requester is still there: one that left stops the generation.
    stream: Annotated[str, msgspec.Meta(max_length=256, pattern=r"^_INBOX(\.[A-Za-z0-9_-]+)+$")] | None = None
    chunks: bool = True  # False: no chunks on `stream`, only its pings (a whole reply whose requester is watched)
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 300.0  # the whole generation, routing included
    request_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    capture: bool = True  # False: do not store this request's states in L3
    # Prefill the prompt on this node, hand its state off, and decode on the routed instance (operators, tests)
    prefill_node: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    # Who asks, for the instance's queue (`actors/runner/fairqueue.py`): the tenant, its class (higher first) and
    # its share within the class. The front door sets them from the request's key; a `client` user's request over
    # NATS is its own tenant (`nats:<user>`) in the default class, whatever it says (the router sees to it).
    tenant: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:-]{0,80}$")] = ""
    # Whose prompt states it may reuse (slots and L3): requests of one scope share them, another scope's are never
    # reused (vLLM's cache salt). "" is the mesh's shared scope (the admin key, an open door). The front door sets
    # it from the request's key; a `client` user's request over NATS is scoped to that user, whatever it says.
    cache_scope: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:-]{0,80}$")] = ""
    priority: Annotated[int, msgspec.Meta(ge=0, le=MAX_PRIORITY)] = 0
    weight: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 1.0

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.api is None):
            raise ValueError("a generation has either a `prompt` or an `api` call")


class RouteChoice(msgspec.Struct, frozen=True, kw_only=True):
    """What routing expects of the chosen instance (the runner re-checks all of it)."""

    held_tokens: int  # the prefix routing credited the instance with
    source: PrefixSource
    decision_id: str


class RunnerGenerate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The router's order to one runner: run `request` on `instance_id`."""

    request: GenerateRequest
    request_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    instance_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)] | None = None  # tokenized already
    route: RouteChoice | None = None
    routed_ms: float = 0.0  # the router's time before forwarding (counted in the time to first token)


class Prefill(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`mesh.runner.<node>.prefill`: compute `tokens` on an instance of `identity` here and hand the state off to
    `target_node` (its L3 store holds it when this answers)."""

    identity: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    tokens: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    target_node: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    request_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class PrefillResult(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    instance: str
    n_tokens: int  # the tokens the handed-off state holds
    tokens_evaluated: int  # the prefill's prompt_n
    bytes: int
    prefill_ms: float
    handoff_ms: float  # the transfer alone (open to result), the target's store commit included
    compute_ms: float = 0.0  # llama-server's own prompt time (timings.prompt_ms) within prefill_ms


class Tokenize(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    instance_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    text: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]


class Tokens(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[int]


class Render(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`mesh.runner.<node>.render`: the prompt tokens of a pass-through body, as the instance itself renders
    (chat template) and tokenizes it; `Tokens` with none when the body has no single prompt to render."""

    instance_id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    call: ApiCall


class GenerateChunk(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    seq: int
    text: str
    tokens: list[int]


class StreamPing(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    seq: int  # chunks published so far


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    text: str
    tokens: list[int]  # the generated token ids
    prompt_tokens: int
    source: PrefixSource  # where the reused prefix came from (`cold`: nothing was reused)
    tokens_restored: int  # restored from L3 into the slot before the completion
    tokens_cached: int  # reused by the server (llama-server's `cache_n`; includes restored tokens)
    tokens_evaluated: int  # llama-server's `prompt_n`: prompt tokens it computed
    ttft_ms: float  # from the router's receipt to the first generated token
    total_ms: float
    node: str
    instance: str
    slot: int
    stop_reason: StopReason
    # False when a streamed reply could not list every generated token id (llama-server's stream leaves out
    # the ids of tokens whose bytes it held back as incomplete UTF-8); `text` is complete either way
    tokens_exact: bool = True
    tokens_generated: int = 0  # how many tokens were generated (llama-server's count; `tokens` may list fewer)
    path: Literal["local", "disaggregated"] = "local"  # disaggregated: prefilled on `prefill_node`, handed off
    prefill_node: str | None = None
    handoff_bytes: int = 0
    # what the handoff added beyond the remote server's prompt computation: the request to the prefill node,
    # its slot save, the transfer, this node's store commit, the restore into the decoding slot, and the last
    # prompt token's own decode step here (a local prefill batches it)
    handoff_ms: float = 0.0
    # why the prefill planned on `prefill_node` was not used ("" when it was, or none was planned): the prompt
    # was computed here instead (the handoff is there to save time; its failure costs the time, not the answer)
    prefill_fallback: str = ""
    decision_id: str = ""
    capture: str = ""  # what happens to the state: "queued", or why not ("off", "short", "no_l3", …)
    status: int = 200  # a pass-through's HTTP status from the server
    relayed: int = 0  # a pass-through's data messages on the relay subject


# ---- what runners publish about their instances (`mesh.serving.<node>`, core NATS, not journaled) ----


class HeldPrefix(msgspec.Struct, frozen=True, array_like=True):
    """A slot holds the first `n_tokens` tokens whose entry id (identity, tokens) is `entry`."""

    n_tokens: int
    entry: str


class InstanceLoad(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    slots: int
    busy: int
    queued: int
    identity: str | None  # the exact-state identity of its states (None: unknown, no L3 credit)
    resident: tuple[HeldPrefix, ...] = ()  # at the lengths `actors.router.prefixes.marks` gives, per slot
    prefill_tokens_per_s: float = 0.0  # measured (llama-server's timings, smoothed); 0: not measured yet
    state_bytes_per_token: float = 0.0  # a saved state's size: KV per token, and the recurrent floor
    state_floor_bytes: float = 0.0
    kv_tokens: int = 0  # KV cells its slots hold (a busy one: its reused prefix); over the context's: KV usage
    decode_tokens_per_s: float = 0.0  # one slot's generation rate, measured; 0: not measured yet
    queued_prompt_tokens: int = 0  # the prompts of the requests waiting for a slot
    queued_generation_tokens: int = 0  # what they may generate (their bounds; 256 for one naming none)


class ServingReport(msgspec.Struct, frozen=True, kw_only=True):
    """Sent on every change (debounced) and every few seconds; a report older than `ttl_s` is not used."""

    node_id: str
    seq: int
    ttl_s: float
    instances: tuple[InstanceLoad, ...]


# ---- routing (inputs and outcome of `actors.router.routing.choose`, journaled as `generate_routed`) ----


class RouteWeights(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    active_cost: float = 64.0  # prompt tokens' worth per generation running or queued on the instance
    wait_cost: float = 1024.0  # per request ahead when no slot is free
    l3_local_cost: float = 0.02  # per restored token from the node's own store
    l3_peer_cost: float = 0.1  # per restored token fetched from a peer's store


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    node: str
    slots: int
    busy: int  # slots generating now
    queued: int  # requests waiting for a slot
    inflight: int = 0  # requests this router sent there that the last load report may not count yet
    held_tokens: int = 0
    source: PrefixSource = "cold"
    held_node: str | None = None  # the store holding an L3 prefix
    identity: str | None = None
    prefill_tokens_per_s: float = 0.0
    state_bytes_per_token: float = 0.0
    state_floor_bytes: float = 0.0


class Scored(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    cost: float
    new_tokens: int
    restore: float
    load: float


class RouteDecision(msgspec.Struct, frozen=True, kw_only=True):
    chosen: str | None
    reason: str
    scores: tuple[Scored, ...] = ()
    prefill_node: str | None = None  # prefill there and hand the state off (the cost model said it pays)
    prefill_reason: str = ""
