"""Parsing llama-server's allocation lines, on captured real logs and on malformed input."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.runner.allocation_log import parse_allocation_log, printed_mib, printed_mib_f32, remote_devices

DATA = Path(__file__).parent.parent / "data"


def test_qwen35_mtp_log_yields_target_and_draft_contexts() -> None:
    log = parse_allocation_log((DATA / "llama_server_qwen35_mtp.log").read_text())
    assert log.model_buffers == {"CPU_Mapped": Decimal("1.08")}
    assert log.build_info == "build 0 (unknown) with GNU 12.2.0 for Linux x86_64"
    target, draft = log.contexts
    assert (target.n_ctx, target.n_ctx_seq, target.n_seq_max, target.n_rs_seq, target.kv_unified) == (
        4096,
        2048,
        2,
        3,
        False,
    )
    (kv,) = target.kv
    assert (kv.cells, kv.layers, kv.seqs, kv.streams, kv.k_type, kv.k_mib) == (2048, 1, 2, 2, "f16", Decimal("0.50"))
    assert kv.swa is None and kv.buffers == (("CPU", Decimal("1.00")),)
    (rs,) = target.recurrent
    assert (rs.cells, rs.layers, rs.seqs, rs.rs_seq) == (2, 4, 2, 3)
    assert (rs.r_mib, rs.s_mib) == (Decimal("0.04"), Decimal("0.09"))
    assert target.compute_buffers == {"CPU": Decimal("3.65")}
    assert draft.n_rs_seq == 0 and len(draft.kv) == 1 and not draft.recurrent
    # the draft context reserves its graph twice; the buffer is the larger of the two
    assert draft.compute_buffers == {"CPU": Decimal("3.27")}
    assert log.target is target and log.draft is draft


def test_interleaved_swa_caches_are_labelled_base_and_swa() -> None:
    log = parse_allocation_log((DATA / "llama_server_gemma3_swa.log").read_text())
    assert log.target is not None
    base, swa = log.target.kv
    assert (base.swa, base.cells, base.layers) == (False, 2048, 2)
    assert (swa.swa, swa.cells, swa.layers) == (True, 768, 4)
    assert log.draft is None


def test_jsonl_log_parses_like_text_and_carries_the_breakdown_record() -> None:
    text_log = parse_allocation_log((DATA / "llama_server_qwen35_mtp.log").read_text())
    json_log = parse_allocation_log((DATA / "llama_server_qwen35_mtp.jsonl").read_text())
    assert json_log.contexts == text_log.contexts
    assert json_log.breakdown is not None
    (host,) = json_log.breakdown
    assert (host.kind, host.self_mib, host.model_mib, host.context_mib, host.compute_mib) == ("host", 5, 1, 1, 3)


def test_ansi_colours_and_missing_time_prefixes_are_tolerated() -> None:
    text = (
        "\x1b[34m0.00.005.888\x1b[0m \x1b[32mI \x1b[0mload_tensors:   CPU_Mapped model buffer size =     0.69 MiB\n"
        "llama_context: n_ctx                 = 4096\n"
        "garbage line with size = 12 MiB\n"
    )
    log = parse_allocation_log(text)
    assert log.model_buffers == {"CPU_Mapped": Decimal("0.69")}
    assert log.target is not None and log.target.n_ctx == 4096


def test_unused_tensor_warnings_are_collected() -> None:
    log = parse_allocation_log("W model has unused tensor blk.4.nextn.eh_proj.weight (size = 32768 bytes) -- ignoring")
    assert log.unused_tensors == ["blk.4.nextn.eh_proj.weight"]


def test_speculative_implementations_and_their_draft_length_are_collected() -> None:
    log = parse_allocation_log((DATA / "llama_server_qwen35_mtp.log").read_text())
    assert [(i.type, i.n_max) for i in log.speculative] == [("draft-mtp", 3)]
    text = (
        "0.00.023.857 I spec common_specu: adding speculative implementation 'ngram-mod'\n"
        "0.00.023.858 I spec common_specu: - size_n=12\n"
        "common_speculative_dflash: adding speculative implementation 'draft-dflash'\n"
        "common_speculative_dflash: - n_max=16, n_min=0, p_min=0.00\n"
        "common_speculative_dflash: - n_max=99 (a second length line belongs to nobody)\n"
    )
    log = parse_allocation_log(text)
    assert [(i.type, i.n_max) for i in log.speculative] == [("ngram-mod", None), ("draft-dflash", 16)]


def test_a_server_without_speculation_reports_no_implementation() -> None:
    text = "0.00.188.476 I spec common_specu: no implementations specified for speculative decoding"
    assert parse_allocation_log(text).speculative == []


def test_malformed_json_record_is_ignored() -> None:
    bad = json.dumps({"type": "fit_memory_breakdown", "data": {"rows": [{"self": "many"}, 7]}})
    log = parse_allocation_log(bad + "\n{not json\n")
    assert log.breakdown == []


def test_printed_mib_reproduces_llama_cpp_rounding() -> None:
    assert printed_mib(1 << 20) == Decimal("1.00")
    assert printed_mib(5243) == Decimal("0.01")  # 0.005000… rounds up
    assert printed_mib(5242) == Decimal("0.00")
    # float32: above 2^24 bytes the conversion itself rounds (here to a multiple of 2)
    assert printed_mib_f32(16_777_217) == printed_mib_f32(16_777_216) == Decimal("16.00")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=400))
def test_arbitrary_text_never_raises(text: str) -> None:
    parse_allocation_log(text)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "llama_kv_cache: size =    1.00 MiB (  2048 cells,   1 layers,  2/2 seqs), K (f16):    0.50 MiB, V (",
                "llama_context: n_ctx                 = ",
                "llama_memory_recurrent: size = 0.13 MiB (2 cells, 4 layers, 2 seqs 3 rs_seq), R (f32): 0.04 MiB",
                '{"type":"log","msg":',
                '{"type":"fit_memory_breakdown","data":{"rows":[{"kind":"host","self":1e400}]}}',
                "sched_reserve:        CPU compute buffer size = ",
                "spec common_specu: adding speculative implementation '",
                "spec common_specu: - n_max=",
                "0.00.006.118 I ",
                "\x1b[0m",
                "\n",
            ]
        ),
        max_size=30,
    )
)
def test_truncated_and_spliced_allocation_lines_never_raise(parts: list[str]) -> None:
    parse_allocation_log("".join(parts))


def test_system_info_gives_the_cpu_backend_features() -> None:
    log = parse_allocation_log(
        "0.00.002.706 I cmn  common_param: system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 |"
        " AVX2 = 1 | AVX512 = 1 | SVE_CNT = 16 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | \n"
    )
    assert log.cpu_features == frozenset({"SSE3", "AVX2", "AVX512", "LLAMAFILE", "OPENMP", "REPACK"})
    assert parse_allocation_log("load_tensors: CPU_Mapped model buffer size = 1.00 MiB\n").cpu_features is None


def test_repack_model_buffer_is_read_beside_the_mapped_one() -> None:
    log = parse_allocation_log(
        "load_tensors:   CPU_Mapped model buffer size =     3.73 MiB\n"
        "load_tensors:   CPU_REPACK model buffer size =     1.88 MiB\n"
    )
    assert log.model_buffers == {"CPU_Mapped": Decimal("3.73"), "CPU_REPACK": Decimal("1.88")}


def test_a_split_log_gives_each_rpc_device_its_model_caches_and_compute() -> None:
    """gemma3 over two RPC members (-ngl 5 -ts 1,1): each member's buffers on their `RPC<d>[host:port]` lines, a
    sliding-window model's two caches apart (a member whose layers are all global holds no SWA cache)."""
    log = parse_allocation_log((DATA / "llama_server_gemma3_rpc_split.log").read_text())
    remote = remote_devices(log)
    assert set(remote) == {"RPC0[127.0.0.1:50052]", "RPC0[127.0.0.1:50053]"}
    first, second = remote["RPC0[127.0.0.1:50052]"], remote["RPC0[127.0.0.1:50053]"]
    assert (first.endpoint, first.device, first.model_mib) == ("127.0.0.1:50052", 0, Decimal("1.69"))
    assert first.cache_mib == [Decimal("4.00"), Decimal("1.50")] and first.caches_mib == Decimal("5.50")
    assert second.cache_mib == [Decimal("4.00")] and second.model_mib == Decimal("0.69")
    assert first.compute_mib == Decimal("6.27") and second.compute_mib is not None
    assert log.model_buffers["CPU_Mapped"] == Decimal("1.26")


@given(
    st.lists(st.sampled_from(["RPC0[", "RPC1[1.2.3.4:5]", "]", " model buffer size = ", "1.00 MiB", "x"]), max_size=12)
)
@settings(max_examples=200, deadline=None)
def test_remote_devices_never_raise_on_garbled_buffer_names(parts: list[str]) -> None:
    line = "load_tensors: " + "".join(parts)
    for remote in remote_devices(parse_allocation_log(line + "\nllama_kv_cache: " + "".join(parts))).values():
        assert remote.endpoint and remote.model_mib >= 0
