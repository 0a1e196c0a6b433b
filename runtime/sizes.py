"""Byte sizes as people write them: `24GiB`, `8G`, `512MiB`, `1.5TiB`, `4096` (bytes).

Binary units (KiB, MiB, GiB, TiB) and their short forms (K, M, G, T) are powers of 1024; decimal units
(KB, MB, GB, TB) are powers of 1000. Anything else is refused with a message saying what is accepted.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TIB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_MAX = 1 << 62


def parse_size(text: str) -> int:
    """Parses one size into bytes; raises ValueError with the accepted forms."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with an optional unit, e.g. 24GiB, 8G, 512MiB")
    try:
        value = Decimal(match.group(1)) * _UNITS[unit]
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f"invalid size {text!r}") from exc
    if value != value.to_integral_value():
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    if value <= 0 or value > _MAX:
        raise ValueError(f"invalid size {text!r}: must be between 1 byte and 4 EiB")
    return int(value)


def format_size(n_bytes: int) -> str:
    """Formats bytes for people, in binary units with two decimals (`1.50 GiB`)."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
