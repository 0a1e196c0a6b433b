"""The token ids a saved slot state holds, read from the head of its file (runner shell: reads a file).

llama.cpp's `llama_state_seq_save_file` writes, little-endian: the magic `ggsq` (u32), the format version
(u32, 4 in the pinned build), a count of 32-bit words (u32) and those words, then the state itself. llama-server
packs its slot's prompt into the words (`server_tokens::serialize`): a -1 marker, its own version (u32, 1), the
token ids (a u32 count, then i32 each), the positions of media chunks (a u32 count, then u32 each), then the
media chunks; words without the marker are a plain list of token ids (older servers). A media chunk's positions
hold no token id (llama.cpp's LLAMA_TOKEN_NULL, -1), so -1 is read as such a position when the file lists media
and refused otherwise. A pass-through's tokens are rendered by the server, so after its completion the file is
the one exact record of what the slot holds: the capture is indexed by it, and a state holding media (an image)
is not captured at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from pathlib import Path
from typing import BinaryIO, Final, NamedTuple

__all__ = ["PAYLOAD_KIND", "SaveFailed", "SlotTokens", "StateFileError", "remove_file", "state_tokens"]

#: The kind of payload L3 stores for these files (part of a state's identity).
PAYLOAD_KIND: Final = "llama_slot"

MAGIC: Final = 0x67677371  # "ggsq"
#: What a media chunk's positions hold in the token list (llama.cpp's LLAMA_TOKEN_NULL).
MEDIA_POSITION: Final = -1
VERSION: Final = 4
SERVER_TOKENS_VERSION: Final = 1
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<III")


class SlotTokens(NamedTuple):
    tokens: list[int]  # with MEDIA_POSITION where a media chunk's tokens are
    media: int  # media chunks (images, audio) among them


class SaveFailed(Exception):
    """A slot could not be saved (`kind`: the log event, save_failed or save_mismatch)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def remove_file(path: Path) -> None:
    with contextlib.suppress(OSError):
        await asyncio.to_thread(path.unlink, missing_ok=True)


class StateFileError(Exception):
    """The file is not a slot state this build wrote, or is cut short."""


def state_tokens(path: Path, *, max_tokens: int) -> SlotTokens:
    """The token ids at the head of the state file at `path` (at most `max_tokens`: every count is checked
    against it before anything is read)."""
    with path.open("rb") as f:
        magic, version, n_words = _unpack(f, _HEAD, path)
        if magic != MAGIC or version != VERSION:
            raise StateFileError(f"{path.name}: not a slot state of format {VERSION} (magic {magic:#x}, v{version})")
        if n_words == 0:
            return SlotTokens([], 0)
        (first,) = _unpack(f, _U32, path)
        if first != 0xFFFFFFFF:  # a plain list of token ids
            return SlotTokens([first, *_ids(f, n_words - 1, max_tokens, path)], 0)
        (packing,) = _unpack(f, _U32, path)
        if packing != SERVER_TOKENS_VERSION:
            raise StateFileError(f"{path.name}: server tokens of version {packing}, not {SERVER_TOKENS_VERSION}")
        (n_tokens,) = _unpack(f, _U32, path)
        tokens = _ids(f, n_tokens, max_tokens, path, media=True)
        (n_media,) = _unpack(f, _U32, path)
    if not n_media and MEDIA_POSITION in tokens:
        raise StateFileError(f"{path.name}: a media position in a state that lists no media")
    return SlotTokens(tokens, n_media)


def _unpack(f: BinaryIO, layout: struct.Struct, path: Path) -> tuple[int, ...]:
    data = f.read(layout.size)
    if len(data) < layout.size:
        raise StateFileError(f"{path.name}: cut short in its head")
    return layout.unpack(data)


def _ids(f: BinaryIO, n: int, max_tokens: int, path: Path, *, media: bool = False) -> list[int]:
    """`n` token ids; with `media`, also the media chunks' positions (MEDIA_POSITION), which only the server's
    own packing has."""
    if n > max_tokens:
        raise StateFileError(f"{path.name}: {n} tokens, over the ceiling of {max_tokens}")
    data = f.read(4 * n)
    if len(data) < 4 * n:
        raise StateFileError(f"{path.name}: cut short inside its {n} token ids")
    tokens = list(struct.unpack(f"<{n}i", data))
    lowest = MEDIA_POSITION if media else 0
    if any(t < lowest for t in tokens):
        raise StateFileError(f"{path.name}: a negative token id")
    return tokens
