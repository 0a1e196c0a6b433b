"""Multimodal projectors (`--mmproj`): what a projector file is, and what llama-server allocates for it
(placement core).

This module owns reading a projector's header into a `ProjectorGeometry` and the three things the server
allocates for it (llama.cpp's `tools/mtmd`, `clip.cpp`), for the projector types it sizes (LLaVA's "mlp"):

* its **weights**: the loader reads every tensor into one buffer of the CLIP backend (the first GPU when the
  projector is offloaded, the host otherwise; it does not map the file), each tensor rounded up to the
  buffer's alignment. llama-server logs the tensors' sum as `load_hparams: model size: X MiB`: the runner
  compares that line with `tensor_bytes`, so this figure is byte-exact as far as the log shows it.
* its **compute buffer**: the graph of one image, reserved by ggml-alloc. llama-server starts without a
  warm-up (the runner passes `--no-warmup`), so this buffer is reserved at the first image
  (`reserve_compute_meta: … compute buffer size`), not at start: the runner counts it as pending until then.
  A fixed-size projector resizes every image to `image_size` square, so the graph has one shape, and it is
  placed here node by node as ggml-alloc places it (`graph_alloc._graph_peak`: inputs first, in place over a
  source only it reads where the op allows, every tensor freed after its last reader). Measured against
  llama-server on 16 cases (`benchmarks/projector_compute.py`: towers 64-1024 wide and LLaVA-1.5-7B's at
  released widths, 32-448 pixel images, patches of 8-16, with and without a class token, pre- and post-norms,
  flash attention on and off): every case equal to the printed figure (0.01 MiB). Admission still adds the
  compute margin to it, as to every modelled compute buffer.
* the **image embeddings**: mtmd keeps the last image's embeddings (`n_image_tokens x n_mmproj_embd`
  floats) in host memory until the next image; a host extra, filled at the first image.

What the server would refuse is refused here: a projector whose output width is not the text model's
(mtmd's "mismatch between text model and mmproj"). Types and variants whose graph differs (LLaVA-NeXT's
image slicing, a stack of feature layers, the MLP with norms, audio encoders, every other projector type)
raise `UnsupportedProjector`: they are not sized, so they are not admitted. Pure core: no I/O, no clock.
"""

from __future__ import annotations

import functools

from actors.placement.context import MemoryModelError
from actors.placement.gguf_header import GGUFHeader, KVValue, SkippedArray
from actors.placement.graph_alloc import _graph_peak, _Node
from messages.model import ModelGeometry, ProjectorGeometry

__all__ = [
    "CLIP_ARCHITECTURE",
    "ProjectorError",
    "UnsupportedProjector",
    "image_embedding_bytes",
    "n_image_tokens",
    "projector_compute_bytes",
    "projector_device",
    "projector_from_header",
    "validate_projector",
]

CLIP_ARCHITECTURE = "clip"
#: The alignment the loader rounds each tensor up to in its CPU buffer (`TENSOR_ALIGNMENT`).
BUFFER_ALIGNMENT = 32
#: The projector types sized here: LLaVA's two-layer MLP (`PROJECTOR_TYPE_MLP`).
SIZED_TYPES = frozenset({"mlp"})
#: mtmd refuses a projector wider than this image (`clip_model_loader::load_hparams`).
MAX_IMAGE_SIZE = 8192


class ProjectorError(ValueError):
    """The file is not a projector header llama-server would load (a key or tensor it needs is missing)."""


class UnsupportedProjector(ProjectorError):
    """A projector llama-server may load but this estimate does not size (its type or variant)."""


def _pad(n_bytes: int, alignment: int) -> int:
    return -(-n_bytes // alignment) * alignment


def _int(header: GGUFHeader, key: str) -> int:
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProjectorError(f"the projector has no integer {key}")
    if value <= 0:
        raise ProjectorError(f"{key} is {value}; llama-server needs a positive value")
    return value


def _present(value: KVValue | None) -> bool:
    """Whether an optional array key holds anything (an empty array is as good as none to the loader)."""
    if value is None:
        return False
    if isinstance(value, SkippedArray):
        return value.count > 0
    return not isinstance(value, tuple) or len(value) > 0


def projector_from_header(header: GGUFHeader) -> ProjectorGeometry:
    """The projector facts of a `clip` GGUF header. Raises `UnsupportedProjector` for a projector this
    estimate does not size and `ProjectorError` for one llama-server would not load."""
    if header.architecture != CLIP_ARCHITECTURE:
        found = header.architecture
        raise ProjectorError(f"a projector's architecture is {CLIP_ARCHITECTURE!r}, this file's {found!r}")
    if header.get("clip.has_audio_encoder") is True:
        raise UnsupportedProjector("audio encoders are not sized")
    if header.get("clip.has_vision_encoder") is not True:
        raise ProjectorError("the projector has no vision encoder (clip.has_vision_encoder)")
    kind = header.get("clip.projector_type") or header.get("clip.vision.projector_type")
    if not isinstance(kind, str):
        raise ProjectorError("the projector names no clip.projector_type")
    if kind not in SIZED_TYPES:
        raise UnsupportedProjector(f"projector type {kind!r} is not sized (sized: {', '.join(sorted(SIZED_TYPES))})")
    # variants of the same type whose graph or image handling differs
    if _present(header.get("clip.vision.image_grid_pinpoints")):
        raise UnsupportedProjector("LLaVA-NeXT image slicing (clip.vision.image_grid_pinpoints) is not sized")
    if _present(header.get("clip.vision.feature_layer")):
        raise UnsupportedProjector("stacked feature layers (clip.vision.feature_layer) are not sized")
    tensors = {t.name: t for t in header.tensors}
    if "mm.3.weight" in tensors:
        raise UnsupportedProjector("the MLP with norms (mm.3, Yi-VL's projector) is not sized")

    n_embd = _int(header, "clip.vision.embedding_length")
    n_head = _int(header, "clip.vision.attention.head_count")
    n_ff = _int(header, "clip.vision.feed_forward_length")
    n_layer = _int(header, "clip.vision.block_count")
    image_size = _int(header, "clip.vision.image_size")
    patch_size = _int(header, "clip.vision.patch_size")
    if image_size > MAX_IMAGE_SIZE:
        raise ProjectorError(f"clip.vision.image_size is {image_size}; llama-server refuses over {MAX_IMAGE_SIZE}")
    if patch_size > image_size:
        raise ProjectorError(f"the patch ({patch_size}) is larger than the image ({image_size})")
    if n_embd % n_head:
        raise ProjectorError(f"the tower's width {n_embd} is not a multiple of its {n_head} heads")
    for key in ("clip.vision.image_mean", "clip.vision.image_std"):
        value = header.get(key)
        count = value.count if isinstance(value, SkippedArray) else len(value) if isinstance(value, tuple) else 0
        if count < 3:
            raise ProjectorError(f"{key} needs at least three numbers")

    def need(name: str) -> tuple[int, ...]:
        info = tensors.get(name)
        if info is None:
            raise ProjectorError(f"the projector has no tensor {name}")
        return info.shape

    need("v.patch_embd.weight")
    need("v.position_embd.weight")
    for il in range(n_layer):
        for part in ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down"):
            need(f"v.blk.{il}.{part}.weight")
        if f"v.blk.{il}.ffn_gate.weight" in tensors:
            raise UnsupportedProjector("a gated vision FFN (ffn_gate) is not sized")
    mm0, mm2 = need("mm.0.weight"), need("mm.2.weight")
    if len(mm0) < 2 or len(mm2) < 2:
        raise ProjectorError("mm.0.weight and mm.2.weight must be matrices")

    return ProjectorGeometry(
        projector_type="mlp",
        n_embd=n_embd,
        n_head=n_head,
        n_ff=n_ff,
        n_layer=n_layer,
        image_size=image_size,
        patch_size=patch_size,
        mm_hidden=mm0[1],
        n_mmproj_embd=mm2[1],
        class_embedding="v.class_embd" in tensors,
        pre_norm="v.pre_ln.weight" in tensors,
        post_norm="v.post_ln.weight" in tensors,
        patch_kernel_type=tensors["v.patch_embd.weight"].type_name.lower(),
        tensor_bytes=header.total_tensor_bytes,
        buffer_bytes=sum(_pad(t.n_bytes, BUFFER_ALIGNMENT) for t in header.tensors),
        n_tensors=len(header.tensors),
        file_size=header.file_size,
    )


def validate_projector(geometry: ModelGeometry, projector: ProjectorGeometry) -> None:
    """Refuses a projector llama-server refuses beside this model: its embeddings must be the model's width."""
    if projector.n_mmproj_embd != geometry.n_embd:
        raise MemoryModelError(
            f"mmproj: the projector's embeddings are {projector.n_mmproj_embd} wide, the model's "
            f"{geometry.n_embd} (llama-server refuses the pair)"
        )


def projector_device(n_gpu_layers: int, gpu_split: tuple[float, ...] | list[float]) -> int:
    """Where the projector lives: -1 the host, 0 the first GPU. The runner offloads it (`--mmproj-offload`)
    exactly when the model's layers are offloaded, and llama.cpp's CLIP takes the first GPU it finds."""
    return 0 if gpu_split and n_gpu_layers != 0 else -1


def n_image_tokens(projector: ProjectorGeometry) -> int:
    """Tokens one image takes in the text context: one per patch (the class token is dropped)."""
    side = projector.image_size // projector.patch_size
    return side * side


def image_embedding_bytes(projector: ProjectorGeometry) -> int:
    """The host vector mtmd keeps the last image's embeddings in (f32, one text-model row per token)."""
    return 4 * n_image_tokens(projector) * projector.n_mmproj_embd


@functools.lru_cache(maxsize=64)
def projector_compute_bytes(projector: ProjectorGeometry, *, flash_attn: bool) -> int:
    """The compute buffer of one image's graph (`clip_graph_llava::build`), placed as ggml-alloc does.

    Sizes: P patches, N = P (+1 with a class token) positions, the tower E wide with F wide FFNs, the MLP H
    then T wide. The graph: the image (f32, 3 planes) unrolled for the patch convolution (`im2col`, f16, or
    f32 for a bf16 kernel), the convolution's product made contiguous twice (permuted, then transposed), the
    class token concatenated, the position embeddings added; per block (all but the last, whose output
    LLaVA does not read) a layer norm, Q, K and V with their biases, attention (flash attention: K and V cast
    to f16; otherwise the N x N score matrix per head, soft-maxed in place, and V made contiguous), the
    output projection, the residual, a layer norm, the FFN (up, bias, GELU in place, down, bias) and the
    residual; then the patch rows gathered and the MLP. Views are listed as views of the tensor that owns
    their memory, as ggml-alloc counts them."""
    p = projector
    side = p.image_size // p.patch_size
    n_patches = side * side
    n_pos = n_patches + (1 if p.class_embedding else 0)
    e = 4 * n_pos * p.n_embd  # one f32 row of the tower per position
    patch = 4 * n_patches * p.n_embd
    unrolled = (4 if p.patch_kernel_type == "bf16" else 2) * 3 * p.patch_size * p.patch_size * n_patches
    inputs = [("inp_raw", 4 * 3 * p.image_size * p.image_size), ("positions", 4 * n_pos), ("patches", 4 * n_patches)]
    nodes: list[_Node] = [
        ("im2col", "im2col", unrolled, ("inp_raw",)),
        ("im2col_2d", "view", unrolled, ("im2col",)),
        ("conv", "mul_mat", patch, ("im2col_2d",)),
        ("conv_perm", "view", patch, ("conv",)),
        ("conv_cont", "cont", patch, ("conv_perm",)),
        ("inp_t", "view", patch, ("conv_cont",)),
        ("inp", "cont", patch, ("inp_t",)),
    ]
    x = "inp"
    if p.class_embedding:
        nodes.append(("with_class", "concat", e, (x,)))
        x = "with_class"
    nodes += [("pos_rows", "get_rows", e, ("positions",)), ("pos_add", "add", e, (x, "pos_rows"))]
    x = "pos_add"
    if p.pre_norm:
        nodes += [("pre_norm", "norm", e, (x,)), ("pre_w", "mul", e, ("pre_norm",)), ("pre_b", "add", e, ("pre_w",))]
        x = "pre_b"
    ffn = 4 * n_pos * p.n_ff
    scores = 4 * n_pos * n_pos * p.n_head
    for il in range(p.n_layer - 1):

        def n(name: str, il: int = il) -> str:
            return f"{name}-{il}"

        nodes += [
            (n("ln1"), "norm", e, (x,)),
            (n("ln1_w"), "mul", e, (n("ln1"),)),
            (n("ln1_b"), "add", e, (n("ln1_w"),)),
        ]
        for qkv in ("q", "k", "v"):
            nodes += [
                (n(qkv), "mul_mat", e, (n("ln1_b"),)),
                (n(f"{qkv}_b"), "add", e, (n(qkv),)),
                (n(f"{qkv}_3d"), "view", e, (n(f"{qkv}_b"),)),
            ]
        if flash_attn:
            nodes += [
                (n("k_f16"), "cpy", e // 2, (n("k_3d"),)),
                (n("v_f16"), "cpy", e // 2, (n("v_3d"),)),
                (n("fa"), "flash_attn_ext", e, (n("q_3d"), n("k_f16"), n("v_f16"))),
                (n("attn"), "view", e, (n("fa"),)),
            ]
        else:
            nodes += [
                (n("v_cont"), "cont", e, (n("v_3d"),)),
                (n("kq"), "mul_mat", scores, (n("k_3d"), n("q_3d"))),
                (n("kq_soft"), "soft_max", scores, (n("kq"),)),
                (n("kqv"), "mul_mat", e, (n("v_cont"), n("kq_soft"))),
                (n("kqv_perm"), "view", e, (n("kqv"),)),
                (n("attn"), "cont", e, (n("kqv_perm"),)),
            ]
        nodes += [
            (n("o"), "mul_mat", e, (n("attn"),)),
            (n("o_b"), "add", e, (n("o"),)),
            (n("residual"), "add", e, (n("o_b"), x)),
            (n("ln2"), "norm", e, (n("residual"),)),
            (n("ln2_w"), "mul", e, (n("ln2"),)),
            (n("ln2_b"), "add", e, (n("ln2_w"),)),
            (n("up"), "mul_mat", ffn, (n("ln2_b"),)),
            (n("up_b"), "add", ffn, (n("up"),)),
            (n("gelu"), "unary", ffn, (n("up_b"),)),
            (n("down"), "mul_mat", e, (n("gelu"),)),
            (n("down_b"), "add", e, (n("down"),)),
            (n("out"), "add", e, (n("residual"), n("down_b"))),
        ]
        x = n("out")
    if p.post_norm:
        nodes += [
            ("post_norm", "norm", e, (x,)),
            ("post_w", "mul", e, ("post_norm",)),
            ("post_b", "add", e, ("post_w",)),
        ]
        x = "post_b"
    hidden, out = 4 * n_patches * p.mm_hidden, 4 * n_patches * p.n_mmproj_embd
    nodes += [
        ("features", "view", e, (x,)),
        ("patch_rows", "get_rows", patch, ("features", "patches")),
        ("mm0", "mul_mat", hidden, ("patch_rows",)),
        ("mm0_b", "add", hidden, ("mm0",)),
        ("mm0_gelu", "unary", hidden, ("mm0_b",)),
        ("mm2", "mul_mat", out, ("mm0_gelu",)),
        ("embeddings", "add", out, ("mm2",)),
    ]
    return _graph_peak(inputs, nodes, frozenset({"embeddings"}))
