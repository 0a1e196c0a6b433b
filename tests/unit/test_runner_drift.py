"""Settings drift: before start against the node, after start against what the server reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from actors.runner.allocation_log import parse_allocation_log
from actors.runner.drift import ServerReport, server_drift, settings_drift, speculative_types
from messages.memory import ContextShape
from messages.placement import Stamp
from messages.runner import FieldDrift
from messages.settings import ServingSettings, SettingsBounds

DATA = Path(__file__).parent.parent / "data"
# The captured server: -c 4096 -np 2 (2 streams), draft-mtp with n_max 3, flash attention left on auto.
LOG = parse_allocation_log((DATA / "llama_server_qwen35_mtp.log").read_text())
SETTINGS = ServingSettings(slots=2, spec_type="draft-mtp", spec_draft_n_max=3, flash_attn="on")
SHAPE = ContextShape(n_ctx=4096, n_ctx_seq=2048, n_seq_max=2, n_stream=2, n_rs_seq=3, n_ubatch=512, swa_cells=0)


def _stamp(settings: ServingSettings = SETTINGS, version: str | None = None) -> Stamp:
    return Stamp(settings=settings, ctx=4096, n_gpu_layers=0, llama_server_version=version)


def _props(slots: int = 2, n_ctx: int = 2048) -> dict[str, Any]:
    # as this build answers: speculative.types is a request default, always "none"
    return {
        "total_slots": slots,
        "default_generation_settings": {"n_ctx": n_ctx, "params": {"speculative.types": "none"}},
        "build_info": "b0-unknown",
    }


def _slots(n: int = 2, n_ctx: int = 2048, speculative: bool = True) -> list[dict[str, Any]]:
    return [{"id": i, "n_ctx": n_ctx, "speculative": speculative, "is_processing": False} for i in range(n)]


def _fields(drift: tuple[FieldDrift, ...]) -> dict[str, tuple[str, str]]:
    return {d.field: (d.stamped, d.current) for d in drift}


# --- before start ------------------------------------------------------------------------------------------


def test_unchanged_settings_and_engine_are_no_drift() -> None:
    assert settings_drift(_stamp(version="v1"), SETTINGS, engine_version="v1") == ()


def test_each_changed_setting_is_named_with_stamped_and_current_values() -> None:
    current = msgspec.structs.replace(SETTINGS, slots=4, kv_unified=True, cache_type_v="q8_0")
    assert _fields(settings_drift(_stamp(), current)) == {
        "slots": ("2", "4"),
        "kv_unified": ("false", "true"),
        "cache_type_v": ("f16", "q8_0"),
    }


@given(
    st.sampled_from(sorted(ServingSettings.__struct_fields__)),
    st.data(),
)
def test_any_single_changed_field_is_reported_alone(name: str, data: st.DataObject) -> None:
    value = getattr(SETTINGS, name)
    if isinstance(value, bool):
        changed: object = not value
    elif isinstance(value, int):
        changed = data.draw(st.integers(min_value=1, max_value=64).filter(lambda v: v != value))
    elif name == "flash_attn":
        changed = "off"
    elif name == "spec_type":
        changed = "ngram-mod"
    else:
        changed = data.draw(st.sampled_from(["f32", "bf16", "q8_0", "q4_0"]).filter(lambda v: v != value))
    current = msgspec.structs.replace(SETTINGS, **{name: changed})
    (drift,) = settings_drift(_stamp(), current)
    assert drift.field == name and drift.current != drift.stamped


def test_a_models_own_settings_are_drift_only_outside_the_nodes_current_bounds() -> None:
    own = msgspec.structs.replace(SETTINGS, slots=6, cache_type_k="q8_0", cache_type_v="q8_0")
    stamp = Stamp(settings=own, ctx=4096, n_gpu_layers=0)
    assert settings_drift(stamp, SETTINGS, bounds=SettingsBounds()) == ()  # the node's defaults differ: fine
    tightened = SettingsBounds(max_slots=4, cache_types=("f16",))
    assert _fields(settings_drift(stamp, SETTINGS, bounds=tightened)) == {
        "slots": ("6", "outside the node's bounds"),
        "cache_type_k": ("q8_0", "outside the node's bounds"),
        "cache_type_v": ("q8_0", "outside the node's bounds"),
    }
    # the node's own settings (batch sizes, host-RAM extras, threads) must still be what it runs
    rebatched = msgspec.structs.replace(SETTINGS, ubatch=256)
    assert _fields(settings_drift(stamp, rebatched, bounds=SettingsBounds())) == {"ubatch": ("512", "256")}


def test_a_node_without_advertised_settings_is_drift() -> None:
    assert _fields(settings_drift(_stamp(), None)) == {"settings": ("advertised", "not advertised")}


def test_a_replaced_engine_build_is_drift() -> None:
    drift = settings_drift(_stamp(version="11434 (abc)"), SETTINGS, engine_version="11500 (def)")
    assert _fields(drift) == {"llama_server_version": ("11434 (abc)", "11500 (def)")}
    assert _fields(settings_drift(_stamp(version="v1"), SETTINGS, engine_version=None)) == {
        "llama_server_version": ("v1", "(missing)")
    }


def test_a_stamp_without_an_engine_build_does_not_check_it() -> None:
    assert settings_drift(_stamp(version=None), SETTINGS, engine_version="anything") == ()


# --- after start -------------------------------------------------------------------------------------------


def test_server_running_as_stamped_is_no_drift_except_the_flash_attention_it_logged() -> None:
    """The captured log was made with flash attention on auto; the runner always pins on/off, so a server
    that says "auto" did not get the stamped flag."""
    drift = server_drift(_stamp(), SHAPE, ServerReport(_props(), _slots(), LOG))
    assert _fields(drift) == {"log.flash_attn": ("on", "auto")}


def test_fewer_slots_and_a_different_context_are_named_by_source() -> None:
    report = ServerReport(_props(slots=1, n_ctx=4096), _slots(n=1, n_ctx=4096), LOG)
    fields = _fields(server_drift(_stamp(), SHAPE, report))
    assert fields["props.total_slots"] == ("2", "1")
    assert fields["props.n_ctx_per_slot"] == ("2048", "4096")
    assert fields["slots.count"] == ("2", "1")
    assert fields["slots.n_ctx"] == ("2048", "4096")


def test_slots_that_cannot_speculate_are_drift_when_speculation_was_stamped() -> None:
    fields = _fields(server_drift(_stamp(), SHAPE, ServerReport(_props(), _slots(speculative=False), LOG)))
    assert fields["slots.speculative"] == ("true", "false")


def test_speculation_type_and_draft_length_come_from_the_log() -> None:
    stamped = msgspec.structs.replace(SETTINGS, spec_draft_n_max=5)
    shape = msgspec.structs.replace(SHAPE, n_rs_seq=5)
    assert _fields(server_drift(_stamp(stamped), shape, ServerReport(_props(), _slots(), LOG)))[
        "log.spec_draft_n_max"
    ] == ("5", "3")
    none = msgspec.structs.replace(SETTINGS, spec_type="none")
    fields = _fields(server_drift(_stamp(none), msgspec.structs.replace(SHAPE, n_rs_seq=0), _report()))
    assert fields["log.spec_type"] == ("none", "draft-mtp")
    assert fields["log.draft_context"] == ("false", "true")
    assert fields["log.n_rs_seq"] == ("0", "3")
    assert fields["slots.speculative"] == ("false", "true")


def _report() -> ServerReport:
    return ServerReport(_props(), _slots(), LOG)


def test_cache_types_unified_kv_and_streams_are_checked_against_the_log() -> None:
    stamped = msgspec.structs.replace(SETTINGS, cache_type_k="q8_0", kv_unified=True, spec_draft_type_v="q4_0")
    fields = _fields(server_drift(_stamp(stamped), SHAPE, _report()))
    assert fields["log.cache_type_k"] == ("q8_0", "f16")
    assert fields["log.kv_unified"] == ("true", "false")
    assert fields["log.spec_draft_type_v"] == ("q4_0", "f16")


def test_a_log_without_allocation_lines_is_drift_not_a_pass() -> None:
    empty = parse_allocation_log("")
    fields = _fields(server_drift(_stamp(), SHAPE, ServerReport(_props(), _slots(), empty)))
    assert fields["log.context"] == ("logged", "not logged")


@given(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3)))
def test_unexpected_json_shapes_are_drift_never_an_exception(junk: object) -> None:
    drift = server_drift(_stamp(), SHAPE, ServerReport(junk, junk, LOG))
    names = {d.field for d in drift}
    assert "props.total_slots" in names


def test_a_boolean_is_not_mistaken_for_a_slot_count() -> None:
    stamped = msgspec.structs.replace(SETTINGS, slots=1)
    shape = msgspec.structs.replace(SHAPE, n_seq_max=1)
    fields = _fields(server_drift(_stamp(stamped), shape, ServerReport({"total_slots": True}, [], LOG)))
    assert fields["props.total_slots"] == ("1", "true")


def test_speculative_types_drop_none_and_blanks() -> None:
    assert speculative_types(ServingSettings(spec_type="none")) == ()
    assert speculative_types(ServingSettings(spec_type=" draft-mtp, ngram-mod ,")) == ("draft-mtp", "ngram-mod")
