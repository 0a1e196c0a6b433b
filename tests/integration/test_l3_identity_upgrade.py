"""A store written before the identity gained the per-slot context and the stream count (v2), on a real
nats-server: after the upgrade its entries load as before, are listed and valid under their own identity, are
never found for the instance's new identity (the same tokens are computed again and stored beside them), and
leave through ordinary least-recently-used eviction, without a quarantine or an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.l3 import layout
from actors.l3.identity import Platform, StateInputs, exact_state_identity
from runtime.bus import Bus
from tests.conftest import JournalReader, of_type
from tests.harness.l3 import KIND, SEG, _slot_file, l3_node
from tests.harness.l3_identity import v2_identity

TOKENS = list(range(1, 301))
# an instance as `state_identity` describes it: 512 cells a slot, two slots with their own streams
INSTANCE = StateInputs(
    model_digest="4f" * 32,
    llama_build="b11434",
    cache_type_k="f16",
    cache_type_v="f16",
    flash_attention=True,
    unified_kv=False,
    n_ctx_seq=512,
    n_stream=2,
    swa_full=None,
    draft=None,
    payload_kind=KIND,
    platform=Platform(machine="x86_64", byte_order="little"),
    split=None,
)


async def test_entries_of_the_previous_identity_stay_valid_are_never_restored_and_are_evicted_as_usual(
    bus: Bus, journal_reader: JournalReader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = v2_identity(INSTANCE, monkeypatch), exact_state_identity(INSTANCE)
    assert old != new
    size = 3 * SEG
    async with l3_node(bus, tmp_path / "a", "node-a", budget_bytes=2 * size + SEG) as before:  # room for two
        source, _ = _slot_file(tmp_path / "slots", size, seed=1)
        before.capture(source, identity=old, tokens=TOKENS, payload_kind=KIND)  # what the v2 runner stored
        await journal_reader.wait_for(of_type("l3_captured"))

    async with l3_node(bus, tmp_path / "a", "node-a", budget_bytes=2 * size + SEG) as after:  # upgraded
        [listed] = after.inventory().items
        assert (listed.identity, listed.n_tokens) == (old, len(TOKENS))
        assert await after.lookup(new, [*TOKENS, 7], max_tokens=len(TOKENS)) is None  # never this instance's
        hit = await after.lookup(old, [*TOKENS, 7], max_tokens=len(TOKENS))  # still whole under its own
        assert hit is not None and hit.n_tokens == len(TOKENS)
        await after.materialize(hit, tmp_path / "restored.bin", deadline_s=10)

        # the same tokens computed again under the new identity: a second entry beside the old one
        source, _ = _slot_file(tmp_path / "slots", size, seed=2)
        after.capture(source, identity=new, tokens=TOKENS, payload_kind=KIND)
        await journal_reader.wait_for(of_type("l3_captured"), count=2)
        assert {i.identity for i in after.inventory().items} == {old, new}
        assert await after.lookup(new, [*TOKENS, 7], max_tokens=len(TOKENS)) is not None

        # a third entry exceeds the budget: the old entry, least recently used, is evicted like any other
        source, _ = _slot_file(tmp_path / "slots", size, seed=3)
        after.capture(source, identity=new, tokens=TOKENS[:-1], payload_kind=KIND)
        [evicted] = await journal_reader.wait_for(of_type("l3_evicted"))
        assert evicted["entries"] == [layout.entry_id(old, TOKENS)]
        assert {i.identity for i in after.inventory().items} == {new}
    assert not [e for e in journal_reader.events if e.get("type") in ("l3_quarantined", "l3_capture_dropped")]
