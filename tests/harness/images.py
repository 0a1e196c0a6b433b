"""Images for multimodal requests (a chat content part carrying a picture)."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any


def png(width: int, height: int) -> bytes:
    """A small RGB PNG (a gradient): any size, since the projector resizes every image to its own."""
    rows = b"".join(
        b"\x00" + bytes((x * 7 + y * 3 + c * 50) % 256 for x in range(width) for c in range(3)) for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def image_part(width: int = 40, height: int = 24) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png(width, height)).decode()
    return {"type": "image_url", "image_url": {"url": url}}
