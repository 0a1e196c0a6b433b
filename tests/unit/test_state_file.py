"""The head of a slot state file: the token ids a slot holds, and whether media (an image) is among them.

Files are written here in llama.cpp's layout (`llama_state_seq_save_file` around `server_tokens::serialize`);
`tests/e2e/test_companions.py` reads the file of a real image prompt.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from actors.runner.state_file import MAGIC, MEDIA_POSITION, VERSION, SlotTokens, StateFileError, state_tokens


def _file(path: Path, words: list[int]) -> Path:
    path.write_bytes(struct.pack("<III", MAGIC, VERSION, len(words)) + struct.pack(f"<{len(words)}i", *words) + b"KV")
    return path


def _packed(tokens: list[int], media_at: list[int]) -> list[int]:
    """The server's packing: the marker, its version, the tokens, the media positions, a chunk per media."""
    chunks = [w for _ in media_at for w in (2, 0x41414141, 0x42424242)]  # each chunk a length and its words
    return [-1, 1, len(tokens), *tokens, len(media_at), *media_at, *chunks]


def test_a_plain_list_and_the_servers_packing_read_as_token_ids(tmp_path: Path) -> None:
    assert state_tokens(_file(tmp_path / "a", [5, 6, 7]), max_tokens=10) == SlotTokens([5, 6, 7], 0)
    assert state_tokens(_file(tmp_path / "b", _packed([1, 2, 3], [])), max_tokens=10) == SlotTokens([1, 2, 3], 0)


def test_an_image_prompt_lists_its_media_and_its_positions(tmp_path: Path) -> None:
    image = [MEDIA_POSITION] * 4  # an image's tokens hold no id
    path = _file(tmp_path / "img", _packed([1, 2, *image, 3], [2]))
    assert state_tokens(path, max_tokens=10) == SlotTokens([1, 2, *image, 3], 1)


@pytest.mark.parametrize(
    ("words", "problem"),
    [
        (_packed([1, MEDIA_POSITION], []), "media position in a state that lists no media"),
        (_packed([1, -2], [1]), "negative token id"),
        ([1, MEDIA_POSITION], "negative token id"),  # a plain list has no media
        (_packed(list(range(11)), []), "over the ceiling"),
    ],
)
def test_what_no_server_writes_is_refused(tmp_path: Path, words: list[int], problem: str) -> None:
    with pytest.raises(StateFileError, match=problem):
        state_tokens(_file(tmp_path / "bad", words), max_tokens=10)
