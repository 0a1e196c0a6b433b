"""Tiny GGUF models that llama-server really loads, one writer per architecture family.

Each `write_<arch>` writes a random-weight (or, with `sparse=True`, all-zero) model with exactly the tensors
llama.cpp's loader creates for that architecture, a byte-fallback SPM vocabulary, and the metadata the
architecture requires. With `sparse=True` the tensor data region is left as a file hole (the header is
written, then the file is truncated to its full size), so realistic 9B-30B shapes cost almost no disk and
load as zeros. Used by the end-to-end tests and by `python -m benchmarks.accuracy`.

This module names every writer; they live in a module per kind of family: `tiny_models_attention`
(attention-only), `tiny_models_moe` (mixtures of experts), `tiny_models_hybrid` (attention with recurrent or
convolution blocks), `tiny_models_recurrent` (recurrent only), and `tiny_models_dense` and
`tiny_models_moe_rwkv6` (more families, imported from those modules).

Each family is data: its header keys (dicts relative to the architecture; None leaves a key out), its named
sizes, and a tensor table per block kind (`_table`: one tensor a line, its name and its ggml dimensions as size
expressions such as `embd 2*q` or `kernel inner+2*groups*state`). One engine (`_spec`, `_write`, in
`tests.tiny_models_engine`) writes the keys in file order, resolves every block's sizes (a per-block list for
variable GQA and hybrids) and adds the tensors; matrices take the model's weight type, norms, biases, vectors and
conv kernels stay f32, and every `ssm_a` is negative. Adding an architecture is a table and a writer of a few lines.

Shapes follow ggml order ({ne0, ne1, …}); numpy arrays are the reverse.
"""

from __future__ import annotations

from tests.tiny_models_attention import (
    write_cohere2,
    write_gemma2,
    write_gemma3,
    write_llama,
    write_phi3,
    write_qwen2,
    write_qwen3,
)
from tests.tiny_models_engine import ModelSpec, sparse_files, write_model
from tests.tiny_models_hybrid import (
    write_falcon_h1,
    write_granitehybrid,
    write_hybrid_set,
    write_jamba,
    write_lfm2,
    write_nemotron_h,
    write_nemotron_h_moe,
    write_plamo2,
    write_qwen3next,
    write_qwen35,
    write_qwen35_9b,
    write_qwen35moe,
)
from tests.tiny_models_moe import write_deepseek2, write_glm4moe, write_gpt_oss, write_qwen3moe
from tests.tiny_models_recurrent import write_arwkv7, write_mamba, write_mamba2, write_rwkv7

__all__ = [
    "ModelSpec",
    "sparse_files",
    "write_arwkv7",
    "write_cohere2",
    "write_deepseek2",
    "write_falcon_h1",
    "write_gemma2",
    "write_gemma3",
    "write_glm4moe",
    "write_gpt_oss",
    "write_granitehybrid",
    "write_hybrid_set",
    "write_jamba",
    "write_lfm2",
    "write_llama",
    "write_mamba",
    "write_mamba2",
    "write_model",
    "write_nemotron_h",
    "write_nemotron_h_moe",
    "write_phi3",
    "write_plamo2",
    "write_qwen2",
    "write_qwen3",
    "write_qwen3moe",
    "write_qwen3next",
    "write_qwen35",
    "write_qwen35_9b",
    "write_qwen35moe",
    "write_rwkv7",
]
