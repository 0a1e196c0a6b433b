"""Serving settings: every llama-server setting that changes what the server allocates (and its thread count).

A node advertises its default settings and the bounds it accepts (telemetry). A placement request (or a front
door catalog entry) may ask for other per-model settings within those bounds (`PerModel` fields); admission
computes memory with exactly the resulting settings, stamps them onto the admitted instance, and the runner
pins each one on the llama-server command line. Field names follow llama-server's own long flags where one
exists.

What a server is for is a setting too (`kind`): a generation server, an embedding server (`--embeddings`) or a
reranker (`--rerank`). An embedding or rerank model pools each input's hidden states into one vector
(`pooling`); its batch and micro-batch hold a whole input (the per-slot context), since llama.cpp cannot split
the input of a mean or first-token pooling over micro-batches. Those batch sizes are the model's own, not the
node's.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

#: KV cache element types llama-server accepts for -ctk/-ctv (and -ctkd/-ctvd).
CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
ALL_CACHE_TYPES: tuple[CacheType, ...] = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: What a server is for: generation, embeddings (`--embeddings`) or reranking (`--rerank`).
ServingKind = Literal["generate", "embedding", "rerank"]
ALL_KINDS: tuple[ServingKind, ...] = ("generate", "embedding", "rerank")
#: How an embedding or rerank model pools an input's hidden states (`--pooling`; llama.cpp's pooling types).
Pooling = Literal["none", "mean", "cls", "last", "rank"]
#: The settings a model may set for itself within a node's bounds; the rest are the node's own (its batch
#: sizes, host-RAM extras and threads are shared by every server it runs), except the batch sizes of an
#: embedding or rerank model, which are its whole input.
PER_MODEL: tuple[str, ...] = (
    "slots", "kv_unified", "cache_type_k", "cache_type_v", "flash_attn", "swa_full", "spec_type",
    "spec_draft_n_max", "spec_draft_type_k", "spec_draft_type_v", "kind", "pooling",
)  # fmt: skip

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class ServingSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a node runs llama-server; every field but `threads` changes the allocation.

    Defaults are llama-server's own defaults for a server started with an explicit slot count, except
    that flash attention is explicit ("on"/"off") because "auto" resolves differently per device.
    """

    slots: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4  # -np
    kv_unified: bool = False  # -kvu
    cache_type_k: CacheType = "f16"  # -ctk
    cache_type_v: CacheType = "f16"  # -ctv
    flash_attn: Literal["on", "off"] = "on"  # -fa
    batch: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 2048  # -b
    ubatch: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 512  # -ub
    swa_full: bool = False  # --swa-full
    spec_type: str = "none"  # --spec-type (e.g. "none", "draft-mtp")
    spec_draft_n_max: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 3  # --spec-draft-n-max
    spec_draft_type_k: CacheType = "f16"  # -ctkd
    spec_draft_type_v: CacheType = "f16"  # -ctvd
    ctx_checkpoints: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 32  # --ctx-checkpoints
    cache_ram_mib: Annotated[int, msgspec.Meta(ge=-1)] = 8192  # --cache-ram (-1: unlimited, 0: off)
    # -t and -tb (0: llama-server's default, every core). The one field that changes no allocation: pinned so
    # servers sharing a machine do not oversubscribe its cores, and so a node's prefill rate is what it says.
    threads: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    kind: ServingKind = "generate"  # --embeddings (embedding), --rerank (rerank)
    pooling: Pooling | None = None  # --pooling of an embedding or rerank server (None: a generation server)


class SettingsBounds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The per-model settings a node accepts (defaults: everything llama-server accepts). A model's settings
    outside them are refused at placement (`settings_mismatch`, naming the bound) and at start (drift)."""

    max_slots: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1024
    cache_types: tuple[CacheType, ...] = ALL_CACHE_TYPES  # for K and V, target and draft
    flash_attn: tuple[Literal["on", "off"], ...] = ("on", "off")
    kv_unified: tuple[bool, ...] = (False, True)
    swa_full: tuple[bool, ...] = (False, True)
    spec_types: tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=64)], ...] | None = None  # None: any
    max_spec_draft_n_max: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 1024
    kinds: tuple[ServingKind, ...] = ALL_KINDS  # generation, embedding and rerank servers
