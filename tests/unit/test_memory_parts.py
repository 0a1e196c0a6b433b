"""The memory model's layout-free parts are computed once per model and settings and shared by every layout
(`memory._model_parts`): the estimate must answer exactly as it does computed afresh, whatever the order of
the layouts asked, and must refuse every time what it refuses."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.placement import memory
from actors.placement.memory import MemoryModelError, estimate
from messages.memory import MemoryBreakdown
from tests.harness.memory_model import gemma3, llama, qwen35_9b, serving

MODELS = {"llama": llama(), "gemma3": gemma3(), "qwen35": qwen35_9b()}

layouts = st.lists(
    st.tuples(
        st.sampled_from(sorted(MODELS)),
        st.sampled_from([1, 4]),  # slots
        st.sampled_from([2048, 8192]),
        st.integers(-1, 40),  # -ngl
        st.lists(st.floats(0.05, 8.0, allow_nan=False), min_size=0, max_size=3),  # GPU weights
        st.sampled_from([None, ("AVX2",), ("AMX_INT8", "AVX512_VNNI", "AVX2")]),
    ),
    min_size=1,
    max_size=12,
)


Features = tuple[str, ...] | None
Ask = tuple[str, int, int, int, list[float], Features]


def _ask(
    name: str, slots: int, n_ctx: int, ngl: int, split: list[float], cpu: tuple[str, ...] | None
) -> MemoryBreakdown:
    return estimate(
        MODELS[name], serving(slots=slots), n_ctx, n_gpu_layers=ngl if split else -1, gpu_split=tuple(split),
        cpu_features=cpu,
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_shared_parts_answer_as_parts_computed_afresh(asks: list[Ask]) -> None:
    shared = [_ask(*ask) for ask in asks]  # in this order, through the cache
    fresh = []
    for ask in asks:
        memory._model_parts.cache_clear()
        fresh.append(_ask(*ask))
    assert [msgspec.json.encode(b) for b in shared] == [msgspec.json.encode(b) for b in fresh]


def test_a_refusal_is_raised_on_every_ask_not_remembered() -> None:
    bad = serving(slots=1, cache_type_v="q4_0", flash_attn="off")  # llama-server: a quantized V needs FA
    for _ in range(3):
        with pytest.raises(MemoryModelError):
            estimate(MODELS["llama"], bad, 4096)
