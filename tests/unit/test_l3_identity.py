"""Exact-state identity: every field counts, absent is not empty, fields cannot trade places, no node/slot."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.l3.identity import (
    _FIELDS,
    DraftSettings,
    Platform,
    StateInputs,
    canonical_encoding,
    exact_state_identity,
)
from actors.l3.layout import DigestError, is_digest

MODEL = "ab" * 32
OTHER_MODEL = "cd" * 32


def _inputs(**changes: object) -> StateInputs:
    base = StateInputs(
        model_digest=MODEL,
        llama_build="b11434-abcdef",
        cache_type_k="f16",
        cache_type_v="q8_0",
        flash_attention=True,
        unified_kv=False,
        swa_full=None,
        draft=DraftSettings(spec_type="draft-mtp", draft_depth=3, cache_type_k="f16", cache_type_v="f16"),
        payload_kind="llama_slot",
        platform=Platform(machine="x86_64", byte_order="little"),
    )
    return msgspec.structs.replace(base, **changes)


def _draft(**changes: object) -> DraftSettings:
    base = _inputs().draft
    assert base is not None
    return msgspec.structs.replace(base, **changes)


# One change per field (nested ones included); each must give a new identity.
CHANGES: dict[str, dict[str, object]] = {
    "model_digest": {"model_digest": OTHER_MODEL},
    "llama_build": {"llama_build": "b11435-abcdef"},
    "cache_type_k": {"cache_type_k": "q8_0"},
    "cache_type_v": {"cache_type_v": "f16"},
    "flash_attention": {"flash_attention": False},
    "unified_kv": {"unified_kv": True},
    "swa_full": {"swa_full": True},
    "swa_full (window)": {"swa_full": False},
    "draft.spec_type": {"draft": _draft(spec_type="draft-eagle3")},
    "draft.draft_depth": {"draft": _draft(draft_depth=4)},
    "draft.cache_type_k": {"draft": _draft(cache_type_k="q8_0")},
    "draft.cache_type_v": {"draft": _draft(cache_type_v="q8_0")},
    "draft (absent)": {"draft": None},
    "payload_kind": {"payload_kind": "llama_slot_v2"},
    "platform.machine": {"platform": Platform(machine="aarch64", byte_order="little")},
    "platform.byte_order": {"platform": Platform(machine="x86_64", byte_order="big")},
    "platform (absent)": {"platform": None},
}


def test_identity_is_64_lowercase_hex_and_deterministic() -> None:
    a, b = exact_state_identity(_inputs()), exact_state_identity(_inputs())
    assert a == b
    assert is_digest(a)


@pytest.mark.parametrize("field", list(CHANGES))
def test_every_field_changes_the_identity(field: str) -> None:
    assert exact_state_identity(_inputs(**CHANGES[field])) != exact_state_identity(_inputs())


def test_each_field_change_gives_a_distinct_identity() -> None:
    seen = {exact_state_identity(_inputs(**c)) for c in CHANGES.values()} | {exact_state_identity(_inputs())}
    assert len(seen) == len(CHANGES) + 1


def test_every_struct_field_is_in_the_canonical_order_table() -> None:
    # A field added to an input struct but not to _FIELDS would silently not count.
    for record, names in _FIELDS.items():
        assert set(names) == set(record.__struct_fields__), record.__name__
        assert len(names) == len(set(names))


@pytest.mark.parametrize("field", ["llama_build", "cache_type_k", "cache_type_v"])
def test_absent_and_empty_string_differ(field: str) -> None:
    assert exact_state_identity(_inputs(**{field: None})) != exact_state_identity(_inputs(**{field: ""}))


def test_absent_draft_differs_from_a_draft_with_every_setting_absent() -> None:
    empty = DraftSettings(spec_type=None, draft_depth=None, cache_type_k=None, cache_type_v=None)
    assert exact_state_identity(_inputs(draft=None)) != exact_state_identity(_inputs(draft=empty))


def test_false_and_absent_and_zero_differ() -> None:
    ids = {
        exact_state_identity(_inputs(flash_attention=False)),
        exact_state_identity(_inputs(flash_attention=None)),
        exact_state_identity(_inputs(draft=_draft(draft_depth=0))),
        exact_state_identity(_inputs(draft=_draft(draft_depth=None))),
    }
    assert len(ids) == 4


def test_swapping_values_between_fields_changes_the_identity() -> None:
    assert exact_state_identity(_inputs(cache_type_k="q8_0", cache_type_v="f16")) != exact_state_identity(
        _inputs(cache_type_k="f16", cache_type_v="q8_0")
    )
    assert exact_state_identity(_inputs(draft=_draft(cache_type_k="q4_0", cache_type_v="f16"))) != exact_state_identity(
        _inputs(draft=_draft(cache_type_k="f16", cache_type_v="q4_0"))
    )


def test_moving_bytes_between_adjacent_strings_changes_the_identity() -> None:
    # "ab" + "c" vs "a" + "bc": length prefixes keep the boundary.
    assert exact_state_identity(_inputs(cache_type_k="ab", cache_type_v="c")) != exact_state_identity(
        _inputs(cache_type_k="a", cache_type_v="bc")
    )


text = st.none() | st.text(max_size=12)


@given(
    a=st.tuples(text, text, text, st.none() | st.booleans(), st.none() | st.booleans()),
    b=st.tuples(text, text, text, st.none() | st.booleans(), st.none() | st.booleans()),
)
def test_different_inputs_never_share_an_encoding(
    a: tuple[str | None, str | None, str | None, bool | None, bool | None],
    b: tuple[str | None, str | None, str | None, bool | None, bool | None],
) -> None:
    def make(v: tuple[str | None, str | None, str | None, bool | None, bool | None]) -> StateInputs:
        return _inputs(llama_build=v[0], cache_type_k=v[1], cache_type_v=v[2], flash_attention=v[3], unified_kv=v[4])

    assert (canonical_encoding(make(a)) == canonical_encoding(make(b))) == (a == b)


def test_node_port_and_slot_are_not_part_of_it() -> None:
    names = {n for fields in _FIELDS.values() for n in fields}
    assert not names & {"node", "host", "port", "slot", "slot_id", "id_slot", "instance"}
    wire = msgspec.json.encode(_inputs())
    with_node = wire[:-1] + b',"node":"n1","slot_id":3}'
    with pytest.raises(msgspec.ValidationError, match="node"):
        msgspec.json.decode(with_node, type=StateInputs)
    assert msgspec.json.decode(wire, type=StateInputs) == _inputs()


@pytest.mark.parametrize("bad", ["", "AB" * 32, "ab" * 31, "../" + "a" * 61, "g" * 64])
def test_a_model_digest_that_is_not_blake3_hex_is_refused(bad: str) -> None:
    with pytest.raises(DigestError):
        exact_state_identity(_inputs(model_digest=bad))
