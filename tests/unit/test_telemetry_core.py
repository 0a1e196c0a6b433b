from dataclasses import replace

import msgspec

from actors.telemetry.resources import (
    GpuReading,
    HostReading,
    NodeFacts,
    NvmlReading,
    build_report,
    material_change,
    usable_moved,
)
from messages.settings import ServingSettings
from messages.telemetry import LlamaServerInfo, ModelFiles

ENGINE = LlamaServerInfo(path="llama-server", version="1 (abc)", build_info="test")
FACTS = NodeFacts(
    node_id="n1",
    started_at=100.0,
    ttl_s=15.0,
    memory_limit_bytes=8 << 30,
    llama_server=ENGINE,
    llama_server_error=None,
    settings=ServingSettings(slots=2),
)
HOST = HostReading(ram_total_bytes=32 << 30, ram_available_bytes=20 << 30, cpu_count=8)
GPU = GpuReading(index=0, name="H200", uuid="GPU-1", total_bytes=140 << 30, free_bytes=4 << 30, used_bytes=136 << 30)


def test_memory_limit_caps_what_each_device_advertises_as_usable() -> None:
    report = build_report(FACTS, seq=1, now=101.0, host=HOST, nvml=NvmlReading(driver="570", gpus=(GPU,)))
    assert report.host.usable_bytes == 8 << 30
    assert report.host.ram_available_bytes == 20 << 30
    assert report.gpus[0].usable_bytes == 4 << 30  # free is below the limit
    assert report.settings == ServingSettings(slots=2)


def test_no_nvml_is_a_normal_report_with_a_reason() -> None:
    report = build_report(FACTS, seq=1, now=101.0, host=HOST, nvml=NvmlReading(driver=None, error="no driver"))
    assert report.gpus == ()
    assert report.nvml is None
    assert report.nvml_error == "no driver"


def test_node_without_llama_server_advertises_no_settings() -> None:
    facts = replace(FACTS, llama_server=None, llama_server_error="not installed")
    report = build_report(facts, seq=1, now=101.0, host=HOST, nvml=NvmlReading(driver=None))
    assert report.settings is None
    assert report.llama_server_error == "not installed"


def test_material_changes_are_named_and_memory_wobble_is_not_one() -> None:
    nvml = NvmlReading(driver="570", gpus=(GPU,))
    first = build_report(FACTS, seq=1, now=101.0, host=HOST, nvml=nvml)
    assert material_change(None, first) == "first report"
    wobble = build_report(FACTS, seq=2, now=102.0, host=replace(HOST, ram_available_bytes=19 << 30), nvml=nvml)
    assert material_change(first, wobble) is None
    resettled = build_report(replace(FACTS, settings=ServingSettings(slots=4)), seq=3, now=103.0, host=HOST, nvml=nvml)
    assert material_change(first, resettled) == "serving settings changed"
    no_gpu = build_report(FACTS, seq=4, now=104.0, host=HOST, nvml=NvmlReading(driver="570"))
    assert material_change(first, no_gpu) == "devices changed"
    pulled = msgspec.structs.replace(wobble, model_files=ModelFiles(held=(("m.gguf", 9, ""),)))
    assert material_change(first, pulled) == "model files changed"
    faster = msgspec.structs.replace(pulled, model_files=ModelFiles(held=(("m.gguf", 9, ""),), pull_bytes_per_s=5.0))
    assert material_change(pulled, faster) is None  # a rate is no reason to journal the node
    assert material_change(first, msgspec.structs.replace(wobble, model_files=ModelFiles())) is None


def test_large_usable_moves_are_reported_early() -> None:
    nvml = NvmlReading(driver="570", gpus=(GPU,))
    first = build_report(replace(FACTS, memory_limit_bytes=None), seq=1, now=101.0, host=HOST, nvml=nvml)
    small = build_report(
        replace(FACTS, memory_limit_bytes=None),
        seq=2,
        now=102.0,
        host=replace(HOST, ram_available_bytes=(20 << 30) - (100 << 20)),
        nvml=nvml,
    )
    big = build_report(
        replace(FACTS, memory_limit_bytes=None),
        seq=3,
        now=103.0,
        host=HOST,
        nvml=NvmlReading(driver="570", gpus=(replace(GPU, free_bytes=1 << 30),)),
    )
    assert not usable_moved(first, small)
    assert usable_moved(first, big)


def test_cpu_features_are_the_llama_cpp_names_of_the_kernel_flags() -> None:
    from actors.telemetry.resources import ggml_cpu_features

    x86 = frozenset({"fpu", "sse2", "pni", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "aes"})
    assert ggml_cpu_features(x86) == ("AVX", "AVX2", "AVX512", "AVX512_VNNI", "FMA", "SSE3")
    arm = frozenset({"fp", "asimd", "asimddp", "i8mm", "sve"})
    assert ggml_cpu_features(arm) == ("DOTPROD", "MATMUL_INT8", "NEON", "SVE")
    assert ggml_cpu_features(None) is None


def test_report_advertises_the_cpu_features_and_a_change_is_material() -> None:
    host = replace(HOST, cpu_flags=frozenset({"avx2", "avx512f"}))
    first = build_report(FACTS, seq=1, now=101.0, host=host, nvml=NvmlReading(driver=None, error="none"))
    assert first.host.cpu_features == ("AVX2", "AVX512")
    other = build_report(FACTS, seq=2, now=102.0, host=HOST, nvml=NvmlReading(driver=None, error="none"))
    assert other.host.cpu_features is None
    assert material_change(first, other) == "cpu features changed"
