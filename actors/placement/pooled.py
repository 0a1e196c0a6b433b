"""Embedding and rerank models (placement core, pure): what a model is served as, and what its server needs.

Rules this module keeps:

* What a server is for (`kind`) is asked for (a placement request's or a catalog entry's settings), or read from
  the model's header: a header that declares a pooling type other than none makes an embedding model, rank
  pooling a reranker (llama.cpp's own reading: `--rerank` is `--embeddings --pooling rank`); any other model
  is a generation model, the node's default. `resolved` turns the header's answer into asked-for settings, so
  bounds, sizing and the stamp all see one explicit kind.
* An embedding or rerank server always runs with an explicit pooling: asked for, else the header's, else mean
  (llama-server's own default for a header without one is none, per-token vectors, which its OpenAI
  endpoint refuses). A reranker pools by rank; a generation server passes no pooling.
* A reranker needs a classification head (`cls`, `cls.output`): without one llama.cpp scores an input by the
  first element of a raw hidden state, which ranks nothing. A pooled server does not speculate.
* Its batch and micro-batch hold a whole input (`whole_input`): llama.cpp cannot split the input of a mean or
  first-token pooling over micro-batches ("input is too large to process, increase the physical batch
  size"), and every token of a pooled batch is an output. The longest input a slot takes is its context, so
  both are the per-slot context (capped at `-c`, which caps llama.cpp's batch). They are the model's own, not
  the node's.
* Every token of a pooled batch is an output row of the host output buffer: the logits (computed for a pooled
  model too) and the embedding, `4 · (n_vocab + n_embd_out)` bytes a row. llama.cpp allocates one row per
  slot at start and grows the buffer to the largest batch at the first one that needs it
  (`llama_context::output_reserve`), so admission counts the rest as host memory the server fills at run time.
"""

from __future__ import annotations

import msgspec

from messages.memory import ContextShape
from messages.model import ModelGeometry
from messages.placement import PlacementRequest, PreferredSettings
from messages.settings import Pooling, ServingKind, ServingSettings

__all__ = [
    "POOLED_KINDS",
    "header_kind",
    "output_growth_bytes",
    "output_row_bytes",
    "refusal",
    "resolved",
    "resolved_request",
    "settings_refusal",
    "whole_input",
]

POOLED_KINDS = frozenset({"embedding", "rerank"})
#: Poolings that make one vector of an input's hidden states (none: every token's own vector).
_POOLINGS: frozenset[str] = frozenset({"mean", "cls", "last", "rank"})


def header_kind(geometry: ModelGeometry) -> ServingKind | None:
    """What the header says the model is for: rank pooling a reranker, another pooling an embedding model;
    None when it declares no pooling (or none)."""
    if geometry.pooling == "rank":
        return "rerank"
    if geometry.pooling in _POOLINGS:
        return "embedding"
    return None


def resolved(wanted: PreferredSettings | None, geometry: ModelGeometry) -> PreferredSettings | None:
    """The settings asked for, with the kind and pooling the header gives where none was asked for."""
    kind = (wanted.kind if wanted is not None else None) or header_kind(geometry)
    if kind is None or kind == "generate":
        return wanted
    pooling: Pooling | None = wanted.pooling if wanted is not None else None
    if pooling is None and kind == "rerank":
        pooling = "rank"
    elif pooling is None:
        header = geometry.pooling
        pooling = "mean" if header == "" or header == "none" else header
    return msgspec.structs.replace(wanted or PreferredSettings(), kind=kind, pooling=pooling)


def settings_refusal(settings: ServingSettings) -> str | None:
    """Why the kind and pooling of `settings` do not go together (None: they do), whatever the model."""
    if settings.kind not in POOLED_KINDS:
        if settings.pooling is not None:
            return f"pooling {settings.pooling}: only an embedding or rerank model pools (kind {settings.kind})"
        return None
    if settings.pooling is None:
        return f"an {settings.kind} model needs a pooling type"
    if settings.kind == "rerank" and settings.pooling != "rank":
        return f"a reranker pools by rank (--rerank), not {settings.pooling}"
    if any(t.strip() not in ("", "none") for t in settings.spec_type.split(",")):
        return f"an {settings.kind} model does not speculate (spec_type {settings.spec_type})"
    return None


def resolved_request(request: PlacementRequest, geometry: ModelGeometry) -> PlacementRequest:
    """`request` with the kind and pooling its model's header gives where it asked for none."""
    settings = resolved(request.settings, geometry)
    return request if settings is request.settings else msgspec.structs.replace(request, settings=settings)


def refusal(geometry: ModelGeometry, settings: ServingSettings) -> str | None:
    """Why llama-server would not serve `geometry` with these settings as they say (None: it would)."""
    refused = settings_refusal(settings)
    if refused is None and settings.pooling == "rank" and not geometry.rank_head:
        refused = (
            f"this {geometry.architecture} model has no classification head (cls, cls.output): llama.cpp would "
            "rank by the first element of a raw hidden state"
        )
    return refused


def whole_input(settings: ServingSettings, shape: ContextShape) -> ServingSettings:
    """`settings` with the batch sizes an embedding or rerank server runs with (`-b`, `-ub`): the micro-batch
    `resolve_context` derived, a whole input. A generation server's are the node's, unchanged."""
    if settings.kind not in POOLED_KINDS:
        return settings
    return msgspec.structs.replace(settings, batch=shape.n_ubatch, ubatch=shape.n_ubatch)


def output_row_bytes(geometry: ModelGeometry, settings: ServingSettings) -> int:
    """Bytes of one output row of the host output buffer: the logits, and with embeddings on the embedding."""
    if settings.kind not in POOLED_KINDS:
        return 4 * geometry.n_vocab
    return 4 * (geometry.n_vocab + (geometry.n_embd_out or geometry.n_embd))


def output_growth_bytes(geometry: ModelGeometry, settings: ServingSettings, shape: ContextShape) -> int:
    """What the output buffer of a pooled server grows by at run time: from one row per slot to one per token
    of its largest batch (the micro-batch: a whole input)."""
    if settings.kind not in POOLED_KINDS:
        return 0
    return output_row_bytes(geometry, settings) * max(0, shape.n_ubatch - shape.n_seq_max)
