"""Model geometry from a GGUF header (placement core).

This module owns the translation of a GGUF header into a `ModelGeometry`: for every block, whether
llama.cpp gives it attention KV cells (and how wide they are), a recurrent state (and how wide), whether it
slides (SWA), whether it is an MTP (`nextn`) block, its head sizes and, for a routed mixture of experts,
how wide each expert is and how many a token uses, plus the tensor bytes the memory model places on
devices. The rules mirror llama.cpp's `load_hparams`/`load_arch_hparams` and `create_memory` for the version
named in `actors.placement.memory.LLAMA_CPP_VERSION`; each family's rule is written once, in a table or a
small function, and an architecture without a rule is refused by name (`UnsupportedArchitecture`), never
guessed. Pure core: it reads a `GGUFHeader` value and returns a message.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from actors.placement.gguf_header import GGUFHeader, KVValue, SkippedArray
from actors.placement.matmul_weights import mapped_edges, repack_groups
from messages.model import HeaderPooling, LayerGeometry, MemoryKind, ModelGeometry, RecurrentKind, SwaType

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GeometryError",
    "UnsupportedArchitecture",
    "geometry_from_header",
]

LLAMA_MAX_LAYERS = 512


class GeometryError(ValueError):
    """The header names a supported architecture but its metadata is missing or inconsistent."""


class UnsupportedArchitecture(GeometryError):
    """The architecture has no geometry rule here; the memory model refuses it rather than guessing."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture
        super().__init__(
            f"unsupported architecture {architecture!r}: no memory-model rule for it "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )


# --- metadata access --------------------------------------------------------------------------------------


class _Meta:
    """Typed access to `{arch}.*` keys with llama.cpp's required/optional and scalar-or-array rules."""

    def __init__(self, header: GGUFHeader, arch: str) -> None:
        self.header = header
        self.arch = arch

    def raw(self, suffix: str) -> KVValue | None:
        return self.header.get(f"{self.arch}.{suffix}")

    def uint(self, suffix: str, default: int | None = None) -> int:
        key = f"{self.arch}.{suffix}"
        value = self.header.get(key)
        if value is None:
            if default is None:
                raise GeometryError(f"{key} is required for {self.arch} but missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise GeometryError(f"{key} must be an unsigned integer, got {value!r}")
        if value < 0 or value >= 1 << 32:
            raise GeometryError(f"{key} out of range for a u32: {value}")
        return value

    def has(self, suffix: str) -> bool:
        return self.raw(suffix) is not None

    def per_layer(self, suffix: str, n_layer: int, default: Sequence[int] | int | None) -> list[int]:
        """`get_key_or_arr`: a scalar repeated per layer, or an array of exactly `n_layer` entries."""
        key = f"{self.arch}.{suffix}"
        value = self.header.get(key)
        if value is None:
            if default is None:
                raise GeometryError(f"{key} is required for {self.arch} but missing")
            return [default] * n_layer if isinstance(default, int) else list(default)
        if isinstance(value, SkippedArray):
            raise GeometryError(f"{key} has {value.count} entries, expected {n_layer}")
        if isinstance(value, tuple):
            if len(value) != n_layer:
                raise GeometryError(f"{key} has wrong array length; expected {n_layer}, got {len(value)}")
            return [_as_uint(key, v) for v in value]
        return [_as_uint(key, value)] * n_layer

    def bool_array(self, suffix: str) -> list[bool] | None:
        key = f"{self.arch}.{suffix}"
        value = self.header.get(key)
        if not isinstance(value, tuple):
            return None
        if len(value) > LLAMA_MAX_LAYERS:
            raise GeometryError(f"{key} has {len(value)} entries, more than {LLAMA_MAX_LAYERS}")
        out: list[bool] = []
        for v in value:
            if isinstance(v, bool):
                out.append(v)
            elif isinstance(v, int):
                out.append(v != 0)
            else:
                raise GeometryError(f"{key} must hold booleans or integers, got {v!r}")
        return out


def _as_uint(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 1 << 32:
        raise GeometryError(f"{key} must hold unsigned integers, got {value!r}")
    return value


# --- per-family rules -------------------------------------------------------------------------------------


@dataclass
class _Draft:
    """Per-layer facts being assembled, mirroring llama.cpp's hparams arrays."""

    n_layer_all: int
    n_nextn: int
    n_head: list[int]
    n_head_kv: list[int]
    n_ff: list[int]
    is_swa: list[bool]
    is_recr: list[bool]
    n_expert: int = 0
    n_expert_used: list[int] = field(default_factory=list)  # `expert_used_count`, per layer
    n_ff_exp: list[int] = field(default_factory=list)  # the expert width of each routed layer, 0 elsewhere
    used_per_layer: list[int] = field(default_factory=list)  # the experts each routed layer's graph uses
    swa_type: SwaType = "none"
    n_swa: int = 0
    r_width: int = 0
    s_width: int = 0
    mla: bool = False
    ssm: tuple[int, int, int, int] = (0, 0, 0, 0)  # d_inner, d_state, n_group, dt_rank

    @property
    def n_layer(self) -> int:
        return self.n_layer_all - self.n_nextn

    def set_swa_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """`llama_hparams::set_swa_pattern`: every n-th layer is dense; nextn layers never slide."""
        for il in range(self.n_layer_all):
            if il >= self.n_layer:
                self.is_swa[il] = False
            elif dense_first:
                self.is_swa[il] = n_pattern == 0 or il % n_pattern != 0
            else:
                self.is_swa[il] = n_pattern == 0 or il % n_pattern < n_pattern - 1

    def load_swa_pattern(self, meta: _Meta, n_pattern: int) -> None:
        """`load_swa_pattern`: a bool array if present, else an integer pattern (default per arch)."""
        flags = meta.bool_array("attention.sliding_window_pattern")
        if flags is not None:
            for il in range(self.n_layer_all):
                self.is_swa[il] = il < len(flags) and flags[il]
            return
        self.set_swa_pattern(meta.uint("attention.sliding_window_pattern", n_pattern))


def _ssm(meta: _Meta, d: _Draft, *, groups: bool) -> None:
    """Mamba-style state: conv rows (d_conv-1)·(d_inner + 2·groups·d_state) and d_state·d_inner."""
    d_conv = meta.uint("ssm.conv_kernel")
    d_inner = meta.uint("ssm.inner_size")
    d_state = meta.uint("ssm.state_size")
    n_group = meta.uint("ssm.group_count") if groups else 0
    d.r_width = (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)
    d.s_width = d_state * d_inner
    d.ssm = (d_inner, d_state, n_group, meta.uint("ssm.time_step_rank"))


def _rwkv(meta: _Meta, d: _Draft, n_embd: int) -> None:
    head_size = meta.uint("wkv.head_size")
    shift = meta.uint("token_shift_count", 2)
    d.r_width = shift * n_embd
    d.s_width = n_embd * head_size


def _dense(meta: _Meta, d: _Draft, n_embd: int) -> None:
    del meta, d, n_embd


def _gemma2(meta: _Meta, d: _Draft, n_embd: int) -> None:
    d.swa_type = "standard"
    d.n_swa = 4096  # gemma 2's default window
    d.load_swa_pattern(meta, 2)
    d.n_swa = meta.uint("attention.sliding_window", d.n_swa)


def _gemma3(meta: _Meta, d: _Draft, n_embd: int) -> None:
    n_swa = meta.uint("attention.sliding_window", 0)
    if n_swa > 0:
        d.swa_type = "standard"
        d.n_swa = n_swa
        d.load_swa_pattern(meta, 6)


def _cohere2(meta: _Meta, d: _Draft, n_embd: int) -> None:
    d.swa_type = "standard"
    d.load_swa_pattern(meta, 4)
    d.n_swa = meta.uint("attention.sliding_window")


def _gpt_oss(meta: _Meta, d: _Draft, n_embd: int) -> None:
    d.n_swa = meta.uint("attention.sliding_window")
    d.swa_type = "standard"
    d.load_swa_pattern(meta, 2)


def _phi3(meta: _Meta, d: _Draft, n_embd: int) -> None:
    # llama.cpp disables Phi-3's sliding window (a full cache on every layer) whatever the header says.
    d.swa_type = "none"
    d.n_swa = 0


def _deepseek2(meta: _Meta, d: _Draft, n_embd: int) -> None:
    # MLA GGUFs cache one latent K row per token (key_length = kv_lora_rank + rope dims, 1 KV head), no V.
    d.mla = meta.uint("attention.key_length_mla", 0) != 0 and meta.uint("attention.value_length_mla", 0) != 0


def _qwen_hybrid(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _ssm(meta, d, groups=True)
    if meta.has("attention.recurrent_layers"):
        flags = meta.bool_array("attention.recurrent_layers")
        if flags is None or len(flags) != d.n_layer_all:
            raise GeometryError(f"{meta.arch}.attention.recurrent_layers must be an array of {d.n_layer_all} flags")
        d.is_recr = flags
        return
    interval = meta.uint("full_attention_interval", 4)
    if interval == 0:
        raise GeometryError(f"{meta.arch}.full_attention_interval must be positive")
    d.is_recr = [il < d.n_layer and (il + 1) % interval != 0 for il in range(d.n_layer_all)]


def _recurrent_when_no_kv_heads(d: _Draft) -> None:
    for il in range(d.n_layer):
        d.is_recr[il] = d.n_head_kv[il] == 0


def _granitehybrid(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _ssm(meta, d, groups=True)
    _recurrent_when_no_kv_heads(d)


def _jamba(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _ssm(meta, d, groups=False)
    _recurrent_when_no_kv_heads(d)


def _plamo2(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _ssm(meta, d, groups=True)
    _recurrent_when_no_kv_heads(d)


def _nemotron_h(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _ssm(meta, d, groups=True)
    for il in range(d.n_layer_all):
        d.is_recr[il] = il < d.n_layer and d.n_head_kv[il] == 0 and d.n_ff[il] == 0


def _falcon_h1(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _ssm(meta, d, groups=True)
    d.is_recr = [True] * d.n_layer_all


def _lfm2(meta: _Meta, d: _Draft, n_embd: int) -> None:
    l_cache = meta.uint("shortconv.l_cache")
    d.r_width = n_embd * (l_cache - 1) if l_cache > 0 else 0
    d.s_width = 0
    _recurrent_when_no_kv_heads(d)
    n_swa = meta.uint("attention.sliding_window", 0)
    if n_swa > 0:
        d.swa_type = "standard"
        d.n_swa = n_swa
        for il in range(d.n_layer):
            d.is_swa[il] = not d.is_recr[il]


def _lfm2moe(meta: _Meta, d: _Draft, n_embd: int) -> None:
    # lfm2moe's loader does not read the sliding window that lfm2's does: its attention never slides
    _lfm2(meta, d, n_embd)
    d.swa_type = "none"
    d.n_swa = 0
    d.is_swa = [False] * d.n_layer_all


def _mamba(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _ssm(meta, d, groups=False)


def _mamba2(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _ssm(meta, d, groups=True)


def _rwkv_family(meta: _Meta, d: _Draft, n_embd: int) -> None:
    _rwkv(meta, d, n_embd)


def _rwkv_token_shifts(rows: int) -> Callable[[_Meta, _Draft, int], None]:
    """RWKV-6 and QRWKV6 graphs assert their token-shift row count (2 and 1): another count aborts
    llama-server while it reserves, so it is refused by name."""

    def rule(meta: _Meta, d: _Draft, n_embd: int) -> None:
        _rwkv(meta, d, n_embd)
        shift = meta.uint("token_shift_count", 2)
        if shift != rows:
            raise GeometryError(
                f"{meta.arch}.token_shift_count must be {rows} (llama.cpp's graph requires it), got {shift}"
            )

    return rule


# --- routed experts (llama.cpp `load_arch_tensors`: the shapes of `ffn_*_exps`) -----------------------------
#
# A rule marks the layers whose FFN is a routed mixture and gives each its expert width. Most graphs route
# every MoE layer to the model's `n_expert_used` (layer 0's value); nemotron_h routes each layer to its own.


def _route(d: _Draft, il: int, width: int, used: int) -> None:
    d.n_ff_exp[il] = width
    d.used_per_layer[il] = used if width else 0


def _experts_none(meta: _Meta, d: _Draft, routers: frozenset[int]) -> None:
    del meta, d, routers


def _experts_n_ff_wide(meta: _Meta, d: _Draft, routers: frozenset[int]) -> None:
    """llama, mistral3 and the granites: with experts, every layer's are `feed_forward_length` wide."""
    if d.n_expert:
        for il in range(d.n_layer_all):
            _route(d, il, d.n_ff[0], d.n_expert_used[0])


def _experts_where_routed(meta: _Meta, d: _Draft, routers: frozenset[int]) -> None:
    """jamba: a layer is a mixture when it has a router (`ffn_gate_inp`); its experts are n_ff wide."""
    if d.n_expert:
        for il in sorted(routers):
            _route(d, il, d.n_ff[0], d.n_expert_used[0])


def _expert_width(meta: _Meta, d: _Draft, *, required: bool) -> int:
    """`expert_feed_forward_length` (layer 0's sizes every layer's tensors), else n_ff / experts used."""
    widths = meta.per_layer("expert_feed_forward_length", d.n_layer_all, None if required else 0)
    if widths[0]:
        return widths[0]
    return d.n_ff[0] // d.n_expert_used[0] if d.n_expert_used[0] else 0


def _experts_every_layer(meta: _Meta, d: _Draft, routers: frozenset[int]) -> None:
    """qwen2moe, qwen3moe, qwen35moe, qwen3next: every block is a mixture (nextn blocks too)."""
    if d.n_expert:
        width = _expert_width(meta, d, required=False)
        for il in range(d.n_layer_all):
            _route(d, il, width, d.n_expert_used[0])


def _experts_gpt_oss(meta: _Meta, d: _Draft, routers: frozenset[int]) -> None:
    if d.n_expert:
        width = _expert_width(meta, d, required=True)
        for il in range(d.n_layer_all):
            _route(d, il, width, d.n_expert_used[0])


def _experts_after_dense_lead(*, required: bool) -> Callable[[_Meta, _Draft, frozenset[int]], None]:
    """deepseek2, glm4moe, lfm2moe: the first `leading_dense_block_count` blocks are dense."""

    def rule(meta: _Meta, d: _Draft, routers: frozenset[int]) -> None:
        if d.n_expert:
            width = _expert_width(meta, d, required=required)
            for il in range(meta.uint("leading_dense_block_count", 0), d.n_layer_all):
                _route(d, il, width, d.n_expert_used[0])

    return rule


def _experts_nemotron(meta: _Meta, d: _Draft, routers: frozenset[int]) -> None:
    """nemotron_h(_moe): with experts, trunk blocks with an FFN length are mixtures, each with its own width
    and experts used (Puzzle models vary both); nextn blocks hold a mixture too."""
    if not d.n_expert:
        return
    widths = meta.per_layer("expert_feed_forward_length", d.n_layer_all, 0)
    for il in range(d.n_layer_all):
        used = d.n_expert_used[il]
        if il >= d.n_layer:
            n_ff = d.n_ff[0]  # llama.cpp divides the model's (layer 0's) length here
        elif d.n_ff[il] > 0 and not d.is_recr[il]:
            n_ff = d.n_ff[il]
        else:
            continue
        _route(d, il, widths[il] or (n_ff // used if used else 0), used)


@dataclass(frozen=True)
class _Family:
    """How llama.cpp builds an architecture's memory.

    memory: "kv" (attention KV only, SWA split when a layer slides), "hybrid" (KV + recurrent with layer
    filters), "recurrent" (recurrent state on every trunk layer, no KV).
    attn_filter: which layers of a hybrid get KV ("not_recr", "nemotron", "all", "trunk_not_recr").
    rollback: llama.cpp's `llm_arch_supports_rs_rollback`.
    mtp: what a `draft-mtp` context holds ("nextn" for the nextn blocks, or "" when MTP is unavailable).
    head_size_keys: the family reads attention.key_length/value_length itself, even when layer 0 has no
    heads (the generic rule derives head sizes from layer 0's head count).
    experts: which layers route to experts, and how wide those are.
    """

    rule: Callable[[_Meta, _Draft, int], None]
    memory: MemoryKind
    recurrent_kind: RecurrentKind = "none"
    attn_filter: str = "not_recr"
    rollback: bool = False
    mtp: str = ""
    mla_keys: bool = False
    head_size_keys: bool = False
    experts: Callable[[_Meta, _Draft, frozenset[int]], None] = _experts_none


_FAMILIES: dict[str, _Family] = {
    # dense transformers (MoE included): KV on every trunk layer
    "llama": _Family(_dense, "kv", experts=_experts_n_ff_wide),
    "qwen2": _Family(_dense, "kv"),
    "qwen2moe": _Family(_dense, "kv", experts=_experts_every_layer),
    "qwen3": _Family(_dense, "kv"),
    "qwen3moe": _Family(_dense, "kv", experts=_experts_every_layer),
    "mistral3": _Family(_dense, "kv", experts=_experts_n_ff_wide),
    "phi3": _Family(_phi3, "kv"),
    "gemma": _Family(_dense, "kv"),
    "granite": _Family(_dense, "kv", experts=_experts_n_ff_wide),
    "granitemoe": _Family(_dense, "kv", experts=_experts_n_ff_wide),
    "command-r": _Family(_dense, "kv"),
    "starcoder2": _Family(_dense, "kv"),
    "glm4moe": _Family(_dense, "kv", mtp="nextn", experts=_experts_after_dense_lead(required=False)),
    "deepseek2": _Family(
        _deepseek2, "kv", mtp="nextn", mla_keys=True, experts=_experts_after_dense_lead(required=True)
    ),
    # sliding-window transformers
    "gemma2": _Family(_gemma2, "kv"),
    "gemma3": _Family(_gemma3, "kv"),
    "cohere2": _Family(_cohere2, "kv"),
    "gpt-oss": _Family(_gpt_oss, "kv", experts=_experts_gpt_oss),
    # hybrids: attention KV on some layers, recurrent state on others
    "qwen35": _Family(_qwen_hybrid, "hybrid", "gated_delta", "trunk_not_recr", rollback=True, mtp="nextn"),
    "qwen35moe": _Family(
        _qwen_hybrid,
        "hybrid",
        "gated_delta",
        "trunk_not_recr",
        rollback=True,
        mtp="nextn",
        experts=_experts_every_layer,
    ),
    "qwen3next": _Family(
        _qwen_hybrid, "hybrid", "gated_delta", "trunk_not_recr", mtp="nextn", experts=_experts_every_layer
    ),
    "granitehybrid": _Family(_granitehybrid, "hybrid", "mamba", experts=_experts_n_ff_wide),
    "jamba": _Family(_jamba, "hybrid", "mamba", experts=_experts_where_routed),
    "plamo2": _Family(_plamo2, "hybrid", "mamba", head_size_keys=True),
    "lfm2": _Family(_lfm2, "hybrid", "shortconv", rollback=True),
    "lfm2moe": _Family(
        _lfm2moe, "hybrid", "shortconv", rollback=True, experts=_experts_after_dense_lead(required=True)
    ),
    "nemotron_h": _Family(_nemotron_h, "hybrid", "mamba", "nemotron", rollback=True, experts=_experts_nemotron),
    "nemotron_h_moe": _Family(
        _nemotron_h, "hybrid", "mamba", "nemotron", rollback=True, mtp="nextn", experts=_experts_nemotron
    ),
    "falcon-h1": _Family(_falcon_h1, "hybrid", "mamba", "all"),
    # pure recurrent
    "mamba": _Family(_mamba, "recurrent", "mamba"),
    "mamba2": _Family(_mamba2, "recurrent", "mamba"),
    "rwkv6": _Family(_rwkv_token_shifts(2), "recurrent", "rwkv"),
    "rwkv6qwen2": _Family(_rwkv_token_shifts(1), "recurrent", "rwkv"),
    "rwkv7": _Family(_rwkv_family, "recurrent", "rwkv"),
    "arwkv7": _Family(_rwkv_family, "recurrent", "rwkv"),
}

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(_FAMILIES)

_INPUT_TENSOR = re.compile(r"^(token_embd|position_embd|token_types)\.")
_LAYER_TENSOR = re.compile(r"^blk\.([0-9]+)\.")
_ROUTER_TENSOR = re.compile(r"^blk\.([0-9]+)\.ffn_gate_inp\.weight$")


def _vocab_size(header: GGUFHeader, meta: _Meta) -> int:
    tokens = header.get("tokenizer.ggml.tokens")
    if isinstance(tokens, SkippedArray):
        return tokens.count
    if isinstance(tokens, tuple):
        return len(tokens)
    if meta.has("vocab_size"):
        return meta.uint("vocab_size")
    for t in header.tensors:
        if t.name == "token_embd.weight" and len(t.shape) >= 2:
            return t.shape[1]
    return 0


def _longest_token(header: GGUFHeader) -> int:
    """The longest token's text in bytes (0: no vocabulary listed): an upper bound on the text one token covers,
    so a prompt of more bytes than the context times this can never fit it."""
    tokens = header.get("tokenizer.ggml.tokens")
    if isinstance(tokens, SkippedArray):
        return tokens.longest
    if isinstance(tokens, tuple):
        return max((len(str(t).encode()) for t in tokens), default=0)
    return 0


def geometry_from_header(header: GGUFHeader) -> ModelGeometry:
    """The model's geometry, or `UnsupportedArchitecture` / `GeometryError` naming what is wrong."""
    arch = header.architecture
    family = _FAMILIES.get(arch)
    if family is None:
        raise UnsupportedArchitecture(arch)
    meta = _Meta(header, arch)

    n_layer_all = meta.uint("block_count")
    if not 0 < n_layer_all <= LLAMA_MAX_LAYERS:
        raise GeometryError(f"{arch}.block_count must be in 1..{LLAMA_MAX_LAYERS}, got {n_layer_all}")
    n_nextn = meta.uint("nextn_predict_layers", 0)
    if n_nextn > n_layer_all:
        raise GeometryError(f"{arch}.nextn_predict_layers ({n_nextn}) exceeds block_count ({n_layer_all})")
    n_embd = meta.uint("embedding_length")
    n_ctx_train = meta.uint("context_length")

    n_head = meta.per_layer("attention.head_count", n_layer_all, 0)
    n_head_kv = meta.per_layer("attention.head_count_kv", n_layer_all, n_head)
    n_ff = meta.per_layer("feed_forward_length", n_layer_all, 0)
    n_expert = meta.uint("expert_count", 0)
    expert_used = meta.per_layer("expert_used_count", n_layer_all, 0)
    n_expert_used = max(expert_used, default=0)

    # Head sizes: llama.cpp derives them from layer 0's head count, then lets explicit keys override.
    if n_head[0] > 0:
        head_k = meta.uint("attention.key_length", n_embd // n_head[0])
        head_v = meta.uint("attention.value_length", n_embd // n_head[0])
    else:
        head_k = head_v = 0
    head_k_swa = meta.uint("attention.key_length_swa", head_k)
    head_v_swa = meta.uint("attention.value_length_swa", head_v)
    if family.head_size_keys:
        # read again by the family itself: PLaMo 2's layer 0 is a Mamba block with no heads, which leaves
        # the generic head size at 0
        head_k = meta.uint("attention.key_length", head_k)
        head_v = meta.uint("attention.value_length", head_v)

    draft = _Draft(
        n_layer_all=n_layer_all,
        n_nextn=n_nextn,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        is_swa=[False] * n_layer_all,
        is_recr=[family.memory == "recurrent"] * n_layer_all,
        n_expert=n_expert,
        n_expert_used=expert_used,
        n_ff_exp=[0] * n_layer_all,
        used_per_layer=[0] * n_layer_all,
    )
    family.rule(meta, draft, n_embd)
    family.experts(meta, draft, _router_layers(header, n_layer_all))
    if family.memory == "recurrent" and (draft.r_width + draft.s_width) == 0:
        raise GeometryError(f"{arch} has an empty recurrent state (check its ssm/wkv keys)")

    layer_bytes = _layer_tensor_bytes(header, n_layer_all)
    layer_padded = _layer_padded_bytes(header, n_layer_all)
    layer_repack, output_repack = repack_groups(header, n_layer_all)
    mapped_head, mapped_tail = mapped_edges(header, n_layer_all, draft.n_layer)
    layers: list[LayerGeometry] = []
    for il in range(n_layer_all):
        swa = draft.is_swa[il]
        heads_kv = draft.n_head_kv[il]
        nextn = il >= draft.n_layer
        recurrent = _has_recurrent(family, draft, il)
        attention = _has_attention(family, draft, il)
        layer_head_k = head_k_swa if swa else head_k
        layer_head_v = head_v_swa if swa else head_v  # an MLA model's V head: its kv_lora_rank
        k_width = layer_head_k * heads_kv
        v_width = 0 if draft.mla else layer_head_v * heads_kv
        if (attention or (nextn and family.mtp)) and k_width == 0:
            raise GeometryError(f"{arch} layer {il} has attention but an empty K row (no KV heads or no head size)")
        layers.append(
            LayerGeometry(
                index=il,
                attention=attention,
                recurrent=recurrent,
                swa=swa,
                nextn=nextn,
                n_head=draft.n_head[il],
                n_head_kv=heads_kv,
                k_width=k_width,
                v_width=v_width,
                r_width=draft.r_width if recurrent else 0,
                s_width=draft.s_width if recurrent else 0,
                n_ff=draft.n_ff[il],
                tensor_bytes=layer_bytes[il],
                padded_bytes=layer_padded[il],
                head_k=layer_head_k,
                head_v=layer_head_v,
                n_ff_exp=draft.n_ff_exp[il],
                n_expert_used=draft.used_per_layer[il],
                repack=layer_repack.get(il, ()),
            )
        )
    if draft.swa_type != "none" and not any(layer.swa for layer in layers):
        raise GeometryError(f"{arch} declares a sliding window but no layer slides")

    input_bytes, output_bytes, token_embd_bytes, has_output = _global_tensor_bytes(header)
    output_padded, token_embd_padded = _global_padded_bytes(header)
    pooling = meta.uint("pooling_type", _NO_POOLING)
    if pooling != _NO_POOLING and pooling not in _POOLING_TYPES:
        raise GeometryError(f"{arch}.pooling_type {pooling} is not a llama.cpp pooling type (0-4)")
    return ModelGeometry(
        architecture=arch,
        memory=family.memory,
        n_layer=n_layer_all,
        n_layer_nextn=n_nextn,
        n_embd=n_embd,
        n_vocab=_vocab_size(header, meta),
        longest_token_bytes=_longest_token(header),
        n_ctx_train=n_ctx_train,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        swa_type=draft.swa_type,
        n_swa=draft.n_swa if draft.swa_type != "none" else 0,
        mla=draft.mla,
        rollback=family.rollback,
        mtp_context=bool(family.mtp) and n_nextn > 0 and n_nextn < n_layer_all,
        recurrent_kind=family.recurrent_kind,
        ssm_d_inner=draft.ssm[0],
        ssm_d_state=draft.ssm[1],
        ssm_n_group=draft.ssm[2],
        ssm_dt_rank=draft.ssm[3],
        layers=tuple(layers),
        input_tensor_bytes=input_bytes,
        output_tensor_bytes=output_bytes,
        tied_output=not has_output,
        token_embd_bytes=token_embd_bytes,
        output_padded_bytes=output_padded,
        token_embd_padded_bytes=token_embd_padded,
        file_size=header.file_size,
        output_repack=output_repack,
        mapped_head=mapped_head,
        mapped_tail=mapped_tail,
        pooling=_POOLING_TYPES.get(pooling, ""),
        n_embd_out=meta.uint("embedding_length_out", 0),
        rank_head=any(t.name.startswith(_CLASSIFIER_TENSORS) for t in header.tensors),
    )


def _has_recurrent(family: _Family, d: _Draft, il: int) -> bool:
    """llama.cpp's recurrent filter; recurrent memory only ever spans the trunk (il < n_layer)."""
    if family.memory == "kv" or il >= d.n_layer:
        return False
    if family.memory == "recurrent" or family.attn_filter == "all":
        return True
    if family.attn_filter == "nemotron":
        return d.is_recr[il] and d.n_ff[il] == 0
    return d.is_recr[il]


def _has_attention(family: _Family, d: _Draft, il: int) -> bool:
    """llama.cpp's attention filter for the target context (`create_memory`), layer by layer.

    nextn blocks are kept out of a dense model's target context (when it has a trunk) and out of the qwen
    hybrids'; the other hybrids' filters do not look at the layer index, and llama.cpp applies them as is.
    """
    if family.memory == "recurrent":
        return False
    if family.memory == "kv":
        return not (d.n_nextn > 0 and d.n_layer > 0 and il >= d.n_layer)
    if family.attn_filter == "all":
        return True
    if family.attn_filter == "nemotron":
        return not d.is_recr[il] and d.n_ff[il] == 0
    if family.attn_filter == "trunk_not_recr":
        return il < d.n_layer and not d.is_recr[il]
    return not d.is_recr[il]


def _router_layers(header: GGUFHeader, n_layer_all: int) -> frozenset[int]:
    """The blocks with an expert router tensor (`blk.N.ffn_gate_inp.weight`)."""
    out: set[int] = set()
    for t in header.tensors:
        m = _ROUTER_TENSOR.match(t.name)
        if m and int(m.group(1)) < n_layer_all:
            out.add(int(m.group(1)))
    return frozenset(out)


def _layer_tensor_bytes(header: GGUFHeader, n_layer_all: int) -> list[int]:
    out = [0] * n_layer_all
    for index, n_bytes in header.layer_tensor_bytes.items():
        if index >= n_layer_all:
            raise GeometryError(f"tensor block blk.{index} is beyond block_count ({n_layer_all})")
        out[index] = n_bytes
    return out


#: The alignment of an allocated CPU buffer (`TENSOR_ALIGNMENT`): where weights are copied into a buffer rather
#: than mapped (an RPC server's device), each tensor takes its bytes rounded up to it.
BUFFER_ALIGNMENT = 32


def _padded(n_bytes: int) -> int:
    return -(-n_bytes // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT


def _layer_padded_bytes(header: GGUFHeader, n_layer_all: int) -> list[int]:
    """Per block, the sum of its tensors' bytes each rounded up to `BUFFER_ALIGNMENT`."""
    out = [0] * n_layer_all
    for t in header.tensors:
        m = _LAYER_TENSOR.match(t.name)
        if m is not None and int(m.group(1)) < n_layer_all:  # beyond block_count: refused by _layer_tensor_bytes
            out[int(m.group(1))] += _padded(t.n_bytes)
    return out


def _global_padded_bytes(header: GGUFHeader) -> tuple[int, int]:
    """(output tensors, token_embd) with each tensor's bytes rounded up to `BUFFER_ALIGNMENT`."""
    output = token_embd = 0
    for t in header.tensors:
        if _LAYER_TENSOR.match(t.name):
            continue
        if _INPUT_TENSOR.match(t.name):
            if t.name == "token_embd.weight":
                token_embd = _padded(t.n_bytes)
        else:
            output += _padded(t.n_bytes)
    return output, token_embd


#: llama.cpp's pooling types as a header stores them (`llama_pooling_type`), and the value meaning none given.
_POOLING_TYPES: dict[int, HeaderPooling] = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
_NO_POOLING = -1
#: The classification head rank pooling applies (`build_pooling`: `cls` then `cls.output`, either optional).
_CLASSIFIER_TENSORS = ("cls.weight", "cls.output.weight")


def _global_tensor_bytes(header: GGUFHeader) -> tuple[int, int, int, bool]:
    """(input bytes, output bytes, token_embd bytes, has a separate output matrix)."""
    input_bytes = output_bytes = token_embd = 0
    has_output = False
    for t in header.tensors:
        if _LAYER_TENSOR.match(t.name):
            continue
        if _INPUT_TENSOR.match(t.name):
            input_bytes += t.n_bytes
            if t.name == "token_embd.weight":
                token_embd = t.n_bytes
        else:
            output_bytes += t.n_bytes
            if t.name == "output.weight":
                has_output = True
    return input_bytes, output_bytes, token_embd, has_output
