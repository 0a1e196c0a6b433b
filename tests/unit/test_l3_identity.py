"""Exact-state identity: every field counts, absent is not empty, fields cannot trade places, no node/slot; and
what an instance's identity is built from (`state_identity`): every serving setting is either in it, through
the field it changes, or out of it for a stated reason."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.l3 import identity
from actors.l3.identity import (
    _FIELDS,
    DraftSettings,
    Platform,
    StateInputs,
    canonical_encoding,
    exact_state_identity,
)
from actors.l3.layout import DigestError, is_digest
from actors.placement.context import resolve_context
from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.runner.serving import state_identity
from messages.model import ModelGeometry
from messages.placement import Companion, Reservation, RpcMember, Stamp
from messages.settings import ServingSettings
from tests.harness.l3_identity import v2_identity
from tests.tiny_models import write_phi3

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
        n_ctx_seq=4096,
        n_stream=2,
        swa_full=None,
        draft=DraftSettings(spec_type="draft-mtp", draft_depth=3, cache_type_k="f16", cache_type_v="f16"),
        payload_kind="llama_slot",
        platform=Platform(machine="x86_64", byte_order="little"),
        split=None,
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
    "n_ctx_seq": {"n_ctx_seq": 32768},
    "n_stream": {"n_stream": 4},
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


def test_the_encoding_is_pinned_by_a_known_identity() -> None:
    # Any change to the encoding or the field table changes this value: bump `_DOMAIN` with it, so entries
    # stored under the old rules are never taken for entries of the new ones.
    assert exact_state_identity(_inputs()) == "070a18a30d74d6d67dd5eec1cbf271c144fe0dadaf89c2e18d2b91c4ed53b0b8"


def test_a_split_is_shared_only_within_its_layout() -> None:
    layouts = [None, "0-4,4-8", "0-3,3-8", "0-2,2-5,5-8"]
    assert len({exact_state_identity(_inputs(split=layout)) for layout in layouts}) == len(layouts)


V2_IDENTITY = "2d9dbb2f6c6a4adc06f511cae8d44383309b4527cd4370f09be28a822747c919"  # computed by the v2 code


def test_no_identity_of_the_previous_version_is_an_identity_of_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert v2_identity(_inputs(), monkeypatch) == V2_IDENTITY  # the reconstruction is faithful
    now = {exact_state_identity(_inputs(n_ctx_seq=n, n_stream=k)) for n in (256, 4096, 131072) for k in (1, 2, 8)}
    assert V2_IDENTITY not in now and len(now) == 9


@given(
    a=st.tuples(st.integers(0, 1 << 20), st.integers(1, 256)), b=st.tuples(st.integers(0, 1 << 20), st.integers(1, 256))
)
def test_the_context_and_the_streams_never_share_an_encoding(a: tuple[int, int], b: tuple[int, int]) -> None:
    def make(v: tuple[int, int]) -> bytes:
        return canonical_encoding(_inputs(n_ctx_seq=v[0], n_stream=v[1]))

    assert (make(a) == make(b)) == (a == b)


# --- an instance's identity (`state_identity`): what of its settings is in, and what is out ----------------------

ORIGINAL_CONTEXT = 4096  # the tiny model's original (short-factor) context


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> ModelGeometry:
    """A model with LongRoPE factors: the keys it caches depend on the per-slot context."""
    path = write_phi3(tmp_path_factory.mktemp("identity") / "phi3.gguf", original_context=ORIGINAL_CONTEXT)
    return geometry_from_header(read_header(path))


BASE = ServingSettings(slots=2, kv_unified=False, cache_type_k="f16", cache_type_v="f16", flash_attn="on")
BASE_CTX = 8192  # 4096 cells per slot: the original context, short factors


def _reservation(settings: ServingSettings = BASE, *, ctx: int = BASE_CTX, **stamp: Any) -> Reservation:
    return Reservation(
        reservation_id="r1",
        decision_id="d1",
        node_id="n1",
        state="running",
        model_path="/models/phi3.gguf",
        stamp=Stamp(settings=settings, ctx=ctx, n_gpu_layers=stamp.pop("n_gpu_layers", 0), **stamp),
        layers=(0, 4),
        devices=(),
        held={},
        created_at=0.0,
    )


def _identity_of(
    geometry: ModelGeometry, reservation: Reservation, *, build: str = "b11434", sliding_window: bool = False
) -> str:
    """As the runner builds it: the context its prediction resolved (and the server was verified against)."""
    stamp = reservation.stamp
    context = resolve_context(geometry, stamp.settings, stamp.ctx)
    return state_identity(reservation, MODEL, build, context=context, sliding_window=sliding_window)


#: Every setting of a stamp, and how it reaches the identity. A new setting must be decided on here (and in
#: docs/architecture.md, "What the exact-state identity covers") before this test passes.
SETTINGS_IN = {
    "slots": "the stream count and the per-slot context (per-slot KV); nothing with unified KV",
    "kv_unified": "unified_kv, the stream count and the per-slot context",
    "cache_type_k": "cache_type_k",
    "cache_type_v": "cache_type_v",
    "flash_attn": "flash_attention (V is cached transposed without it)",
    "swa_full": "swa_full (models with sliding-window layers)",
    "spec_type": "draft",
    "spec_draft_n_max": "draft (the recurrent rollback rows follow it)",
    "spec_draft_type_k": "draft",
    "spec_draft_type_v": "draft",
    "ctx": "n_ctx_seq, as llama.cpp resolves it (padded to 256 cells)",
    "rpc": "split: the layer layout over the head and its members (a state is shared only within one layout)",
}
SETTINGS_OUT = {
    "batch": "how a prompt is split into batches: the same function, rounding at most (a server's own states "
    "come from varying splits: a cached prefix is extended in other chunks than a cold prompt)",
    "ubatch": "as batch",
    "threads": "which core computes which rows: rounding at most",
    "ctx_checkpoints": "host-memory copies beside the slot; a slot file carries none",
    "cache_ram_mib": "the host prompt cache; not in a slot file",
    "n_gpu_layers": "where a layer runs: the slot file is read from any backend in the same types",
    "gpu_split": "as n_gpu_layers",
    "llama_server_version": "in through the runner's engine build (a stamp naming another build is drift)",
    "kind": "embeddings on computes the same layers into the same KV cells; only what is read after them differs "
    "(an embedding server's own answers, pooled, are never captured)",
    "pooling": "as kind: pooling reads the hidden states after the last layer, never the cache",
    "draft": "a draft model's context is not in a slot file (the server saves the target context only), and "
    "greedy verification gives the same tokens with any draft; the speculation settings are in",
    "mmproj": "the projector computes image embeddings; states holding media are never captured, and a text "
    "state is the same with or without a projector",
}
#: A changed value for each setting, from BASE and BASE_CTX.
CHANGED: dict[str, object] = {
    "slots": 4,
    "kv_unified": True,
    "cache_type_k": "q8_0",
    "cache_type_v": "q8_0",
    "flash_attn": "off",
    "swa_full": True,
    "spec_type": "ngram-simple",
    "spec_draft_n_max": 5,
    "spec_draft_type_k": "q8_0",
    "spec_draft_type_v": "q8_0",
    "ctx": 16384,
    "batch": 1024,
    "ubatch": 256,
    "threads": 3,
    "ctx_checkpoints": 4,
    "cache_ram_mib": 0,
    "n_gpu_layers": 99,
    "gpu_split": (1.0, 1.0),
    "llama_server_version": "b99999",
    "kind": "embedding",
    "pooling": "mean",
    "draft": Companion(path="draft.gguf", digest="ab" * 32),
    "mmproj": Companion(path="mmproj.gguf", digest="cd" * 32),
    "rpc": (RpcMember(node_id="n2", layers=(2, 4)),),
}


def _changed(field: str, value: object, base: ServingSettings = BASE) -> Reservation:
    if field in ("kind", "pooling"):  # an embedding server pools: the two change together
        pooled = {"kind": "embedding", "pooling": "mean", field: value}
        return _reservation(msgspec.structs.replace(base, **pooled))
    if field in ServingSettings.__struct_fields__:
        return _reservation(msgspec.structs.replace(base, **{field: value}))
    if field == "ctx":
        assert isinstance(value, int)
        return _reservation(base, ctx=value)
    stamp: dict[str, Any] = {field: value}
    return _reservation(base, **stamp)


def test_every_setting_of_a_stamp_is_decided_in_or_out() -> None:
    fields = (set(ServingSettings.__struct_fields__) | set(Stamp.__struct_fields__)) - {"settings"}
    assert set(SETTINGS_IN) | set(SETTINGS_OUT) == fields == set(CHANGED)
    assert not set(SETTINGS_IN) & set(SETTINGS_OUT)


@pytest.mark.parametrize("field", sorted(SETTINGS_IN))
def test_a_setting_that_changes_a_states_numbers_or_layout_changes_the_identity(
    phi3: ModelGeometry, field: str
) -> None:
    # the draft's settings count once speculation is on (the base runs none); swa_full on a model with a window
    base = msgspec.structs.replace(BASE, spec_type="draft-mtp") if field.startswith("spec_draft") else BASE
    window = field == "swa_full"
    before = _identity_of(phi3, _reservation(base), sliding_window=window)
    assert _identity_of(phi3, _changed(field, CHANGED[field], base), sliding_window=window) != before


@pytest.mark.parametrize("field", sorted(SETTINGS_OUT))
def test_a_setting_that_changes_neither_leaves_the_identity(phi3: ModelGeometry, field: str) -> None:
    assert _identity_of(phi3, _changed(field, CHANGED[field])) == _identity_of(phi3, _reservation())


def test_contexts_on_either_side_of_the_original_context_never_share_states(phi3: ModelGeometry) -> None:
    # 2 slots, per-slot KV: 8192 gives 4096 cells a slot (short factors), 8704 gives 4352 (long ones)
    short, long = _identity_of(phi3, _reservation(ctx=8192)), _identity_of(phi3, _reservation(ctx=8704))
    assert short != long
    # the per-slot context is in exactly, not only its side of the original context: a new engine build may
    # read it elsewhere, and a wrong state is worse than a state computed again
    assert _identity_of(phi3, _reservation(ctx=4096)) != short
    # it is the context llama.cpp resolves: -c is padded to 256 cells
    assert _identity_of(phi3, _reservation(ctx=8000)) == short


def test_slots_count_only_through_what_they_change(phi3: ModelGeometry) -> None:
    per_slot = _identity_of(phi3, _reservation(ctx=8192))  # 2 streams of 4096
    # the same cells per slot in twice the streams: a slot file restores only into as many streams
    assert _identity_of(phi3, _reservation(msgspec.structs.replace(BASE, slots=4), ctx=16384)) != per_slot
    # unified KV: one stream whatever the slots, and each slot may use the whole context
    unified = msgspec.structs.replace(BASE, kv_unified=True)
    assert _identity_of(phi3, _reservation(unified)) == _identity_of(
        phi3, _reservation(msgspec.structs.replace(unified, slots=7))
    )


def test_where_an_instance_runs_is_not_part_of_its_identity(phi3: ModelGeometry) -> None:
    elsewhere = msgspec.structs.replace(_reservation(), node_id="n2", reservation_id="r2", model_path="/m/x.gguf")
    assert _identity_of(phi3, elsewhere) == _identity_of(phi3, _reservation())
    assert _identity_of(phi3, _reservation(), build="b11435") != _identity_of(phi3, _reservation())


def test_a_cache_scope_stores_its_states_under_an_identity_of_its_own() -> None:
    base = "ab" * 32
    assert identity.scoped_identity(base, "") == base  # the mesh's shared scope: the instance's own
    a, b = identity.scoped_identity(base, "tenant:a"), identity.scoped_identity(base, "tenant:b")
    assert len({base, a, b}) == 3 and all(is_digest(x) for x in (a, b))
    assert identity.scoped_identity(base, "tenant:a") == a  # stable: a scope finds its own states again
    assert identity.scoped_identity("cd" * 32, "tenant:a") != a
