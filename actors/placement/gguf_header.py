"""Bounded, hostile-input-safe reader for GGUF headers (placement core).

This module owns turning the header of a GGUF file into facts: its key/values and its tensor infos, with
tensor bytes summed per layer (``blk.N.``) and for everything else. It never reads tensor data and never
materializes large arrays: a tokenizer's tokens, merges and scores are walked (lengths only) and returned as
``SkippedArray`` with their element count. Every count and length in the file is untrusted input, checked
against a ceiling (``HeaderLimits``) and against the bytes actually left in the file before anything is
allocated, so a malformed or hostile file costs bounded time and memory and fails with one error type,
``GGUFFormatError``, naming the absolute offset and the problem.

It is a pure core: it is fed a binary file object and the file size and does no other I/O; ``read_header`` is
the thin convenience that opens a path. The checks follow llama.cpp's own loader (``gguf.cpp``), so a header
accepted here is one the engine would accept too.
"""

from __future__ import annotations

import enum
import functools
import itertools
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import BinaryIO, Protocol

__all__ = [
    "DEFAULT_LIMITS",
    "GGUFFormatError",
    "GGUFHeader",
    "GGUFValueType",
    "HeaderLimits",
    "KVValue",
    "Scalar",
    "SkippedArray",
    "TensorInfo",
    "parse_header",
    "read_header",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
ARCHITECTURE_KEY = "general.architecture"
INT64_MAX = (1 << 63) - 1

# Reads are served from a window of at most this many bytes (or one string, if longer), so walking a
# 150k-entry string array costs a few dozen reads instead of 300k syscalls, and memory stays flat.
_CHUNK = 256 << 10

# Smallest possible encodings, used to refuse counts that cannot fit in what is left of the file
# before looping over them: a key/value is a key length (u64), a type (u32) and at least one value byte;
# a tensor info is a name length (u64), n_dims (u32), at least one dim (u64), a type (u32), an offset (u64).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8

_LAYER_NAME = re.compile(r"blk\.([0-9]+)\.")


class _StrPathLike(Protocol):
    """``os.PathLike[str]``, spelled structurally so this core does not import ``os``."""

    def __fspath__(self) -> str: ...


class GGUFFormatError(ValueError):
    """The file is not a GGUF header this reader accepts; ``offset`` is where the problem was found."""

    offset: int
    problem: str
    source: str

    def __init__(self, offset: int, problem: str, source: str = "gguf") -> None:
        # args mirror the constructor so the error pickles and copies faithfully.
        super().__init__(offset, problem, source)
        self.offset = offset
        self.problem = problem
        self.source = source

    def __str__(self) -> str:
        return f"{self.source}: offset {self.offset}: {self.problem}"


class GGUFValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


@dataclass(frozen=True, slots=True)
class SkippedArray:
    """An array that was counted and stepped over, not decoded (too long to be worth materializing)."""

    element_type: GGUFValueType
    count: int
    longest: int = 0  # of a string array: the longest element's length in bytes (read with the lengths)


Scalar = int | float | bool | str
KVValue = Scalar | tuple[Scalar, ...] | SkippedArray


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    ggml_type: int
    type_name: str  # e.g. "F32", "Q8_0"
    offset: int  # relative to the data section, as stored
    n_bytes: int


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    """Ceilings applied to every count and length before it is used."""

    max_kv: int = 65_536
    max_tensors: int = 1_000_000
    max_key_bytes: int = 65_536  # also bounds tensor names
    max_string_bytes: int = 16 << 20
    max_array_len: int = 1 << 28  # counted and skipped, never allocated
    max_dims: int = 4  # GGML_MAX_DIMS
    materialize_numeric_max: int = 16_384
    materialize_string_max: int = 256
    max_header_bytes: int = 1 << 30  # the kv + tensor-info region must end before this and before EOF

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"HeaderLimits.{name} must be a non-negative int, got {value!r}")


DEFAULT_LIMITS = HeaderLimits()


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    kv: Mapping[str, KVValue]
    tensors: tuple[TensorInfo, ...]
    alignment: int  # general.alignment, default 32, a power of two
    data_offset: int  # absolute offset of the tensor data section
    file_size: int
    source: str = field(default="gguf", compare=False)
    layer_tensor_bytes: Mapping[int, int] = field(init=False, repr=False)  # sum of n_bytes per blk index
    other_tensor_bytes: int = field(init=False, repr=False)  # tensors not under blk.N.
    total_tensor_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        per_layer: dict[int, int] = {}
        other = 0
        for t in self.tensors:
            m = _LAYER_NAME.match(t.name)
            if m is None:
                other += t.n_bytes
            else:
                layer = int(m.group(1))
                per_layer[layer] = per_layer.get(layer, 0) + t.n_bytes
        ordered = dict(sorted(per_layer.items()))
        object.__setattr__(self, "layer_tensor_bytes", MappingProxyType(ordered))
        object.__setattr__(self, "other_tensor_bytes", other)
        object.__setattr__(self, "total_tensor_bytes", other + sum(ordered.values()))

    @property
    def architecture(self) -> str:
        arch = self.kv.get(ARCHITECTURE_KEY)
        if arch is None:
            raise GGUFFormatError(0, f"missing {ARCHITECTURE_KEY}", self.source)
        if not isinstance(arch, str):
            raise GGUFFormatError(0, f"{ARCHITECTURE_KEY} is not a string: {arch!r}", self.source)
        return arch

    def get(self, key: str, default: KVValue | None = None) -> KVValue | None:
        return self.kv.get(key, default)

    def arch_key(self, suffix: str, default: KVValue | None = None) -> KVValue | None:
        """``kv[f"{architecture}.{suffix}"]``, e.g. ``arch_key("block_count")``."""
        return self.kv.get(f"{self.architecture}.{suffix}", default)


# Fixed-size value types: (struct code, size in bytes).
_FIXED: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("B", 1),
    GGUFValueType.INT8: ("b", 1),
    GGUFValueType.UINT16: ("H", 2),
    GGUFValueType.INT16: ("h", 2),
    GGUFValueType.UINT32: ("I", 4),
    GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4),
    GGUFValueType.BOOL: ("?", 1),
    GGUFValueType.UINT64: ("Q", 8),
    GGUFValueType.INT64: ("q", 8),
    GGUFValueType.FLOAT64: ("d", 8),
}
_FIXED_STRUCT = {t: struct.Struct("<" + code) for t, (code, _) in _FIXED.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@functools.cache
def _ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, block size in elements, bytes per block); ids gguf knows but cannot size are
    unknown. Read from the `gguf` package on the first header parsed: importing it imports numpy (a fifth of a
    second), which the command line's client commands never need."""
    import gguf

    return {
        int(t): (gguf.GGMLQuantizationType(t).name, int(block), int(size))
        for t, (block, size) in gguf.GGML_QUANT_SIZES.items()
    }


_VALUE_TYPES = frozenset(int(t) for t in GGUFValueType)


def _type_name(vtype: int) -> str:
    return GGUFValueType(vtype).name.lower()


class _Reader:
    """A cursor over the header region with bounded buffering; every read is checked before it is done."""

    def __init__(self, f: BinaryIO, file_size: int, limits: HeaderLimits, source: str) -> None:
        self.f = f
        self.file_size = file_size
        self.limits = limits
        self.source = source
        # Header reads may not go past EOF nor past the header ceiling; the error says which.
        self.end = min(file_size, limits.max_header_bytes)
        self.pos = 0
        self.buf = b""
        self.buf_start = 0

    def error(self, offset: int, problem: str) -> GGUFFormatError:
        return GGUFFormatError(offset, problem, self.source)

    def past_end(self, offset: int, what: str, need: int, reach: int | None = None) -> GGUFFormatError:
        """The error for ``need`` bytes of ``what`` (reported at ``offset``, ending at ``reach``) that run past
        the header region."""
        if (offset + need if reach is None else reach) > self.file_size:
            where = f"the end of the file ({self.file_size} bytes)"
        else:
            where = f"the header size limit ({self.limits.max_header_bytes} bytes)"
        return self.error(offset, f"{what}: needs {need} bytes, which runs past {where}")

    def check_room(self, need: int, what: str, at: int | None = None) -> None:
        if self.pos + need > self.end:
            raise self.past_end(self.pos if at is None else at, what, need, reach=self.pos + need)

    def fill(self, n: int, what: str) -> int:
        """Make ``n`` bytes at ``pos`` available in ``buf``; return their index in ``buf``."""
        i = self.pos - self.buf_start
        if i >= 0 and i + n <= len(self.buf):
            return i
        self.check_room(n, what)
        want = min(max(n, _CHUNK), self.end - self.pos)
        self.f.seek(self.pos)
        data = self.f.read(want)
        # Raw (unbuffered) files may return short reads; loop until we have what we need or hit EOF.
        while len(data) < n:
            more = self.f.read(want - len(data))
            if not more:
                raise self.error(
                    self.pos + len(data),
                    f"{what}: file ends after {self.pos + len(data)} bytes, shorter than its stated size "
                    f"{self.file_size}",
                )
            data += more
        self.buf = data
        self.buf_start = self.pos
        return 0

    def fixed(self, vtype: int, what: str) -> int | float | bool:
        s = _FIXED_STRUCT[vtype]
        i = self.fill(s.size, what)
        self.pos += s.size
        value: int | float | bool = s.unpack_from(self.buf, i)[0]
        return value

    def u32(self, what: str) -> int:
        i = self.fill(4, what)
        self.pos += 4
        value: int = _U32.unpack_from(self.buf, i)[0]
        return value

    def u64(self, what: str) -> int:
        i = self.fill(8, what)
        self.pos += 8
        value: int = _U64.unpack_from(self.buf, i)[0]
        return value

    def string(self, limit: int, what: str) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        if n > limit:
            raise self.error(start, f"{what}: length {n} exceeds the limit of {limit} bytes")
        if self.pos + n > self.end:
            raise self.past_end(start, f"{what} of length {n}", 8 + n)
        i = self.fill(n, what)
        raw = memoryview(self.buf)[i : i + n]
        data_start = self.pos
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise self.error(data_start + e.start, f"{what}: invalid UTF-8 ({e.reason})") from None

    def skip_strings(self, count: int, what: str) -> int:
        """Step over ``count`` strings reading only their lengths (each checked against limit and EOF); returns the
        longest length."""
        limit = self.limits.max_string_bytes
        end = self.end
        unpack = _U64.unpack_from
        pos = self.pos
        buf = self.buf
        base = self.buf_start
        longest = 0
        # The hot loop of the whole reader (a tokenizer has ~150k entries): locals only, no method calls
        # except when the 8-byte length is outside the current window.
        for k in range(count):
            i = pos - base
            if i < 0 or i + 8 > len(buf):
                self.pos = pos
                i = self.fill(8, f"{what}: element {k} length")
                buf = self.buf
                base = self.buf_start
            n = unpack(buf, i)[0]
            if n > limit:
                raise self.error(pos, f"{what}: element {k} length {n} exceeds the limit of {limit} bytes")
            if pos + 8 + n > end:
                raise self.past_end(pos, f"{what}: element {k} of length {n}", 8 + n)
            pos += 8 + n
            if n > longest:
                longest = n
        self.pos = pos
        return longest

    def value(self, vtype: int, key: str) -> KVValue:
        if vtype == GGUFValueType.STRING:
            return self.string(self.limits.max_string_bytes, f"value of {key!r}")
        if vtype in _FIXED:
            return self.fixed(vtype, f"value of {key!r}")
        # The caller checked vtype is known, so this is an array.
        return self.array(key)

    def array(self, key: str) -> KVValue:
        lim = self.limits
        type_at = self.pos
        etype = self.u32(f"element type of array {key!r}")
        if etype == GGUFValueType.ARRAY:
            # llama.cpp refuses arrays of arrays too; nothing in the format's users writes them.
            raise self.error(type_at, f"array {key!r}: nested arrays are not supported")
        if etype not in _FIXED and etype != GGUFValueType.STRING:
            raise self.error(type_at, f"array {key!r}: unknown element type {etype}")
        count_at = self.pos
        count = self.u64(f"element count of array {key!r}")
        what = f"array {key!r} of {count} {_type_name(etype)}"
        if count > lim.max_array_len:
            raise self.error(count_at, f"{what}: count exceeds the limit of {lim.max_array_len}")
        min_size = 8 if etype == GGUFValueType.STRING else _FIXED[etype][1]
        # Refuse before looping or allocating: every element takes at least min_size bytes.
        self.check_room(count * min_size, what, at=count_at)
        if etype == GGUFValueType.STRING:
            if count <= lim.materialize_string_max:
                return tuple(self.string(lim.max_string_bytes, f"{what}: element {k}") for k in range(count))
            longest = self.skip_strings(count, what)
            return SkippedArray(GGUFValueType(etype), count, longest)
        code, size = _FIXED[etype]
        n_bytes = count * size
        if count <= lim.materialize_numeric_max:
            i = self.fill(n_bytes, what)
            values: tuple[Scalar, ...] = struct.unpack_from(f"<{count}{code}", self.buf, i)
            self.pos += n_bytes
            return values
        self.pos += n_bytes  # room was checked above; the next read seeks past it
        return SkippedArray(GGUFValueType(etype), count)


def _read_kv(r: _Reader, n_kv: int) -> tuple[dict[str, KVValue], int]:
    kv: dict[str, KVValue] = {}
    alignment = DEFAULT_ALIGNMENT
    for k in range(n_kv):
        key_at = r.pos
        key = r.string(r.limits.max_key_bytes, f"key {k}")
        if key in kv:
            raise r.error(key_at, f"duplicate key {key!r}")
        type_at = r.pos
        vtype = r.u32(f"value type of {key!r}")
        if vtype not in _VALUE_TYPES:
            raise r.error(type_at, f"key {key!r}: unknown value type {vtype}")
        value_at = r.pos
        value = r.value(vtype, key)
        if key == ALIGNMENT_KEY:
            # llama.cpp reads it with gguf_get_val_u32, which aborts on any other type.
            if vtype != GGUFValueType.UINT32:
                raise r.error(type_at, f"{ALIGNMENT_KEY} must be uint32, got {_type_name(vtype)}")
            assert isinstance(value, int)
            if value <= 0 or value & (value - 1):
                raise r.error(value_at, f"{ALIGNMENT_KEY} = {value} is not a positive power of two")
            alignment = value
        kv[key] = value
    return kv, alignment


def _read_tensor_infos(r: _Reader, n_tensors: int, alignment: int) -> tuple[list[TensorInfo], list[int]]:
    """Tensor infos in file order, and for each the absolute offset of its stored data offset field."""
    lim = r.limits
    tensors: list[TensorInfo] = []
    offset_fields: list[int] = []
    seen: set[str] = set()
    for k in range(n_tensors):
        name_at = r.pos
        name = r.string(lim.max_key_bytes, f"tensor {k} name")
        if name in seen:
            raise r.error(name_at, f"duplicate tensor name {name!r}")
        seen.add(name)
        dims_at = r.pos
        n_dims = r.u32(f"tensor {name!r} n_dims")
        if n_dims == 0 or n_dims > lim.max_dims:
            raise r.error(dims_at, f"tensor {name!r}: n_dims {n_dims} is not in 1..{lim.max_dims}")
        shape: list[int] = []
        n_elements = 1
        for d in range(n_dims):
            dim_at = r.pos
            dim = r.u64(f"tensor {name!r} dimension {d}")
            if dim == 0:
                raise r.error(dim_at, f"tensor {name!r}: dimension {d} is 0")
            n_elements *= dim
            # Checked per dimension so a lying shape fails at the field that made it overflow.
            if n_elements > INT64_MAX:
                raise r.error(dim_at, f"tensor {name!r}: element count of shape {[*shape, dim]} overflows int64")
            shape.append(dim)
        type_at = r.pos
        ggml_type = r.u32(f"tensor {name!r} type")
        known = _ggml_types().get(ggml_type)
        if known is None:
            raise r.error(type_at, f"tensor {name!r}: unknown ggml type {ggml_type}")
        type_name, block, type_size = known
        # llama.cpp requires whole blocks per row (ne0), which implies whole blocks overall.
        if shape[0] % block:
            raise r.error(
                dims_at + 4,
                f"tensor {name!r}: row of {shape[0]} elements is not a multiple of the {type_name} block size {block}",
            )
        offset_at = r.pos
        offset = r.u64(f"tensor {name!r} data offset")
        if offset % alignment:
            raise r.error(offset_at, f"tensor {name!r}: data offset {offset} is not aligned to {alignment}")
        n_bytes = n_elements // block * type_size
        tensors.append(TensorInfo(name, tuple(shape), ggml_type, type_name, offset, n_bytes))
        offset_fields.append(offset_at)
    return tensors, offset_fields


def _check_data_regions(r: _Reader, tensors: list[TensorInfo], offset_fields: list[int], data_offset: int) -> None:
    for t, at in zip(tensors, offset_fields, strict=True):
        end = data_offset + t.offset + t.n_bytes
        if end > r.file_size:
            raise r.error(
                at,
                f"tensor {t.name!r}: data [{data_offset + t.offset}, {end}) runs past the end of the file "
                f"({r.file_size} bytes)",
            )
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].offset)
    for prev_i, next_i in itertools.pairwise(order):
        prev, nxt = tensors[prev_i], tensors[next_i]
        if nxt.offset < prev.offset + prev.n_bytes:
            raise r.error(
                offset_fields[next_i],
                f"tensor {nxt.name!r}: data at relative offset {nxt.offset} overlaps tensor {prev.name!r} "
                f"[{prev.offset}, {prev.offset + prev.n_bytes})",
            )


def parse_header(
    f: BinaryIO, file_size: int, *, limits: HeaderLimits = DEFAULT_LIMITS, source: str = "gguf"
) -> GGUFHeader:
    """Parse the GGUF header of ``f`` (a seekable binary file of ``file_size`` bytes)."""
    if file_size < 0:
        raise ValueError(f"file_size must be non-negative, got {file_size}")
    r = _Reader(f, file_size, limits, source)

    if r.end < 4:
        raise r.error(0, f"file of {file_size} bytes is too short to be GGUF")
    i = r.fill(4, "magic")
    magic = r.buf[i : i + 4]
    if magic != GGUF_MAGIC:
        raise r.error(0, f"bad magic {magic!r}, expected {GGUF_MAGIC!r}")
    r.pos = 4
    version = r.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = ""
        if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
            hint = " (a big-endian file; only little-endian GGUF is supported)"
        elif version == 1:
            hint = " (GGUF v1 is obsolete)"
        raise r.error(4, f"unsupported version {version}{hint}; supported: 2, 3")

    n_tensors = r.u64("tensor count")
    n_kv = r.u64("key/value count")
    if n_tensors > limits.max_tensors:
        raise r.error(8, f"tensor count {n_tensors} exceeds the limit of {limits.max_tensors}")
    if n_kv > limits.max_kv:
        raise r.error(16, f"key/value count {n_kv} exceeds the limit of {limits.max_kv}")
    r.check_room(n_tensors * _MIN_TENSOR_INFO_BYTES, f"{n_tensors} tensor infos", at=8)
    r.check_room(
        n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES,
        f"{n_kv} key/values followed by {n_tensors} tensor infos",
        at=16,
    )

    kv, alignment = _read_kv(r, n_kv)
    tensors, offset_fields = _read_tensor_infos(r, n_tensors, alignment)
    data_offset = -(-r.pos // alignment) * alignment
    _check_data_regions(r, tensors, offset_fields, data_offset)

    return GGUFHeader(
        version=version,
        kv=MappingProxyType(kv),
        tensors=tuple(tensors),
        alignment=alignment,
        data_offset=data_offset,
        file_size=file_size,
        source=source,
    )


def read_header(path: str | _StrPathLike, *, limits: HeaderLimits = DEFAULT_LIMITS) -> GGUFHeader:
    """Open ``path`` and parse its header; the error names the file."""
    with open(path, "rb") as f:
        file_size = f.seek(0, 2)  # 2 = SEEK_END
        return parse_header(f, file_size, limits=limits, source=str(f.name))
