"""Tiny multimodal projectors (`--mmproj`) that llama-server really loads, beside a tiny text model.

`write_llava_projector` writes a LLaVA-style projector (`clip.projector_type = "mlp"`): a CLIP vision tower
(patch embedding, position embeddings, `n_layer` pre-norm transformer blocks) and the two-layer MLP that maps
the tower's patch features into the text model's embedding space (`mm.0`, GELU, `mm.2`). llama.cpp's clip
loader (`tools/mtmd/clip.cpp`, `clip_model_loader`) needs exactly this:

* the keys `clip.has_vision_encoder`, `clip.projector_type`, `clip.vision.{embedding_length,
  feed_forward_length, block_count, projection_dim, attention.head_count, attention.layer_norm_epsilon,
  image_size, patch_size, image_mean, image_std}` (the means and deviations at least three numbers);
* per block `attn_out`, `ffn_up` and `ffn_down` (required) and the Q, K and V projections the graph reads;
  an `ffn_down` whose first dimension is the tower's width is taken for a swapped up/down pair, so
  `n_ff` must differ from `n_embd`;
* `mm.2.weight`'s output width is what mtmd checks against the text model's `n_embd` (it refuses a
  mismatch), so `text_embd` must be the text model's width.

A fixed-size projector (no `image_grid_pinpoints`) resizes every image to `image_size` square, so an image
is always `(image_size / patch_size)^2` tokens and the vision graph has one shape. Tensor layout as a
converter writes it: matrices in `dtype`, the patch kernel f16, norms, biases and embeddings f32. With
`sparse=True` the data region is a file hole (loads as zeros), so released tower widths cost no disk.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.tiny_models import ModelSpec, write_model

__all__ = ["write_llava_projector"]


def write_llava_projector(
    path: str | os.PathLike[str],
    *,
    text_embd: int,
    n_embd: int = 64,
    n_head: int = 4,
    n_ff: int = 128,
    n_layer: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
    mm_hidden: int | None = None,
    class_embedding: bool = True,
    pre_norm: bool = True,
    post_norm: bool = False,
    dtype: str = "f32",
    sparse: bool = False,
    seed: int = 0,
) -> Path:
    """A LLaVA MLP projector whose image embeddings are `text_embd` wide (the text model's n_embd).

    `mm_hidden` is the width between the projector's two linear layers (default: `text_embd`). Only the
    first `n_layer - 1` blocks run (LLaVA reads the second-to-last layer's features), but all are loaded.
    """
    if n_ff == n_embd:
        raise ValueError("n_ff equal to n_embd reads as a swapped ffn_up/ffn_down pair; choose another width")
    if image_size % patch_size:
        raise ValueError("image_size must be a multiple of patch_size")
    hidden = mm_hidden or text_embd
    spec = ModelSpec(arch="clip", kv={"general.name": "tiny-llava-mmproj"})
    kv = spec.kv
    kv["clip.has_vision_encoder"] = True
    kv["clip.projector_type"] = "mlp"
    kv["clip.use_gelu"] = True
    kv["clip.vision.embedding_length"] = n_embd
    kv["clip.vision.feed_forward_length"] = n_ff
    kv["clip.vision.block_count"] = n_layer
    kv["clip.vision.projection_dim"] = text_embd
    kv["clip.vision.attention.head_count"] = n_head
    kv["clip.vision.attention.layer_norm_epsilon"] = 1e-5
    kv["clip.vision.image_size"] = image_size
    kv["clip.vision.patch_size"] = patch_size
    kv["clip.vision.image_mean"] = [0.48145466, 0.4578275, 0.40821073]
    kv["clip.vision.image_std"] = [0.26862954, 0.26130258, 0.27577711]

    n_pos = (image_size // patch_size) ** 2 + (1 if class_embedding else 0)
    if class_embedding:
        spec.add("v.class_embd", (n_embd,))
    spec.add("v.patch_embd.weight", (patch_size, patch_size, 3, n_embd), "f16")
    spec.add("v.position_embd.weight", (n_embd, n_pos))
    if pre_norm:
        spec.add("v.pre_ln.weight", (n_embd,))
        spec.add("v.pre_ln.bias", (n_embd,))
    for il in range(n_layer):
        block = f"v.blk.{il}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            spec.add(f"{block}{name}.weight", (n_embd, n_embd), dtype)
            spec.add(f"{block}{name}.bias", (n_embd,))
        for name in ("ln1", "ln2"):
            spec.add(f"{block}{name}.weight", (n_embd,))
            spec.add(f"{block}{name}.bias", (n_embd,))
        spec.add(f"{block}ffn_up.weight", (n_embd, n_ff), dtype)
        spec.add(f"{block}ffn_up.bias", (n_ff,))
        spec.add(f"{block}ffn_down.weight", (n_ff, n_embd), dtype)
        spec.add(f"{block}ffn_down.bias", (n_embd,))
    if post_norm:
        spec.add("v.post_ln.weight", (n_embd,))
        spec.add("v.post_ln.bias", (n_embd,))
    spec.add("mm.0.weight", (n_embd, hidden), dtype)
    spec.add("mm.0.bias", (hidden,))
    spec.add("mm.2.weight", (hidden, text_embd), dtype)
    spec.add("mm.2.bias", (text_embd,))
    return write_model(spec, path, sparse=sparse, seed=seed)
