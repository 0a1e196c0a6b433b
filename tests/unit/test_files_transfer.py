"""Model files from peers: the transfer core's decisions, the part file's resume, and who may ask for what."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.files import transfer
from actors.files.part import open_part
from actors.files.transfer import Holder, Source, TransferReason, TransferRefusal
from messages.subjects import Subjects
from runtime.roles import Role, permissions
from tests.harness.permissions import allowed

D1, D2 = "a" * 64, "b" * 64


@pytest.mark.parametrize("name", ["/etc/passwd", "../up.gguf", "a/../../b.gguf", "", "a//b", "./a", "x\x00y"])
def test_names_that_are_not_plain_relative_names_never_travel(name: str) -> None:
    refusal = transfer.check_relative(name)
    assert refusal is not None and refusal.reason is TransferReason.BAD_NAME


@pytest.mark.parametrize("name", ["tiny.gguf", "qwen/qwen-0.5b.gguf", "a..b.gguf"])
def test_plain_relative_names_travel(name: str) -> None:
    assert transfer.check_relative(name) is None


def test_the_part_file_is_named_from_the_digest_beside_the_destination() -> None:
    assert transfer.part_name("tiny.gguf", D1) == f".tiny.gguf.{D1[:16]}.part"
    assert transfer.journal_name("tiny.gguf", D1).endswith(".part.chunks")
    assert transfer.part_name("tiny.gguf", D1) != transfer.part_name("tiny.gguf", D2)


def test_the_chunk_plan_covers_the_file_from_a_chunk_boundary() -> None:
    assert transfer.chunk_plan(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert transfer.chunk_plan(10, 4, 8) == [(8, 2)]
    assert transfer.chunk_plan(8, 4, 8) == []
    with pytest.raises(ValueError):
        transfer.chunk_plan(10, 4, 3)


@given(size=st.integers(0, 1 << 20), chunk=st.integers(256, 1 << 16))
def test_the_plan_tiles_every_byte_once(size: int, chunk: int) -> None:
    plan = transfer.chunk_plan(size, chunk)
    assert sum(length for _, length in plan) == size
    assert all(offset == i * chunk for i, (offset, _) in enumerate(plan))


def test_a_chunk_is_checked_against_what_was_asked_and_its_own_hash() -> None:
    ok = dict(offset=8, length=4, total=10, got_offset=8, got_total=10, got_length=4, stated=D1, observed=D1)
    assert transfer.check_chunk(**ok) is None  # type: ignore[arg-type]
    for change in ({"got_offset": 4}, {"got_total": 12}, {"got_length": 3}, {"observed": D2}):
        refusal = transfer.check_chunk(**{**ok, **change})  # type: ignore[arg-type]
        assert refusal is not None and refusal.reason is TransferReason.CHUNK_REFUSED, change


def test_the_whole_file_must_hash_to_the_expected_digest() -> None:
    assert transfer.final_refusal(digest=D1, size=10, observed=D1, received=10) is None
    wrong = transfer.final_refusal(digest=D1, size=10, observed=D2, received=10)
    assert wrong is not None and wrong.reason is TransferReason.DIGEST_MISMATCH
    short = transfer.final_refusal(digest=D1, size=10, observed=D1, received=9)
    assert short is not None and short.reason is TransferReason.DIGEST_MISMATCH


def test_a_full_disk_is_a_refusal_before_any_byte_moves() -> None:
    assert transfer.space_refusal(free_bytes=100, need_bytes=100, keep_free_bytes=0) is None
    refusal = transfer.space_refusal(free_bytes=100, need_bytes=80, keep_free_bytes=30)
    assert refusal == TransferRefusal(
        TransferReason.NO_SPACE, "needs 80 bytes and keep 30 free; the file system has 100 free"
    )


def test_free_bytes_a_pull_in_flight_will_write_are_not_free_for_another() -> None:
    assert transfer.space_refusal(free_bytes=100, need_bytes=60, keep_free_bytes=0, owed_bytes=40) is None
    refusal = transfer.space_refusal(free_bytes=100, need_bytes=60, keep_free_bytes=0, owed_bytes=41)
    assert refusal == TransferRefusal(
        TransferReason.NO_SPACE, "needs 60 bytes; the file system has 100 free, 41 of them owed to pulls in flight"
    )


def test_the_version_fetched_is_the_signed_one_or_the_one_most_holders_state() -> None:
    holders = [Holder("c", 10, D2), Holder("b", 10, D1), Holder("a", 10, D1)]
    assert transfer.choose_source(holders) == Source(D1, 10, ("a", "b"))
    assert transfer.choose_source(holders, digest=D2, size=10) == Source(D2, 10, ("c",))
    signed_elsewhere = transfer.choose_source(holders, digest="c" * 64)
    assert isinstance(signed_elsewhere, TransferRefusal) and signed_elsewhere.reason is TransferReason.NO_PEER
    wrong_size = transfer.choose_source(holders, digest=D2, size=11)
    assert isinstance(wrong_size, TransferRefusal)
    nobody = transfer.choose_source([])
    assert isinstance(nobody, TransferRefusal) and nobody.reason is TransferReason.NO_PEER
    tie = transfer.choose_source([Holder("x", 5, D2), Holder("y", 5, D1)])
    assert tie == Source(D1, 5, ("y",))  # every node picks the same version


def test_resume_keeps_the_chunks_whose_bytes_match_the_journal() -> None:
    assert transfer.verified_chunks([D1, D2, D1], [D1, D2, D1]) == 3
    assert transfer.verified_chunks([D1, D2, D1], [D1, D1, D1]) == 1
    assert transfer.verified_chunks([D1, D2], [D1]) == 1
    assert transfer.verified_chunks([], [D1]) == 0


def test_a_journal_of_another_file_or_format_starts_over() -> None:
    text = transfer.journal_header(D1, 10, 4) + f"{D1}\n{D2}\n{D1[:20]}"  # the last line was being written
    assert transfer.parse_journal(text, D1, 10) == (4, [D1, D2])
    assert transfer.parse_journal(text, D2, 10) is None
    assert transfer.parse_journal(text, D1, 11) is None
    assert transfer.parse_journal("garbage", D1, 10) is None
    assert transfer.parse_journal(transfer.journal_header(D1, 10, 0), D1, 10) is None


@given(text=st.text(max_size=300))
def test_any_journal_text_parses_or_is_refused(text: str) -> None:
    parsed = transfer.parse_journal(text, D1, 10)
    assert parsed is None or (parsed[0] >= 1 and len(parsed[1]) <= 10)


def _write(part_dir: Path, data: bytes, chunk: int, upto: int) -> str:
    digest = str(blake3.blake3(data).hexdigest())
    part = open_part(part_dir, "m.gguf", digest, len(data), chunk)
    for offset, length in transfer.chunk_plan(len(data), chunk)[:upto]:
        piece = data[offset : offset + length]
        part.write(offset, piece, str(blake3.blake3(piece).hexdigest()))
    part.close()
    return digest


def test_an_interrupted_part_resumes_from_its_verified_chunks_and_a_torn_one_is_fetched_again(
    tmp_path: Path,
) -> None:
    data = os.urandom(10_000)
    digest = _write(tmp_path, data, 1024, 5)
    part_path = tmp_path / transfer.part_name("m.gguf", digest)
    with part_path.open("r+b") as handle:  # the fourth chunk was torn by a crash
        handle.seek(3 * 1024 + 7)
        handle.write(b"\xff\xfe")
    part = open_part(tmp_path, "m.gguf", digest, len(data), 1024)
    assert part.resumed_from == part.received == 3 * 1024
    assert part_path.stat().st_size == 3 * 1024
    for offset, length in transfer.chunk_plan(len(data), 1024, part.received):
        piece = data[offset : offset + length]
        part.write(offset, piece, str(blake3.blake3(piece).hexdigest()))
    assert part.finish() == digest  # the kept bytes fed the whole-file hash
    dest = tmp_path / "m.gguf"
    part.land(dest)
    assert dest.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_part_of_another_chunk_size_starts_over_and_discard_leaves_nothing(tmp_path: Path) -> None:
    data = os.urandom(5000)
    digest = _write(tmp_path, data, 1024, 3)
    part = open_part(tmp_path, "m.gguf", digest, len(data), 2048)
    assert part.resumed_from == 0
    part.discard()
    assert list(tmp_path.iterdir()) == []


def test_landing_never_replaces_a_file_that_appeared_at_the_destination(tmp_path: Path) -> None:
    data = os.urandom(100)
    digest = _write(tmp_path, data, 64, 2)
    part = open_part(tmp_path, "m.gguf", digest, len(data), 64)
    (tmp_path / "m.gguf").write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        part.land(tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == b"someone else's"


def test_nodes_ask_peers_for_files_but_only_an_admin_or_the_node_itself_makes_it_pull_and_clients_neither() -> None:
    s = Subjects("lab-a")
    node = permissions(s, Role("node", "n1"), "node-n1")
    client = permissions(s, Role("client"), "client-1")
    assert node is not None and client is not None
    for verb in ("held", "facts", "chunk"):
        assert allowed(node, "publish", s.files("n2", verb))
        assert not allowed(client, "publish", s.files("n2", verb))
    assert not allowed(node, "publish", s.files("n2", "pull"))
    assert allowed(node, "publish", s.files("n1", "pull"))  # its runner, for a file a start needs
    assert not allowed(client, "publish", s.files("n2", "pull"))
    assert allowed(node, "subscribe", s.files("n1", "pull"))
    assert not allowed(node, "subscribe", s.files("n2", "chunk"))
