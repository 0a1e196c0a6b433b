"""JSON as llama-server writes it (runner core, pure): `dump_json` is its `json::dump()`, byte for byte.

llama-server writes JSON with nlohmann's library (vendored in the pinned build, wrapped by common/json.h). Where
the server writes a string the chat template then renders, the mesh has to write the same string to render the
same prompt: a Messages `tool_use` block's `input` becomes a tool call's `arguments` that way
(`chat_shapes.anthropic_to_chat`).

Rules this module keeps:

* Objects keep their keys in the order they came (the server's JSON is ordered); no whitespace; strings escape
  only `"`, `\\` and control characters (`\\u00xx` in lower case), never other non-ASCII.
* Integers within int64 and uint64 are written as they are; the parser reads any other as a double.
* A double is written with the digits nlohmann's Grisu2 finds (`_grisu2`, ported from its `dtoa_impl`): they
  read back to the same double but are not always the shortest that do (Python's `repr` gives the shortest,
  and differs for about one double in 250), placed as its `format_buffer` places them: fixed notation while
  the point falls within 15 digits before or 4 zeros after, else `d.ddde+XX`.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Final

__all__ = ["dump_json"]

#: The integers nlohmann's parser keeps as integers (int64 and uint64); others it reads as doubles.
_INT_MIN: Final = -(1 << 63)
_INT_MAX: Final = (1 << 64) - 1

# ---- Grisu2 (nlohmann's dtoa_impl; Florian Loitsch, "Printing floating-point numbers quickly and accurately")

_ALPHA: Final = -60  # the exponent range digit generation works in
_MASK64: Final = (1 << 64) - 1


@functools.cache
def _cached_power(index: int) -> tuple[int, int, int]:
    """10**k as a 64-bit significand f and a binary exponent e (f * 2**e, rounded to nearest), k = -300 + 8 *
    index: the entries of nlohmann's `kCachedPowers`, computed exactly rather than listed."""
    k = -300 + 8 * index
    value = Fraction(10) ** k
    e = value.numerator.bit_length() - value.denominator.bit_length() - 64
    while value / Fraction(2) ** e >= 1 << 64:
        e += 1
    while value / Fraction(2) ** e < 1 << 63:
        e -= 1
    return round(value / Fraction(2) ** e), e, k


def _mul(x: int, y: int) -> int:
    """The upper 64 bits of a 64 x 64-bit product, rounded (ties up)."""
    return (x * y + (1 << 63)) >> 64


def _normalized(f: int, e: int) -> tuple[int, int]:
    shift = 64 - f.bit_length()
    return f << shift, e - shift


def _grisu2(value: float) -> tuple[str, int]:
    """The digits of a finite positive double and their decimal exponent (value ~ digits * 10**exponent)."""
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    biased, fraction = bits >> 52, bits & ((1 << 52) - 1)
    f, e = (fraction, -1074) if biased == 0 else (fraction + (1 << 52), biased - 1075)
    plus_f, plus_e = _normalized(2 * f + 1, e - 1)
    minus_f, minus_e = (4 * f - 1, e - 2) if fraction == 0 and biased > 1 else (2 * f - 1, e - 1)
    minus_f <<= minus_e - plus_e
    w_f, _ = _normalized(f, e)  # the same exponent as the boundaries
    # scale by a cached power of ten so that the product's exponent falls in [alpha, gamma]
    t = _ALPHA - plus_e - 1
    k = (abs(t) * 78913 >> 18) * (1 if t >= 0 else -1) + (t > 0)  # C's division: towards zero
    c_f, c_e, c_k = _cached_power((300 + k + 7) // 8)
    one = -(c_e + plus_e + 64)  # -e of the scaled numbers: 32..60
    w = _mul(w_f, c_f)
    low = _mul(minus_f, c_f) + 1
    high = _mul(plus_f, c_f) - 1
    return _digit_gen(low, w, high, one, -c_k)


def _digit_gen(low: int, w: int, high: int, one: int, exponent: int) -> tuple[str, int]:
    """Grisu2's digit generation: the digits of a number in [low, high] close to w, all scaled by 2**-one."""
    delta, dist = high - low, high - w
    p1, p2 = high >> one, high & ((1 << one) - 1)
    digits: list[int] = []
    n = len(str(p1))
    pow10 = 10 ** (n - 1)
    while n > 0:
        d, p1 = divmod(p1, pow10)
        digits.append(d)
        n -= 1
        rest = (p1 << one) + p2
        if rest <= delta:
            _round(digits, dist, delta, rest, pow10 << one)
            return "".join(map(str, digits)), exponent + n
        pow10 //= 10
    m = 0
    while True:
        p2 *= 10
        digits.append(p2 >> one)
        p2 &= (1 << one) - 1
        m += 1
        delta, dist = (delta * 10) & _MASK64, (dist * 10) & _MASK64  # uint64, as in the original
        if p2 <= delta:
            break
    _round(digits, dist, delta, p2, 1 << one)
    return "".join(map(str, digits)), exponent - m


def _round(digits: list[int], dist: int, delta: int, rest: int, ten_k: int) -> None:
    """Moves the last digit down while that brings the number closer to w and keeps it within the bounds."""
    while rest < dist and delta - rest >= ten_k and (rest + ten_k < dist or dist - rest > rest + ten_k - dist):
        digits[-1] -= 1
        rest += ten_k


def _number(value: float) -> str:
    """A double as nlohmann writes it (`to_chars`); non-finite ones as `null`, as its serializer does."""
    if not math.isfinite(value):
        return "null"
    sign = "-" if math.copysign(1.0, value) < 0 else ""
    if value == 0:
        return sign + "0.0"
    digits, exponent = _grisu2(abs(value))
    k = len(digits)
    n = k + exponent  # where the decimal point falls, counted from the first digit
    if k <= n <= 15:
        text = digits + "0" * (n - k) + ".0"
    elif 0 < n <= 15:
        text = digits[:n] + "." + digits[n:]
    elif -4 < n <= 0:
        text = "0." + "0" * -n + digits
    else:
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        e = n - 1
        text = f"{mantissa}e{'-' if e < 0 else '+'}{abs(e):02d}"
    return sign + text


# ---- values ----------------------------------------------------------------------------------------------


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value) if _INT_MIN <= value <= _INT_MAX else _number(float(value))
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # the same escapes, and \u00xx in lower case
    raise TypeError(f"not a JSON value: {type(value).__name__}")


class _Text(str):
    """Output written as it is (punctuation and keys), among the values still to write."""


def dump_json(value: Any) -> str:
    """`value` as llama-server's `json::dump()` writes it. Iterative: a body nested as deeply as a decoder
    allows is written without running out of stack."""
    out: list[str] = []
    todo: list[Any] = [value]  # a stack: what is written next is on top
    while todo:
        item = todo.pop()
        if isinstance(item, _Text):
            out.append(item)
        elif isinstance(item, Mapping):
            todo.append(_Text("}"))
            items = list(item.items())
            for i, (key, child) in enumerate(reversed(items)):
                todo.append(child)
                todo.append(
                    _Text(("" if i == len(items) - 1 else ",") + json.dumps(str(key), ensure_ascii=False) + ":")
                )
            todo.append(_Text("{"))
        elif isinstance(item, list | tuple):
            todo.append(_Text("]"))
            for i, child in enumerate(reversed(item)):
                todo.append(child)
                if i != len(item) - 1:
                    todo.append(_Text(","))
            todo.append(_Text("["))
        else:
            out.append(_scalar(item))
    return "".join(out)
