"""Geometry rules per architecture family: which layers get KV, recurrent state, a sliding window, MTP."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import msgspec
import nacl.signing
import nkeys
import pytest

from actors.placement.geometry import (
    SUPPORTED_ARCHITECTURES,
    GeometryError,
    UnsupportedArchitecture,
    geometry_from_header,
)
from actors.placement.gguf_header import read_header
from actors.placement.registry import verify
from messages.model import ModelGeometry
from messages.registry import RegistryEntry
from tests import tiny_models
from tests.harness.geometry import QWEN_SSM, base, header, router


def kinds(g: ModelGeometry) -> str:
    """One letter per layer: A attention, R recurrent, B both, - neither; lower case when SWA."""
    out = ""
    for layer in g.layers:
        c = "B" if layer.attention and layer.recurrent else "A" if layer.attention else "R" if layer.recurrent else "-"
        out += c.lower() if layer.swa else c
    return out


def test_qwen35_9b_shape_has_8_attention_24_recurrent_and_a_nextn_block_outside_the_target() -> None:
    kv = base(33, **QWEN_SSM, nextn_predict_layers=1, embedding_length=4096)
    kv.update({"attention.head_count": 16, "attention.head_count_kv": 4, "attention.key_length": 256})
    kv["attention.value_length"] = 256
    g = geometry_from_header(header("qwen35", kv))
    assert kinds(g) == "RRRA" * 8 + "-"
    assert g.layers[-1].nextn and g.mtp_context and g.rollback
    assert {layer.k_width for layer in g.layers} == {1024}
    recurrent = [layer for layer in g.layers if layer.recurrent]
    assert {(layer.r_width, layer.s_width) for layer in recurrent} == {(3 * (4096 + 2 * 16 * 128), 128 * 4096)}


def test_qwen_recurrent_layers_array_overrides_the_interval() -> None:
    flags = [True, False, False, True]
    g = geometry_from_header(header("qwen3next", base(4, **QWEN_SSM, **{"attention.recurrent_layers": flags})))
    assert kinds(g) == "RAAR"
    assert not g.rollback  # qwen3next has no partial rollback in this llama.cpp


def test_qwen_recurrent_layers_array_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(GeometryError, match="recurrent_layers"):
        geometry_from_header(header("qwen35", base(4, **QWEN_SSM, **{"attention.recurrent_layers": [True]})))


def test_granitehybrid_layer_is_recurrent_exactly_when_it_has_no_kv_heads() -> None:
    kv = base(4, **QWEN_SSM, **{"attention.head_count_kv": [0, 4, 0, 1]})
    g = geometry_from_header(header("granitehybrid", kv))
    assert kinds(g) == "RARA"
    assert [layer.k_width for layer in g.layers] == [0, 128, 0, 32]


def test_nemotron_h_layers_with_a_feed_forward_have_neither_kv_nor_state() -> None:
    kv = base(3, **QWEN_SSM, **{"attention.head_count_kv": [0, 2, 0], "feed_forward_length": [0, 0, 1024]})
    g = geometry_from_header(header("nemotron_h", kv))
    assert kinds(g) == "RA-"


def test_falcon_h1_layers_have_both_attention_and_recurrent_state() -> None:
    g = geometry_from_header(header("falcon-h1", base(3, **QWEN_SSM)))
    assert kinds(g) == "BBB"


def test_jamba_state_has_no_groups() -> None:
    kv = base(2, **{k: v for k, v in QWEN_SSM.items() if k != "ssm.group_count"})
    kv["attention.head_count_kv"] = [0, 2]
    g = geometry_from_header(header("jamba", kv))
    assert kinds(g) == "RA"
    assert g.layers[0].r_width == 3 * 4096


def test_gemma2_slides_every_other_layer_with_a_4096_window_by_default() -> None:
    g = geometry_from_header(header("gemma2", base(4)))
    assert kinds(g) == "aAaA"
    assert (g.swa_type, g.n_swa) == ("standard", 4096)


def test_gemma3_slides_five_layers_in_six_and_only_with_a_window() -> None:
    g = geometry_from_header(header("gemma3", base(7, **{"attention.sliding_window": 512})))
    assert kinds(g) == "aaaaaAa"
    assert kinds(geometry_from_header(header("gemma3", base(3)))) == "AAA"


def test_sliding_window_pattern_may_be_a_bool_array() -> None:
    kv = base(4, **{"attention.sliding_window": 128, "attention.sliding_window_pattern": [True, False, False, True]})
    assert kinds(geometry_from_header(header("gemma3", kv))) == "aAAa"


def test_swa_layers_use_the_swa_head_sizes() -> None:
    kv = base(2, **{"attention.sliding_window": 128, "attention.sliding_window_pattern": 2})
    kv.update({"attention.key_length": 128, "attention.key_length_swa": 64, "attention.value_length_swa": 32})
    g = geometry_from_header(header("gemma3", kv))
    assert [(layer.k_width, layer.v_width) for layer in g.layers] == [(128, 64), (256, 64)]


def test_cohere2_and_gpt_oss_need_a_window_size() -> None:
    assert kinds(geometry_from_header(header("cohere2", base(4, **{"attention.sliding_window": 64})))) == "aaaA"
    assert kinds(geometry_from_header(header("gpt-oss", base(2, **{"attention.sliding_window": 128})))) == "aA"
    with pytest.raises(GeometryError, match="sliding_window"):
        geometry_from_header(header("cohere2", base(4)))


def test_phi3_sliding_window_is_ignored_as_llama_cpp_does() -> None:
    g = geometry_from_header(header("phi3", base(2, **{"attention.sliding_window": 2048})))
    assert kinds(g) == "AA" and g.swa_type == "none"


def test_deepseek2_mla_caches_keys_only() -> None:
    kv = base(2, **{"attention.head_count_kv": 1, "attention.key_length": 576, "attention.value_length": 512})
    kv.update({"attention.key_length_mla": 192, "attention.value_length_mla": 128})
    g = geometry_from_header(header("deepseek2", kv))
    assert g.mla
    assert [(layer.k_width, layer.v_width) for layer in g.layers] == [(576, 0), (576, 0)]


def test_dense_nextn_blocks_stay_out_of_the_target_context() -> None:
    g = geometry_from_header(header("glm4moe", base(3, nextn_predict_layers=1)))
    assert kinds(g) == "AA-"
    assert g.mtp_context


def test_pure_recurrent_widths_for_mamba_and_rwkv() -> None:
    mamba = {k: v for k, v in QWEN_SSM.items() if k != "ssm.group_count"}
    g = geometry_from_header(header("mamba", base(2, **mamba)))
    assert kinds(g) == "RR"
    assert (g.layers[0].r_width, g.layers[0].s_width) == (3 * 4096, 128 * 4096)
    g = geometry_from_header(header("rwkv7", base(2, **{"wkv.head_size": 64})))
    assert (g.layers[0].r_width, g.layers[0].s_width) == (2 * 256, 256 * 64)


def test_lfm2_short_convolution_state_and_sliding_attention() -> None:
    kv = base(3, **{"shortconv.l_cache": 3, "attention.head_count_kv": [0, 2, 0], "attention.sliding_window": 512})
    g = geometry_from_header(header("lfm2", kv))
    assert kinds(g) == "RaR"
    assert (g.layers[0].r_width, g.layers[0].s_width) == (2 * 256, 0)


def test_unsupported_architecture_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedArchitecture, match="'bert'") as info:
        geometry_from_header(header("bert", base(2)))
    assert info.value.architecture == "bert"
    assert "bert" not in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({"block_count": 0}, "block_count"),
        ({"block_count": 600}, "block_count"),
        ({"nextn_predict_layers": 9}, "nextn_predict_layers"),
        ({"attention.head_count_kv": [2, 2]}, "wrong array length"),
        ({"attention.head_count": -1}, "unsigned"),
        ({"embedding_length": "wide"}, "unsigned"),
    ],
)
def test_inconsistent_metadata_is_refused_with_the_key(kv: dict[str, Any], message: str) -> None:
    with pytest.raises(GeometryError, match=message):
        geometry_from_header(header("llama", base(4, **kv)))


def test_a_missing_required_key_is_named() -> None:
    kv = base(4)
    del kv["embedding_length"]
    with pytest.raises(GeometryError, match=r"llama\.embedding_length is required"):
        geometry_from_header(header("llama", kv))


def test_tensor_bytes_per_layer_input_output_and_tied_embeddings(tmp_path: Path) -> None:
    path = tiny_models.write_llama(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_ff=128, n_vocab=300, tied=True)
    h = read_header(path)
    g = geometry_from_header(h)
    assert g.tied_output
    assert g.input_tensor_bytes == g.token_embd_bytes == 64 * 300 * 4
    assert g.output_tensor_bytes == 64 * 4  # output_norm only
    assert [layer.tensor_bytes for layer in g.layers] == [h.layer_tensor_bytes[0], h.layer_tensor_bytes[1]]
    assert g.input_tensor_bytes + g.output_tensor_bytes + sum(x.tensor_bytes for x in g.layers) == (
        h.total_tensor_bytes
    )
    assert g.n_vocab == 300


def test_every_tiny_model_writer_yields_the_geometry_it_describes(tmp_path: Path) -> None:
    assert kinds(geometry_from_header(read_header(tiny_models.write_qwen35(tmp_path / "q.gguf")))) == "RRRA-"
    gh = tiny_models.write_granitehybrid(tmp_path / "g.gguf", n_layer=4, attention_layers=(1, 3))
    assert kinds(geometry_from_header(read_header(gh))) == "RARA"
    assert kinds(geometry_from_header(read_header(tiny_models.write_mamba2(tmp_path / "m.gguf")))) == "RRRR"
    assert kinds(geometry_from_header(read_header(tiny_models.write_gemma3(tmp_path / "s.gguf")))) == "aaAaaA"


def test_every_other_family_writer_yields_the_geometry_it_describes(tmp_path: Path) -> None:
    """The writers behind `tests/e2e/test_memory_exact_more.py`, one per memory rule."""

    def of(writer: Any, **kw: Any) -> ModelGeometry:
        return geometry_from_header(read_header(writer(tmp_path / f"{writer.__name__}.gguf", **kw)))

    assert kinds(of(tiny_models.write_qwen2)) == kinds(of(tiny_models.write_qwen3)) == "AAAA"
    assert of(tiny_models.write_qwen3moe).n_expert == 8
    assert kinds(of(tiny_models.write_gemma2)) == kinds(of(tiny_models.write_gpt_oss)) == "aAaA"
    assert of(tiny_models.write_gemma2, n_swa=None).n_swa == 4096
    assert kinds(of(tiny_models.write_cohere2)) == "aaaA"
    assert kinds(of(tiny_models.write_nemotron_h, layers="M*M-M-")) == "RAR-R-"
    assert kinds(of(tiny_models.write_lfm2)) == "RRARRA"
    assert kinds(of(tiny_models.write_lfm2, n_swa=64)) == "RRaRRa"
    assert kinds(of(tiny_models.write_falcon_h1)) == "BBB"
    assert kinds(of(tiny_models.write_jamba)) == "RRAR"
    assert kinds(of(tiny_models.write_mamba)) == kinds(of(tiny_models.write_rwkv7)) == "RRR"
    ds = of(tiny_models.write_deepseek2, n_nextn=1)
    assert kinds(ds) == "AAA-" and ds.mla and ds.mtp_context
    assert kinds(of(tiny_models.write_qwen3next, n_nextn=1)) == "RRRA-"
    assert kinds(of(tiny_models.write_qwen35moe)) == "RRRA-"
    moe = of(tiny_models.write_nemotron_h_moe, layers="ME*ME", n_nextn=1)
    assert kinds(moe) == "R-AR--" and moe.mtp_context and moe.rollback
    assert kinds(of(tiny_models.write_plamo2)) == "RARA"
    assert kinds(of(tiny_models.write_phi3)) == "AAAA"
    glm = of(tiny_models.write_glm4moe, n_nextn=1)
    assert kinds(glm) == "AAA-" and glm.mtp_context and not glm.mla
    assert of(tiny_models.write_arwkv7, n_embd=128).layers[0].r_width == 128  # one token-shift row


def test_plamo2_head_size_comes_from_its_own_keys_when_layer_0_has_no_heads() -> None:
    """The generic rule takes head sizes from layer 0's head count (0 for PLaMo 2's leading Mamba block);
    plamo2's own hparams then read key_length/value_length."""
    heads = {"attention.head_count": [0, 8, 0, 8], "attention.head_count_kv": [0, 2, 0, 2]}
    kv = base(4, **QWEN_SSM, **heads, **{"attention.key_length": 128, "attention.value_length": 96})
    g = geometry_from_header(header("plamo2", kv))
    assert kinds(g) == "RARA"
    assert [(layer.k_width, layer.v_width) for layer in g.layers if layer.attention] == [(256, 192), (256, 192)]
    # without the keys there is no head size at all, which llama.cpp cannot use either
    kv = base(4, **QWEN_SSM, **heads)
    with pytest.raises(GeometryError, match="empty K row"):
        geometry_from_header(header("plamo2", kv))


# --- routed experts and head sizes ---------------------------------------------------------------------------


def routed(g: ModelGeometry) -> list[tuple[int, int]]:
    """(expert width, experts used) per layer; (0, 0) for a dense FFN."""
    return [(layer.n_ff_exp, layer.n_expert_used) for layer in g.layers]


MOE = {"expert_count": 128, "expert_used_count": 8}
LFM2 = {"shortconv.l_cache": 3}


def test_dense_models_have_no_routed_layers() -> None:
    assert routed(geometry_from_header(header("llama", base(2)))) == [(0, 0), (0, 0)]
    assert routed(geometry_from_header(header("qwen3moe", base(2)))) == [(0, 0), (0, 0)]  # no experts declared


def test_qwen3moe_experts_are_expert_feed_forward_length_wide_else_n_ff_over_experts_used() -> None:
    kv = base(2, **MOE, expert_feed_forward_length=768)
    assert routed(geometry_from_header(header("qwen3moe", kv))) == [(768, 8), (768, 8)]
    # without the key llama.cpp divides the dense length among the experts used (512 / 8)
    assert routed(geometry_from_header(header("qwen3moe", base(2, **MOE)))) == [(64, 8), (64, 8)]


def test_mixtral_style_experts_are_feed_forward_length_wide() -> None:
    g = geometry_from_header(header("llama", base(2, expert_count=8, expert_used_count=2)))
    assert routed(g) == [(512, 2), (512, 2)]


def test_deepseek2_and_glm4moe_route_after_their_dense_leading_blocks_nextn_included() -> None:
    kv = base(4, **MOE, expert_feed_forward_length=96, leading_dense_block_count=1, nextn_predict_layers=1)
    for arch in ("deepseek2", "glm4moe"):
        g = geometry_from_header(header(arch, kv))
        assert routed(g) == [(0, 0), (96, 8), (96, 8), (96, 8)]
        assert g.layers[0].n_ff == 512  # the dense block keeps feed_forward_length


def test_lfm2moe_routes_after_its_dense_leading_blocks() -> None:
    kv = base(4, **MOE, expert_feed_forward_length=1792, leading_dense_block_count=2)
    kv.update({"shortconv.l_cache": 3, "attention.head_count_kv": [0, 2, 0, 2]})
    g = geometry_from_header(header("lfm2moe", kv))
    assert kinds(g) == "RARA"
    assert routed(g) == [(0, 0), (0, 0), (1792, 8), (1792, 8)]


def test_expert_width_required_where_llama_cpp_requires_it() -> None:
    for arch, extra in (("deepseek2", {}), ("gpt-oss", {"attention.sliding_window": 128}), ("lfm2moe", LFM2)):
        with pytest.raises(GeometryError, match=rf"{arch}\.expert_feed_forward_length is required"):
            geometry_from_header(header(arch, base(2, **MOE, **extra)))


def test_nemotron_h_moe_routes_its_ffn_blocks_each_with_its_own_width_and_experts_used() -> None:
    """Puzzle-style per-layer arrays: Mamba, MoE, attention, MoE, then one nextn block."""
    kv = base(5, **QWEN_SSM, expert_count=16, nextn_predict_layers=1)
    kv.update({"attention.head_count_kv": [0, 0, 2, 0, 2], "feed_forward_length": [0, 1024, 0, 2048, 1024]})
    kv.update({"expert_used_count": [0, 4, 0, 6, 2], "expert_feed_forward_length": [0, 256, 0, 0, 128]})
    g = geometry_from_header(header("nemotron_h_moe", kv))
    assert kinds(g) == "R-A--"
    # block 3 has no width of its own: its length over its experts used (2048 / 6); block 4 is nextn
    assert routed(g) == [(0, 0), (256, 4), (0, 0), (341, 6), (128, 2)]


def test_jamba_routes_the_blocks_that_have_a_router_with_n_ff_wide_experts() -> None:
    kv = base(4, expert_count=16, expert_used_count=2, **{"attention.head_count_kv": [0, 0, 2, 0]})
    kv.update({k: v for k, v in QWEN_SSM.items() if k != "ssm.group_count"})
    g = geometry_from_header(header("jamba", kv, (router(1), router(3))))
    assert routed(g) == [(0, 0), (512, 2), (0, 0), (512, 2)]


def test_every_moe_writer_yields_its_expert_widths(tmp_path: Path) -> None:
    def of(writer: Any, **kw: Any) -> ModelGeometry:
        return geometry_from_header(read_header(writer(tmp_path / f"{writer.__name__}.gguf", **kw)))

    assert set(routed(of(tiny_models.write_qwen3moe, n_ff_exp=48, n_expert_used=4))) == {(48, 4)}
    assert set(routed(of(tiny_models.write_gpt_oss, n_ff_exp=64, n_expert_used=2))) == {(64, 2)}
    assert set(routed(of(tiny_models.write_qwen35moe, n_ff_exp=32, n_expert_used=2))) == {(32, 2)}
    assert set(routed(of(tiny_models.write_qwen3next, n_ff_exp=32, n_expert_used=2, n_nextn=1))) == {(32, 2)}
    assert routed(of(tiny_models.write_deepseek2, n_ff_exp=32, n_expert_used=2)) == [(0, 0), (32, 2), (32, 2)]
    assert routed(of(tiny_models.write_glm4moe, n_ff_exp=32, n_expert_used=2)) == [(0, 0)] + [(32, 2)] * 3
    assert routed(of(tiny_models.write_jamba, n_ff=128, n_expert_used=2)) == [(0, 0), (128, 2), (0, 0), (128, 2)]
    moe = of(tiny_models.write_nemotron_h_moe, layers="ME*ME", n_ff_exp=64, n_expert_used=2)
    assert routed(moe) == [(0, 0), (64, 2), (0, 0), (0, 0), (64, 2), (64, 2)]


def test_head_sizes_per_layer_include_the_mla_v_head_that_caches_nothing() -> None:
    kv = base(2, **{"attention.head_count_kv": 1, "attention.key_length": 576, "attention.value_length": 512})
    kv.update({"attention.key_length_mla": 192, "attention.value_length_mla": 128})
    g = geometry_from_header(header("deepseek2", kv))
    assert [(layer.head_k, layer.head_v, layer.v_width) for layer in g.layers] == [(576, 512, 0)] * 2
    kv = base(2, **{"attention.sliding_window": 128, "attention.sliding_window_pattern": 2})
    kv.update({"attention.key_length": 128, "attention.key_length_swa": 64, "attention.value_length_swa": 32})
    g = geometry_from_header(header("gemma3", kv))
    assert [(layer.head_k, layer.head_v) for layer in g.layers] == [(64, 32), (128, 32)]
    # a recurrent layer has no KV heads but llama.cpp still reports (and checks) the model's head size
    hybrid = geometry_from_header(header("granitehybrid", base(2, **QWEN_SSM, **{"attention.head_count_kv": [0, 2]})))
    assert [(layer.n_head_kv, layer.head_k) for layer in hybrid.layers] == [(0, 32), (2, 32)]


# --- geometries encoded before these fields existed ----------------------------------------------------------

NEW_LAYER_FIELDS = ("head_k", "head_v", "n_ff_exp", "n_expert_used")


def _as_encoded_before(g: ModelGeometry) -> dict[str, Any]:
    """The JSON object an encoder from before the expert and head-size fields wrote for `g`."""
    obj: dict[str, Any] = msgspec.to_builtins(g)
    for layer in obj["layers"]:
        for name in NEW_LAYER_FIELDS:
            del layer[name]
    return obj


def test_a_geometry_without_the_new_fields_decodes_to_unknown_and_encodes_back_to_the_same_bytes() -> None:
    g = geometry_from_header(header("qwen3moe", base(3, **MOE, expert_feed_forward_length=96)))
    old = msgspec.json.encode(_as_encoded_before(g))
    decoded = msgspec.json.decode(old, type=ModelGeometry)
    assert all(
        (layer.head_k, layer.head_v, layer.n_ff_exp, layer.n_expert_used) == (0, 0, 0, 0) for layer in decoded.layers
    )
    assert decoded == msgspec.structs.replace(
        g, layers=tuple(msgspec.structs.replace(layer, **dict.fromkeys(NEW_LAYER_FIELDS, 0)) for layer in g.layers)
    )
    assert msgspec.json.encode(decoded) == old  # defaults are omitted: nothing is added on re-encoding


def test_a_registry_entry_signed_before_the_new_fields_still_verifies() -> None:
    """Verification re-encodes the decoded entry; the omitted defaults keep those bytes the signed ones."""
    seed = nkeys.encode_seed(bytes(nacl.signing.SigningKey.generate()), nkeys.PREFIX_BYTE_ACCOUNT)
    key = nkeys.from_seed(seed)
    g = geometry_from_header(header("deepseek2", base(3, **MOE, expert_feed_forward_length=96)))
    unsigned = {
        "name": "old",
        "file_name": "old.gguf",
        "size_bytes": 1,
        "blake3": "00" * 32,
        "geometry": _as_encoded_before(g),
        "created_at": 0.0,
        "public_key": key.public_key.decode(),
        "signature": "",
    }
    signature = key.sign(msgspec.json.Encoder(order="sorted").encode(unsigned))
    signed = msgspec.json.encode({**unsigned, "signature": base64.b64encode(signature).decode()})
    entry = msgspec.json.decode(signed, type=RegistryEntry)
    verify(entry, [key.public_key.decode()])
    assert not any(layer.n_ff_exp for layer in entry.geometry.layers)
