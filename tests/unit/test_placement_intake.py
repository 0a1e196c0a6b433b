"""Telemetry intake (`actors.placement.intake`): a report is taken as the node's heartbeat only when decoding it in
full would give its last report with a new sequence number and time; anything else is decoded in full."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.placement.intake import CONTENT_START, Known, heartbeat_of, remember, split
from messages.settings import ServingSettings
from messages.telemetry import GpuInfo, HostInfo, LlamaServerInfo, ModelFiles, NodeResources
from runtime.bus import BadMessage, decode_checked, encode

GIB = 1 << 30


def report(seq: int = 1, sent_at: float = 1000.5, **changes: object) -> NodeResources:
    base = NodeResources(
        node_id="node-a", seq=seq, sent_at=sent_at, started_at=900.25, ttl_s=15.0,
        host=HostInfo(ram_total_bytes=64 * GIB, ram_available_bytes=40 * GIB, usable_bytes=40 * GIB, cpu_count=16,
                      cpu_features=("AVX2",)),
        gpus=(GpuInfo(index=0, name="GPU", uuid="GPU-0", total_bytes=24 * GIB, free_bytes=20 * GIB,
                      used_bytes=4 * GIB, usable_bytes=20 * GIB),),
        llama_server=LlamaServerInfo(path="llama-server", version="1 (abc)", build_info=""),
        settings=ServingSettings(slots=4),
        model_files=ModelFiles(held=(("m.gguf", 5, ""),)),
    )  # fmt: skip
    return msgspec.structs.replace(base, **changes)


def known_of(node: NodeResources) -> Known:
    return remember(node, encode(node))


def full(key: str, payload: bytes) -> NodeResources | None:
    """What the placement actor's full decoding takes in (None: refused)."""
    try:
        node = decode_checked(payload, NodeResources, f"telemetry of node {key}")
    except BadMessage:
        return None
    return node if node.node_id == key else None


def test_a_report_that_says_the_same_again_is_its_heartbeat_and_decodes_to_what_the_full_decoder_gives() -> None:
    first = report()
    again = encode(report(seq=2, sent_at=1001.5))
    taken = heartbeat_of(known_of(first), "node-a", again)
    assert taken is not None
    assert taken == full("node-a", again) == report(seq=2, sent_at=1001.5)


@pytest.mark.parametrize(
    "changed",
    [
        {"started_at": 950.0},  # the node restarted
        {"ttl_s": 30.0},
        {"host": msgspec.structs.replace(report().host, ram_available_bytes=39 * GIB, usable_bytes=39 * GIB)},
        {"gpus": ()},
        {"settings": ServingSettings(slots=8)},
        {"model_files": None},
        {"node_id": "node-b"},  # a copy of another node's report under this node's key
    ],
)
def test_a_report_whose_content_changed_is_decoded_in_full(changed: dict[str, object]) -> None:
    payload = encode(report(seq=2, sent_at=1001.5, **changed))
    assert heartbeat_of(known_of(report()), "node-a", payload) is None


def test_nothing_is_a_heartbeat_of_a_node_with_no_report_taken_in_full() -> None:
    assert heartbeat_of(None, "node-a", encode(report(seq=2))) is None


def test_first_fields_other_than_the_three_make_a_report_decode_in_full() -> None:
    payload = encode(report(seq=2, sent_at=1001.5))
    extra = payload.replace(b'"seq":2,', b'"seq":2,"note":1,', 1)
    assert heartbeat_of(known_of(report()), "node-a", extra) is None
    negative = payload.replace(b'"seq":2,', b'"seq":-2,', 1)  # NodeResources refuses it: so does the heartbeat
    assert heartbeat_of(known_of(report()), "node-a", negative) is None
    assert full("node-a", negative) is None


def test_content_that_repeats_a_heartbeat_key_is_never_taken_as_a_heartbeat() -> None:
    # JSON's last duplicate key wins: content naming `seq` again would make the whole decode to the content's.
    payload = encode(report())
    forged = payload.replace(b'"ttl_s":', b'"seq":1,"ttl_s":', 1)
    node = full("node-a", forged)
    assert node is not None and node.seq == 1
    assert remember(node, forged).content is None
    assert split(forged) is None
    assert CONTENT_START in forged


def test_a_report_that_does_not_split_is_remembered_without_content() -> None:
    node = report()
    pretty = msgspec.json.format(encode(node))  # other spacing: `,"started_at":` is not found
    assert remember(node, pretty).content is None
    assert heartbeat_of(remember(node, pretty), "node-a", pretty) is None


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_mangled_report_is_a_heartbeat_only_when_the_full_decoder_takes_it_in_as_that(data: st.DataObject) -> None:
    # Any bytes a node (or a forger) may write: whatever `heartbeat_of` answers, the full decoder answers the same.
    payload = bytearray(encode(report(seq=2, sent_at=1001.5)))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        at = data.draw(st.integers(0, len(payload)), label="at")
        kind = data.draw(st.sampled_from(("flip", "insert", "delete")), label="kind")
        if kind == "flip" and at < len(payload):
            payload[at] = data.draw(st.integers(0, 255), label="byte")
        elif kind == "insert":
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=12), label="inserted")
        else:
            del payload[at : at + data.draw(st.integers(1, 8), label="deleted")]
    taken = heartbeat_of(known_of(report()), "node-a", bytes(payload))
    if taken is not None:
        assert taken == full("node-a", bytes(payload))
