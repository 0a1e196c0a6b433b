"""The decisions of a model-file transfer (pure): names, chunk plan, resume, verification, refusals.

Everything that decides whether bytes a peer sent may become a model file lives here; the shell (`actor`,
`part`) only reads, writes and asks. The rules:

* A file is named by the fetching node's own catalog or a signed registry entry, as a name relative to its
  models dir (`check_relative`): never absolute, never `..`, never a name a peer chose.
* The whole file's blake3 is the one digest that decides (a registry entry's signed digest, else the one the
  holding peers state). Each chunk also travels with the blake3 its server computed from the bytes it read
  (`check_chunk`): a chunk that does not match it, or arrives at another offset, size or total than asked, is
  refused at once; that catches a torn read or a corrupted chunk early but proves nothing about the file, since
  the same peer stated it. At the end the whole file must hash to the expected digest (`final_refusal`), or it
  is refused and deleted. (blake3's tree mode could verify each chunk against the root alone, but the Python
  binding exposes no subtree hashing; per-chunk hashes plus the whole-file check is what is sound here.)
* Bytes land in a temporary file beside the destination, named from the digest (`part_name`), with a journal of
  the chunk hashes written (`journal_name`, `journal_header`, `parse_journal`). An interrupted fetch resumes from
  the longest prefix of whole chunks whose bytes, re-hashed from disk, equal what the journal recorded
  (`verified_chunks`): a torn write is fetched again, nothing verified is. Only a verified whole file is renamed
  to the destination.
* Before any byte is fetched the destination's file system must hold what is still missing, plus what the node
  keeps free, plus what the other pulls in flight on it have still to write (`space_refusal`): each pull
  reserves the bytes it will write until it ends, so two pulls never both count the same free bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

__all__ = [
    "JOURNAL_MAGIC",
    "MAX_JOURNAL_BYTES",
    "MIN_CHUNK_BYTES",
    "Holder",
    "Source",
    "TransferReason",
    "TransferRefusal",
    "check_chunk",
    "check_relative",
    "choose_source",
    "chunk_bytes",
    "chunk_plan",
    "final_refusal",
    "journal_header",
    "journal_name",
    "parse_journal",
    "part_name",
    "space_refusal",
    "verified_chunks",
]

#: The smallest chunk (a bus with a tiny `max_payload` still moves files, slowly).
MIN_CHUNK_BYTES: Final = 4096
#: Room left in a chunk reply for its headers (ours and the server's).
_HEADER_ROOM: Final = 4096
#: The journal of a part file: one header line, then one blake3 per chunk; a file of any size fits this.
MAX_JOURNAL_BYTES: Final = 64 << 20
JOURNAL_MAGIC: Final = "mesh-actor-part 1"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class TransferReason(StrEnum):
    """Why a transfer was refused (`details.reason` of the error reply)."""

    NOT_NAMED = "not_named"  # no catalog model or registry entry of that name, or the file is not one of theirs
    BAD_NAME = "bad_name"  # the name is absolute, climbs out of the models dir, or cannot be a file name
    NO_PEER = "no_peer"  # no live node holds the file
    NO_SPACE = "no_space"  # the models dir's file system cannot take it
    CHUNK_REFUSED = "chunk_refused"  # a chunk did not match its own hash, offset, size or total
    DIGEST_MISMATCH = "digest_mismatch"  # the whole file does not hash to the expected digest
    SIZE_MISMATCH = "size_mismatch"  # the peer states another size than the expected one
    PEER_FAILED = "peer_failed"  # the peer stopped answering or answered an error (the part is kept to resume)


@dataclass(frozen=True, slots=True)
class TransferRefusal:
    reason: TransferReason
    detail: str

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Holder:
    """A peer's answer: it holds the file at that size and digest."""

    node: str
    size: int
    digest: str


@dataclass(frozen=True, slots=True)
class Source:
    """What to fetch and from whom, in the order to try."""

    digest: str
    size: int
    peers: tuple[str, ...]


def choose_source(
    holders: Sequence[Holder], *, digest: str | None = None, size: int | None = None
) -> Source | TransferRefusal:
    """The file to fetch: the expected `digest` (and `size`) where known (a signed registry entry), else the
    version most holders state (ties: the smallest digest, so every node picks the same); its holders in node
    order. Holders of another version are never asked for bytes."""
    if digest is not None:
        matching = [h for h in holders if h.digest == digest and (size is None or h.size == size)]
        if not matching:
            stated = sorted({h.digest[:16] for h in holders})
            other = f" (peers hold {', '.join(stated)})" if stated else ""
            return TransferRefusal(
                TransferReason.NO_PEER, f"no live node holds the file with blake3 {digest[:16]}…{other}"
            )
        return Source(digest, matching[0].size, tuple(sorted(h.node for h in matching)))
    if not holders:
        return TransferRefusal(TransferReason.NO_PEER, "no live node holds the file")
    versions: dict[tuple[str, int], list[str]] = {}
    for h in holders:
        versions.setdefault((h.digest, h.size), []).append(h.node)
    (best_digest, best_size), nodes = min(versions.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return Source(best_digest, best_size, tuple(sorted(nodes)))


def chunk_bytes(max_payload: int) -> int:
    """The most bytes one chunk reply carries on a bus with this `max_payload`."""
    return max(MIN_CHUNK_BYTES, max_payload - _HEADER_ROOM)


def check_relative(name: str) -> TransferRefusal | None:
    """Whether `name` can be a file inside a models dir: relative, no `..`, no empty or NUL parts."""
    if not name or "\x00" in name or len(name.encode("utf-8", errors="surrogateescape")) > 1024:
        return TransferRefusal(TransferReason.BAD_NAME, "the file name is empty, too long or contains a NUL byte")
    if name.startswith("/"):
        return TransferRefusal(
            TransferReason.BAD_NAME, f"{name!r} is absolute: only names inside the models dir travel"
        )
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return TransferRefusal(TransferReason.BAD_NAME, f"{name!r} is not a plain relative name inside the models dir")
    return None


def part_name(file_name: str, digest: str) -> str:
    """The temporary file beside the destination (its last name part `file_name`), from the expected digest:
    a later pull of the same file finds it; one of another version does not."""
    return f".{file_name}.{digest[:16]}.part"


def journal_name(file_name: str, digest: str) -> str:
    return part_name(file_name, digest) + ".chunks"


def journal_header(digest: str, size: int, chunk: int) -> str:
    return f"{JOURNAL_MAGIC} {digest} {size} {chunk}\n"


def parse_journal(text: str, digest: str, size: int) -> tuple[int, list[str]] | None:
    """The chunk size and chunk hashes a part's journal recorded for this file (`digest`, `size`); None when it
    is another file's, another format, or unreadable (the part is then started over). A last line that was
    being written when the fetch stopped is dropped."""
    lines = text.split("\n")
    head = lines[0].split(" ")
    if len(head) != 5 or " ".join(head[:2]) != JOURNAL_MAGIC or head[2] != digest or head[3] != str(size):
        return None
    try:
        chunk = int(head[4])
    except ValueError:
        return None
    if chunk < 1:
        return None
    hashes: list[str] = []
    for line in lines[1:]:
        if not _DIGEST.match(line):
            break
        hashes.append(line)
    return chunk, hashes[: -(-size // chunk)]


def chunk_plan(size: int, chunk: int, start: int = 0) -> list[tuple[int, int]]:
    """(offset, length) of every chunk from `start` (a multiple of `chunk`) to the end of a file of `size`."""
    if chunk < 1 or start < 0 or start % chunk:
        raise ValueError(f"a plan needs a positive chunk and a start on a chunk boundary (got {chunk}, {start})")
    return [(offset, min(chunk, size - offset)) for offset in range(start, size, chunk)]


def verified_chunks(recorded: Sequence[str], observed: Sequence[str]) -> int:
    """How many chunks from the start hold what the journal recorded (the bytes re-hashed from disk)."""
    n = 0
    for want, got in zip(recorded, observed, strict=False):
        if want != got:
            break
        n += 1
    return n


def check_chunk(
    *,
    offset: int,
    length: int,
    total: int,
    got_offset: int,
    got_total: int,
    got_length: int,
    stated: str,
    observed: str,
) -> TransferRefusal | None:
    """A chunk reply against what was asked (its offset, the file's size, the chunk's length) and against the
    blake3 its server stated for it."""
    if got_offset != offset or got_total != total:
        return TransferRefusal(
            TransferReason.CHUNK_REFUSED, f"a chunk at {got_offset} of {got_total}, asked {offset} of {total}"
        )
    if got_length != length:
        return TransferRefusal(
            TransferReason.CHUNK_REFUSED, f"a chunk of {got_length} bytes at {offset}, asked {length}"
        )
    if stated != observed:
        return TransferRefusal(
            TransferReason.CHUNK_REFUSED, f"the chunk at {offset} does not hash to the blake3 sent with it"
        )
    return None


def space_refusal(
    *, free_bytes: int, need_bytes: int, keep_free_bytes: int, owed_bytes: int = 0
) -> TransferRefusal | None:
    """Whether the destination's file system can take `need_bytes` more and still keep `keep_free_bytes`, beside
    the `owed_bytes` that pulls in flight on it have still to write (free now, but already promised)."""
    if need_bytes + keep_free_bytes + owed_bytes > free_bytes:
        keep = f" and keep {keep_free_bytes} free" if keep_free_bytes else ""
        owed = f", {owed_bytes} of them owed to pulls in flight" if owed_bytes else ""
        return TransferRefusal(
            TransferReason.NO_SPACE, f"needs {need_bytes} bytes{keep}; the file system has {free_bytes} free{owed}"
        )
    return None


def final_refusal(*, digest: str, size: int, observed: str, received: int) -> TransferRefusal | None:
    """The whole file against the expected digest and size: anything else is refused (and deleted)."""
    if received != size:
        return TransferRefusal(TransferReason.DIGEST_MISMATCH, f"{received} bytes arrived of {size}")
    if observed != digest:
        return TransferRefusal(
            TransferReason.DIGEST_MISMATCH, f"the file hashes to {observed[:16]}…, expected {digest[:16]}…"
        )
    return None
