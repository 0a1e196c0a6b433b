"""Placement: admission and reservations, answered from any node (`mesh.placement.request`, `.fit`).

Pure cores: `gguf_header` (a bounded, hostile-input-safe GGUF header reader, fed a file object), `geometry`
(header to `ModelGeometry`), `matmul_weights`, the memory model (`memory`, with `context`, `caches`,
`weights`, `compute` with `graph_alloc` and `qwen35_graph`: graphs placed as ggml-alloc places them, `projector`:
a multimodal projector's weights, image graph and embeddings), `pooled`
(embedding and rerank models: their kind, pooling and whole-input batch),
`bounds` (per-model settings within a node's bounds), `ledger` (what a node can still
offer), `admission` (eligibility, node choice, stamp), `fleet` (the same decisions at fleet scale),
`split` (a model over several nodes with llama.cpp's RPC backend), `booking` (one decision's reservations
over several ledgers, all or none), `reservations` (the reservation lifecycle), `shares` (what one client may
hold booked), `registry` (signed entries), `replay` (recomputing a recorded decision), `intake` (a node's
heartbeat told from a new report without decoding it whole). Shells: `actor` (the view, CAS ledgers, the
endpoints), `model_reader` (model files and registry entries, in worker threads),
`decision_records` (large decisions' inputs in the object store).
"""

from __future__ import annotations

from typing import Final

#: The pure cores: no I/O, no clock, no randomness, all of it passed in (`tests/test_import_rules.py` holds
#: them, and everything else, to the import rules of the design).
CORES: Final = frozenset(
    {
        "gguf_header", "geometry", "matmul_weights", "memory", "context", "caches", "weights", "compute", "bounds",
        "ledger", "admission", "fleet", "reservations", "registry", "replay", "shares", "pooled", "projector", "split",
        "booking", "graph_alloc", "qwen35_graph", "intake",
    }
)  # fmt: skip
