"""`weights.layer_devices`: llama.cpp's float32 layer split computed with Python floats, checked against numpy's
float32 arithmetic (what `llama_model::load_tensors` computes: a float32 cumulative sum, each prefix divided by
the total, searched with `std::upper_bound` for each offloaded layer's fraction i / n)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from actors.placement.context import MemoryModelError
from actors.placement.weights import layer_devices
from messages.model import ModelGeometry
from tests.harness.memory_model import llama


def numpy_layer_devices(n_all: int, n_gpu_layers: int, gpu_split: list[float]) -> list[int] | None:
    """The oracle: the same split in numpy's float32 (None: no GPU takes a share, as in float32 weights that
    are all zero)."""
    if not gpu_split:
        return [-1] * (n_all + 1)
    ngl = n_gpu_layers if n_gpu_layers >= 0 else n_all + 1
    start = max(n_all + 1 - ngl, 0)
    act = min(ngl, n_all + 1)
    weights = np.asarray(gpu_split, dtype=np.float32)
    if float(weights.sum()) <= 0:
        return None
    if act == 0:
        return [-1] * (n_all + 1)
    cumulative = np.cumsum(weights, dtype=np.float32)
    splits = cumulative / np.float32(cumulative[-1])
    positions = np.arange(act, dtype=np.float32) / np.float32(act)
    offloaded = np.searchsorted(splits, positions, side="right").tolist()
    return [-1] * start + [int(d) for d in offloaded] + [-1] * (n_all + 1 - start - act)


_GEOMETRIES: dict[int, ModelGeometry] = {}


def geometry(n_layer: int) -> ModelGeometry:
    if n_layer not in _GEOMETRIES:
        _GEOMETRIES[n_layer] = llama(n_layer)
    return _GEOMETRIES[n_layer]


# Weights as they come: free bytes of GPUs (up to 80 GB, beyond float32's 24 bits of integer precision),
# fractions, and tiny or zero shares, so that prefixes round, tie and sit exactly on a layer's fraction.
WEIGHT = st.one_of(
    st.integers(min_value=0, max_value=80 * 10**9).map(float),
    st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
    st.floats(min_value=1e-30, max_value=1e-3),
    st.sampled_from([0.0, 0.1, 0.2, 0.3, 1 / 3, 0.5, 1.0]),
)


@settings(max_examples=1000, deadline=None)
@given(
    n_layer=st.integers(min_value=1, max_value=128),
    n_gpu_layers=st.one_of(st.just(-1), st.integers(min_value=0, max_value=140)),
    split=st.lists(WEIGHT, min_size=1, max_size=8),
)
@example(n_layer=32, n_gpu_layers=-1, split=[0.1, 0.2, 0.3, 0.4])  # prefixes that are not exact in float32
@example(n_layer=2, n_gpu_layers=-1, split=[1.0, 1.0, 1.0])  # a fraction equal to a prefix: upper bound
@example(n_layer=47, n_gpu_layers=20, split=[23.0e9, 0.0, 79.5e9])  # an empty GPU between two
@example(n_layer=1, n_gpu_layers=-1, split=[1e-145])  # zero in float32
def test_the_split_is_numpys_float32_split(n_layer: int, n_gpu_layers: int, split: list[float]) -> None:
    expected = numpy_layer_devices(n_layer, n_gpu_layers, split)
    if expected is None:  # weights too small for float32 (they round to 0): refused, as before
        with pytest.raises(MemoryModelError):
            layer_devices(geometry(n_layer), n_gpu_layers, split)
    else:
        assert layer_devices(geometry(n_layer), n_gpu_layers, split) == expected


def test_no_split_keeps_every_layer_on_the_host_and_a_bad_split_is_refused() -> None:
    assert layer_devices(geometry(4), -1, []) == [-1] * 5
    assert layer_devices(geometry(4), 0, [1.0, 1.0]) == [-1] * 5
    for bad in ([0.0, 0.0], [1.0, -0.5], [1e39], [1.0, float("nan")]):  # 1e39: no float32
        with pytest.raises(MemoryModelError):
            layer_devices(geometry(4), -1, bad)
