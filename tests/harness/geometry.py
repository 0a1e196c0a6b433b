"""Model geometries read from GGUF headers built in memory (a Qwen SSM, a router, a base)."""

from __future__ import annotations

from typing import Any

from actors.placement.gguf_header import GGUFHeader, GGUFValueType, SkippedArray, TensorInfo


def header(arch: str, kv: dict[str, Any], tensors: tuple[TensorInfo, ...] = ()) -> GGUFHeader:
    values: dict[str, Any] = {"general.architecture": arch}
    for key, value in kv.items():
        values[f"{arch}.{key}"] = tuple(value) if isinstance(value, list) else value
    values["tokenizer.ggml.tokens"] = SkippedArray(GGUFValueType.STRING, 1000)
    return GGUFHeader(version=3, kv=values, tensors=tensors, alignment=32, data_offset=0, file_size=0)


def base(n_layer: int, **kv: Any) -> dict[str, Any]:
    return {
        "block_count": n_layer,
        "context_length": 4096,
        "embedding_length": 256,
        "attention.head_count": 8,
        "attention.head_count_kv": 2,
        "feed_forward_length": 512,
        **kv,
    }


QWEN_SSM = {
    "ssm.conv_kernel": 4,
    "ssm.inner_size": 4096,
    "ssm.state_size": 128,
    "ssm.group_count": 16,
    "ssm.time_step_rank": 32,
}


def router(il: int) -> TensorInfo:
    return TensorInfo(f"blk.{il}.ffn_gate_inp.weight", (256, 16), 0, "F32", 0, 256 * 16 * 4)
