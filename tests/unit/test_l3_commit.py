"""The commit check refuses any manifest that does not tile its payload exactly, or does not match what was
observed; digests are validated before any path is built."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.l3 import layout
from actors.l3.commit import Rule, check_manifest, check_present, validate
from actors.l3.layout import DigestError, Manifest, SegmentRef

IDENTITY = "1d" * 32
PAYLOAD = "9a" * 32


def _digest(i: int) -> str:
    return f"{i:064x}"


def _manifest(lengths: list[int], **changes: object) -> Manifest:
    segments, offset = [], 0
    for i, n in enumerate(lengths):
        segments.append(SegmentRef(i, offset, n, _digest(i + 1)))
        offset += n
    m = Manifest(
        identity=IDENTITY,
        tokens=(1, 2, 3),
        n_tokens=3,
        payload_kind="llama_slot",
        total_bytes=offset,
        payload_digest=PAYLOAD,
        segments=tuple(segments),
    )
    return msgspec.structs.replace(m, **changes)


def test_a_manifest_that_tiles_its_payload_and_matches_what_was_observed_is_accepted() -> None:
    m = _manifest([100, 100, 7])
    assert validate(m, list(m.segments), PAYLOAD) is None
    assert validate(_manifest([]), [], PAYLOAD) is None  # an empty payload has no segments


# ---- hypothesis: any tampering is refused ----


def _with_segments(m: Manifest, segments: list[SegmentRef]) -> Manifest:
    return msgspec.structs.replace(m, segments=tuple(segments))


def _gap(m: Manifest, i: int, k: int) -> Manifest:
    s = list(m.segments)
    s[i] = SegmentRef(s[i].index, s[i].offset + k, s[i].length, s[i].digest)
    return _with_segments(m, s)


def _overlap(m: Manifest, i: int, k: int) -> Manifest:
    s = list(m.segments)
    s[i] = SegmentRef(s[i].index, s[i].offset - k, s[i].length, s[i].digest)
    return _with_segments(m, s)


def _duplicate(m: Manifest, i: int, k: int) -> Manifest:
    s = list(m.segments)
    s.insert(i, s[i])
    return _with_segments(m, s)


def _reorder(m: Manifest, i: int, k: int) -> Manifest:
    s = list(m.segments)
    j = (i + 1 + k % (len(s) - 1)) % len(s)
    s[i], s[j] = s[j], s[i]
    return _with_segments(m, s)


def _drop(m: Manifest, i: int, k: int) -> Manifest:
    s = list(m.segments)
    del s[i]
    return _with_segments(m, s)


def _length(m: Manifest, i: int, k: int) -> Manifest:
    s = list(m.segments)
    s[i] = SegmentRef(s[i].index, s[i].offset, s[i].length + k, s[i].digest)
    return _with_segments(m, s)


def _total(m: Manifest, i: int, k: int) -> Manifest:
    return msgspec.structs.replace(m, total_bytes=m.total_bytes + k * (1 if i % 2 else -1))


def _index(m: Manifest, i: int, k: int) -> Manifest:
    s = list(m.segments)
    s[i] = SegmentRef(s[i].index + k, s[i].offset, s[i].length, s[i].digest)
    return _with_segments(m, s)


def _segment_digest(m: Manifest, i: int, k: int) -> Manifest:
    s = list(m.segments)
    s[i] = SegmentRef(s[i].index, s[i].offset, s[i].length, _digest(10_000 + k))
    return _with_segments(m, s)


def _payload_digest(m: Manifest, i: int, k: int) -> Manifest:
    return msgspec.structs.replace(m, payload_digest=_digest(20_000 + k))


TAMPERINGS = {
    "gap": _gap,
    "overlap": _overlap,
    "duplicate": _duplicate,
    "reorder": _reorder,
    "drop": _drop,
    "length": _length,
    "total": _total,
    "index": _index,
    "segment_digest": _segment_digest,
    "payload_digest": _payload_digest,
}

lengths = st.lists(st.integers(min_value=1, max_value=1 << 20), min_size=2, max_size=12)


@given(
    lengths=lengths,
    how=st.sampled_from(sorted(TAMPERINGS)),
    where=st.integers(min_value=0),
    k=st.integers(min_value=1, max_value=1 << 16),
    side=st.sampled_from(["manifest", "observed"]),
)
def test_any_tampering_of_the_manifest_or_of_what_was_observed_is_refused(
    lengths: list[int], how: str, where: int, k: int, side: str
) -> None:
    honest = _manifest(lengths)
    i = where % len(lengths)
    if how == "overlap":
        i = max(i, 1)  # the first segment cannot overlap anything; a negative offset is a gap-like refusal too
        k = min(k, honest.segments[i].offset)
    tampered = TAMPERINGS[how](honest, i, k)
    if side == "manifest":
        refusal = validate(tampered, list(honest.segments), honest.payload_digest)
    else:
        refusal = validate(honest, list(tampered.segments), tampered.payload_digest)
        if how == "total":  # total is a manifest field; nothing observed changes
            assert refusal is None
            return
    assert refusal is not None, (how, side)


@given(lengths=lengths, where=st.integers(min_value=0), k=st.integers(min_value=1, max_value=1000))
def test_a_gap_or_overlap_names_the_offset_rule_and_the_segment(lengths: list[int], where: int, k: int) -> None:
    honest = _manifest(lengths)
    i = max(1, where % len(lengths))
    refusal = validate(_gap(honest, i, k), list(honest.segments), PAYLOAD)
    assert refusal is not None and refusal.rule is Rule.OFFSET and refusal.index == i
    assert "gap" in refusal.detail
    k = min(k, honest.segments[i].offset)
    refusal = validate(_overlap(honest, i, k), list(honest.segments), PAYLOAD)
    assert refusal is not None and refusal.rule is Rule.OFFSET and "overlap" in refusal.detail


@pytest.mark.parametrize(
    ("how", "rule"),
    [
        ("duplicate", Rule.INDEX),
        ("reorder", Rule.INDEX),
        ("drop", Rule.INDEX),
        ("total", Rule.TOTAL),
        ("index", Rule.INDEX),
        ("payload_digest", Rule.PAYLOAD_DIGEST),
        ("segment_digest", Rule.SEGMENT_MISMATCH),
    ],
)
def test_each_tampering_is_refused_by_the_rule_that_names_it(how: str, rule: Rule) -> None:
    honest = _manifest([10, 20, 30, 40])
    tampered = TAMPERINGS[how](honest, 1, 5)
    if how in ("segment_digest", "payload_digest"):  # the manifest is well formed; what was observed differs
        refusal = validate(honest, list(tampered.segments), tampered.payload_digest)
    else:
        refusal = validate(tampered, list(honest.segments), PAYLOAD)
    assert refusal is not None and refusal.rule is rule


def test_observing_fewer_or_more_segments_than_named_is_refused() -> None:
    m = _manifest([10, 10])
    assert validate(m, list(m.segments[:1]), PAYLOAD).rule is Rule.SEGMENT_COUNT  # type: ignore[union-attr]
    extra = [*m.segments, SegmentRef(2, 20, 1, "")]
    assert validate(m, extra, PAYLOAD).rule is Rule.SEGMENT_COUNT  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"version": 2}, Rule.VERSION),
        ({"identity": "not hex"}, Rule.IDENTITY),
        ({"payload_kind": ""}, Rule.PAYLOAD_KIND),
        ({"payload_kind": "../x"}, Rule.PAYLOAD_KIND),
        ({"n_tokens": 4}, Rule.TOKENS),
        ({"tokens": (1, -2, 3)}, Rule.TOKENS),
        ({"tokens": (1, 2, 1 << 31)}, Rule.TOKENS),
        ({"payload_digest": "AB" * 32}, Rule.DIGEST_SYNTAX),
    ],
)
def test_a_malformed_manifest_is_refused_by_its_own_rules(changes: dict[str, object], rule: Rule) -> None:
    refusal = check_manifest(_manifest([5], **changes))
    assert refusal is not None and refusal.rule is rule


def test_a_segment_digest_that_is_not_hex_is_refused_before_anything_else() -> None:
    m = _manifest([5, 5])
    bad = _with_segments(m, [m.segments[0], SegmentRef(1, 5, 5, "../../etc/passwd")])
    refusal = check_manifest(bad)
    assert refusal is not None and refusal.rule is Rule.DIGEST_SYNTAX and refusal.index == 1


def test_empty_and_oversized_segments_are_refused() -> None:
    assert check_manifest(_manifest([5, 0, 5])).rule is Rule.LENGTH  # type: ignore[union-attr]
    assert check_manifest(_manifest([layout.MAX_SEGMENT_BYTES + 1])).rule is Rule.LENGTH  # type: ignore[union-attr]


def test_check_present_refuses_a_missing_or_resized_segment() -> None:
    m = _manifest([5, 6])
    sizes = {s.digest: s.length for s in m.segments}
    assert check_present(m, sizes) is None
    assert check_present(m, {m.segments[0].digest: 5}).rule is Rule.SEGMENT_MISSING  # type: ignore[union-attr]
    assert check_present(m, {**sizes, m.segments[1].digest: 5}).rule is Rule.SEGMENT_SIZE  # type: ignore[union-attr]


# ---- layout: digests and paths ----

HOSTILE = [
    "",
    "../" * 21 + "a",
    "a" * 63,
    "a" * 65,
    "A" * 64,
    "a" * 63 + "\n",
    "a" * 63 + "/",
    "a" * 32 + "\x00" + "a" * 31,
    "../../../../etc/passwd",
    "g" * 64,
    " " + "a" * 63,
]


@pytest.mark.parametrize("bad", HOSTILE)
def test_hostile_digests_are_refused_before_a_path_is_built(bad: str) -> None:
    assert not layout.is_digest(bad)
    with pytest.raises(DigestError):
        layout.segment_path(bad)
    with pytest.raises(DigestError):
        layout.manifest_path(bad)
    with pytest.raises(DigestError):
        layout.quarantine_path(bad + ".json")


@pytest.mark.parametrize("bad", [None, 3, b"a" * 64, ["a" * 64]])
def test_non_string_digests_are_refused(bad: object) -> None:
    assert not layout.is_digest(bad)
    with pytest.raises(DigestError):
        layout.check_digest(bad)


@given(st.text(max_size=80))
def test_any_accepted_digest_builds_a_path_of_plain_names(value: str) -> None:
    if not layout.is_digest(value):
        with pytest.raises(DigestError):
            layout.segment_path(value)
        return
    parts = layout.segment_path(value)
    assert all(p not in ("", ".", "..") and "/" not in p and "\x00" not in p for p in parts)


def test_the_segment_plan_tiles_the_payload() -> None:
    assert layout.plan_segments(0, layout.MIN_SEGMENT_BYTES) == []
    size = layout.MIN_SEGMENT_BYTES
    assert layout.plan_segments(2 * size + 1, size) == [(0, 0, size), (1, size, size), (2, 2 * size, 1)]
    with pytest.raises(ValueError):
        layout.plan_segments(10, 1)


def test_the_entry_id_depends_on_identity_and_tokens_and_checks_both() -> None:
    a = layout.entry_id(IDENTITY, (1, 2, 3))
    assert layout.is_digest(a)
    assert a != layout.entry_id(IDENTITY, (1, 2))
    assert a != layout.entry_id("2e" * 32, (1, 2, 3))
    with pytest.raises(DigestError):
        layout.entry_id("x", (1,))
    with pytest.raises(ValueError):
        layout.entry_id(IDENTITY, (-1,))


def test_a_manifest_round_trips_and_refuses_unknown_fields_and_oversize_input() -> None:
    m = _manifest([3, 4])
    assert layout.decode_manifest(layout.encode_manifest(m)) == m
    with pytest.raises(msgspec.ValidationError):
        layout.decode_manifest(layout.encode_manifest(m)[:-1] + b',"node":"x"}')
    with pytest.raises(msgspec.ValidationError):
        layout.decode_manifest(b" " * (layout.MAX_MANIFEST_BYTES + 1))


@given(lengths=lengths, how=st.sampled_from(sorted(TAMPERINGS)), where=st.integers(min_value=0), k=st.integers(1, 1000))
def test_the_payload_root_changes_with_any_change_of_the_segment_table(
    lengths: list[int], how: str, where: int, k: int
) -> None:
    honest = _manifest(lengths)
    tampered = TAMPERINGS[how](honest, where % len(lengths), k)
    if tampered.segments == honest.segments:  # total and payload digest are not in the table
        return
    assert layout.payload_root(tampered.segments) != layout.payload_root(honest.segments)


@given(
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=3), st.integers(0, 3)), min_size=1, max_size=4)
)
def test_a_damaged_manifest_file_decodes_or_fails_with_a_msgspec_error(edits: list[tuple[int, bytes, int]]) -> None:
    raw = bytearray(layout.encode_manifest(_manifest([10, 20])))
    for where, insert, cut in edits:  # a truncated, overwritten or spliced file
        i = where % (len(raw) + 1)
        raw[i : i + cut] = insert
    try:
        decoded = layout.decode_manifest(bytes(raw))
    except msgspec.MsgspecError:
        return
    check_manifest(decoded)  # judged, never raises


small_ints = st.integers(min_value=-(1 << 40), max_value=1 << 40)
manifests = st.builds(
    Manifest,
    version=st.integers(0, 3),
    identity=st.sampled_from([IDENTITY, "", "x" * 64, IDENTITY.upper()]),
    tokens=st.lists(small_ints, max_size=5).map(tuple),
    n_tokens=st.integers(0, 6),
    payload_kind=st.text(max_size=40),
    total_bytes=small_ints,
    payload_digest=st.sampled_from([PAYLOAD, "", "../x"]),
    segments=st.lists(
        st.builds(SegmentRef, small_ints, small_ints, small_ints, st.sampled_from([_digest(1), "", "../../x"])),
        max_size=5,
    ).map(tuple),
)


@given(manifests)
def test_the_manifest_rules_judge_any_manifest_without_raising(m: Manifest) -> None:
    refusal = check_manifest(m)
    if refusal is None:  # accepted: then it really tiles its total, and every digest is one
        assert sum(s.length for s in m.segments) == m.total_bytes
        assert all(layout.is_digest(s.digest) for s in m.segments) and layout.is_digest(m.payload_digest)
        assert [s.index for s in m.segments] == list(range(len(m.segments)))
