"""Memory-model inputs for known models (llama, gemma3, Qwen3.5-9B) and the serving settings they run with."""

from __future__ import annotations

from typing import Any

import msgspec

from actors.placement.geometry import geometry_from_header
from messages.model import ModelGeometry
from messages.settings import ServingSettings
from tests.harness.geometry import QWEN_SSM, base, header

MIB = 1 << 20


def serving(**kw: Any) -> ServingSettings:
    return msgspec.convert({"cache_ram_mib": 0, **kw}, ServingSettings)


def qwen35_9b() -> ModelGeometry:
    kv = base(33, **QWEN_SSM, nextn_predict_layers=1, embedding_length=4096)
    kv.update({"attention.head_count": 16, "attention.head_count_kv": 4})
    kv.update({"attention.key_length": 256, "attention.value_length": 256, "feed_forward_length": 12288})
    return geometry_from_header(header("qwen35", kv))


def llama(n_layer: int = 4, **kv: Any) -> ModelGeometry:
    return geometry_from_header(header("llama", base(n_layer, **kv)))


def gemma3(n_swa: int = 1024) -> ModelGeometry:
    return geometry_from_header(header("gemma3", base(6, **{"attention.sliding_window": n_swa})))
