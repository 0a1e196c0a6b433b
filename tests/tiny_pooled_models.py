"""Tiny embedding and rerank models that llama-server really serves (tests and benchmarks of pooled models).

An embedding model is a causal transformer whose header names how its hidden states are pooled into one
vector per input (`<arch>.pooling_type`: 1 mean, 2 cls, 3 last; llama.cpp's `llama_pooling_type`); a
reranker pools with `rank` (4) and scores the pooled state with a classification head. llama.cpp loads that
head for qwen3 as `cls.output.weight` ({n_embd, n_cls_out}, `n_cls_out` the length of
`<arch>.classifier.output_labels`) and applies a softmax over its labels, so a head of two labels gives scores
that vary with the input (one label would always score 1). Weights are random, as in `tests.tiny_models`,
whose engine writes them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from tests.tiny_models_engine import (
    _DENSE,
    _FFN,
    _GLOBALS,
    _QWEN3,
    _TIED,
    _attention_dims,
    _ffn_dims,
    _spec,
    _table,
    _transformer,
    _write,
)

__all__ = ["POOLING_TYPES", "write_llama_embedding", "write_qwen3_embedding", "write_qwen3_reranker"]

#: llama.cpp's `llama_pooling_type` values as a header stores them.
POOLING_TYPES: Final = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


def write_llama_embedding(
    path: str | os.PathLike[str],
    *,
    pooling: str = "mean",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 259,
    n_ctx_train: int = 32768,
    sparse: bool = False,
) -> Path:
    """A llama model whose header declares a pooling type (an embedding model like those converted from
    sentence-transformers' causal encoders)."""
    dims = _attention_dims(n_embd, n_head, n_head_kv)
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, n_ctx_train=n_ctx_train)
    keys = {"rope.dimension_count": dims["head"], "pooling_type": POOLING_TYPES[pooling]}
    spec = _spec("llama", n_vocab, header, keys, name="tiny-llama-embedding")
    return _write(path, spec, dims | _ffn_dims(n_ff), [_DENSE] * n_layer, globals_=_GLOBALS, sparse=sparse)


def write_qwen3_embedding(
    path: str | os.PathLike[str],
    *,
    pooling: str = "last",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    n_ff: int = 128,
    n_vocab: int = 259,
    sparse: bool = False,
) -> Path:
    """A qwen3 model pooled by its last token (Qwen3-Embedding's layout: tied output embeddings)."""
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim)
    spec = _spec("qwen3", n_vocab, header, {"pooling_type": POOLING_TYPES[pooling]}, name="tiny-qwen3-embedding")
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(n_ff)
    return _write(path, spec, dims, [_table(_QWEN3, _FFN)] * n_layer, globals_=_TIED, sparse=sparse)


def write_qwen3_reranker(
    path: str | os.PathLike[str],
    *,
    labels: tuple[str, ...] = ("yes", "no"),
    head: bool = True,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    n_ff: int = 128,
    n_vocab: int = 259,
    sparse: bool = False,
) -> Path:
    """A qwen3 reranker: rank pooling (the last token, the attention being causal) and a classification head
    of one row per label. `head=False` leaves the head out (a model llama.cpp would rank with its raw hidden
    state: admission refuses to serve it as a reranker)."""
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim=head_dim)
    spec = _spec("qwen3", n_vocab, header, {"pooling_type": POOLING_TYPES["rank"]}, name="tiny-qwen3-reranker")
    spec.kv["qwen3.classifier.output_labels"] = list(labels)
    dims = _attention_dims(n_embd, n_head, n_head_kv, head_dim) | _ffn_dims(n_ff) | {"labels": len(labels)}
    globals_ = _table(_TIED, "cls.output.weight embd labels") if head else _TIED
    return _write(path, spec, dims, [_table(_QWEN3, _FFN)] * n_layer, globals_=globals_, sparse=sparse)
