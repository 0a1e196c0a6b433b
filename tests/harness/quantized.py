"""Tiny quantized GGUF models written for tests (a llama whose tensors a server repacks, or copies for AMX)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType


TYPES = {
    "f32": T.F32,
    "f16": T.F16,
    "q4_0": T.Q4_0,
    "q4_1": T.Q4_1,
    "q5_k": T.Q5_K,
    "iq4_xs": T.IQ4_XS,
    "q8_0": T.Q8_0,
    "mxfp4": T.MXFP4,
    "q4_k": T.Q4_K,
    "q2_k": T.Q2_K,
    "q6_k": T.Q6_K,
    "iq4_nl": T.IQ4_NL,
}


QUANTIZED_BY_GGUF = {T.Q4_0, T.Q8_0, T.MXFP4}


def write_quantized_llama(
    path: Path, *, n_layer: int, n_embd: int, n_ff: int, n_vocab: int, types: dict[str, str], tied: bool = False
) -> Path:
    """A llama (8 heads, 2 KV heads) whose weights have the given type per role (f32 where not given)."""
    rng = np.random.default_rng(0)
    arch = "llama"
    n_head, n_head_kv = 8, 2
    head = n_embd // n_head
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": n_layer,
        "context_length": 4096,
        "embedding_length": n_embd,
        "feed_forward_length": n_ff,
        "attention.head_count": n_head,
        "attention.head_count_kv": n_head_kv,
        "rope.dimension_count": head,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    token_types = [2, 3, 3] + [6] * 256
    tokens += [f"t{i}" for i in range(n_vocab - len(tokens))]
    token_types += [1] * (n_vocab - len(token_types))
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", [0.0] * n_vocab)
    writer.add_array("tokenizer.ggml.token_type", token_types)
    for key, token in (("bos", 1), ("eos", 2), ("unknown", 0)):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token)

    def add(name: str, shape: tuple[int, ...], role: str | None = None) -> None:
        qtype = TYPES[types.get(role, "f32")] if role else T.F32
        data = rng.normal(0.0, 0.02, size=tuple(reversed(shape))).astype(np.float32)
        if qtype in (T.F32, T.F16):
            writer.add_tensor(name, data.astype(np.float16) if qtype == T.F16 else data)
            return
        if qtype in QUANTIZED_BY_GGUF:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            return
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((*data.shape[:-1], shape[0] // block * size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)

    kv = n_head_kv * head
    add("token_embd.weight", (n_embd, n_vocab), "embd")
    add("output_norm.weight", (n_embd,))
    if not tied:
        add("output.weight", (n_embd, n_vocab), "output")
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", (n_embd,))
        add(p + "attn_q.weight", (n_embd, n_embd), "q")
        add(p + "attn_k.weight", (n_embd, kv), "k")
        add(p + "attn_v.weight", (n_embd, kv), "v")
        add(p + "attn_output.weight", (n_embd, n_embd), "o")
        add(p + "ffn_norm.weight", (n_embd,))
        add(p + "ffn_gate.weight", (n_embd, n_ff), "gate")
        add(p + "ffn_up.weight", (n_embd, n_ff), "up")
        add(p + "ffn_down.weight", (n_ff, n_embd), "down")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
