"""GGUF headers built in memory, byte for byte."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gguf

from actors.placement.gguf_header import (
    GGUFValueType,
)

T = GGUFValueType


Q = gguf.GGMLQuantizationType


_PACK = {
    T.UINT8: "<B",
    T.INT8: "<b",
    T.UINT16: "<H",
    T.INT16: "<h",
    T.UINT32: "<I",
    T.INT32: "<i",
    T.FLOAT32: "<f",
    T.BOOL: "<?",
    T.UINT64: "<Q",
    T.INT64: "<q",
    T.FLOAT64: "<d",
}


def tensor_nbytes(shape: Sequence[int], ggml_type: int) -> int:
    sizes = gguf.GGML_QUANT_SIZES.get(Q(ggml_type)) if ggml_type in Q._value2member_map_ else None
    if sizes is None:
        return 0
    block, type_size = sizes
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


@dataclass
class Built:
    data: bytes
    header_end: int  # end of the tensor infos
    data_offset: int
    at: dict[str, int]  # field name -> absolute offset, e.g. "kv:general.alignment:type"
    counts: list[int] = field(default_factory=list)  # offsets of u64 count / length / dim fields
    types: list[int] = field(default_factory=list)  # offsets of u32 type / n_dims fields
    strings: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) of string bytes


@dataclass
class _KV:
    key: str | bytes
    vtype: int
    value: Any
    etype: int | None
    raw: bytes | None


@dataclass
class _Tensor:
    name: str | bytes
    shape: tuple[int, ...]  # ggml order
    ggml_type: int
    offset: int | None
    n_dims: int | None


class HeaderBuilder:
    """Encodes a GGUF file field by field, so tests can lie in any one of them."""

    def __init__(self, *, magic: bytes = b"GGUF", version: int = 3, arch: str | None = "llama") -> None:
        self.magic = magic
        self.version = version
        self.alignment = 32
        self._kv: list[_KV] = []
        self._tensors: list[_Tensor] = []
        if arch is not None:
            self.kv("general.architecture", T.STRING, arch)

    def kv(self, key: str | bytes, vtype: int, value: Any, etype: int | None = None) -> HeaderBuilder:
        self._kv.append(_KV(key, vtype, value, etype, None))
        if key == "general.alignment" and vtype == T.UINT32 and value > 0 and not value & (value - 1):
            self.alignment = value
        return self

    def kv_raw(self, key: str | bytes, raw: bytes) -> HeaderBuilder:
        """A key followed by arbitrary bytes where its type and value belong."""
        self._kv.append(_KV(key, 0, None, None, raw))
        return self

    def tensor(
        self,
        name: str | bytes,
        shape: Sequence[int],
        ggml_type: int = Q.F32,
        *,
        offset: int | None = None,
        n_dims: int | None = None,
    ) -> HeaderBuilder:
        self._tensors.append(_Tensor(name, tuple(shape), ggml_type, offset, n_dims))
        return self

    def build(self, *, n_kv: int | None = None, n_tensors: int | None = None, data_size: int | None = None) -> Built:
        out = bytearray()
        b = Built(b"", 0, 0, {})

        def u32(v: int, name: str | None = None, kind: str = "type") -> None:
            if name:
                b.at[name] = len(out)
            if kind == "type":
                b.types.append(len(out))
            out.extend(struct.pack("<I", v))

        def u64(v: int, name: str | None = None) -> None:
            if name:
                b.at[name] = len(out)
            b.counts.append(len(out))
            out.extend(struct.pack("<Q", v))

        def string(s: str | bytes, name: str | None = None) -> None:
            raw = s.encode() if isinstance(s, str) else s
            u64(len(raw), name)
            b.strings.append((len(out), len(raw)))
            out.extend(raw)

        def scalar(vtype: int, value: Any) -> None:
            if vtype == T.STRING:
                string(value)
            else:
                out.extend(struct.pack(_PACK[T(vtype)], value))

        out += self.magic
        u32(self.version, "version", kind="version")
        u64(len(self._tensors) if n_tensors is None else n_tensors, "n_tensors")
        u64(len(self._kv) if n_kv is None else n_kv, "n_kv")
        for e in self._kv:
            k = e.key if isinstance(e.key, str) else e.key.decode("latin-1")
            string(e.key, f"kv:{k}:key")
            if e.raw is not None:
                b.at[f"kv:{k}:type"] = len(out)
                out += e.raw
                continue
            u32(e.vtype, f"kv:{k}:type")
            b.at[f"kv:{k}:value"] = len(out)
            if e.vtype == T.ARRAY:
                assert e.etype is not None
                u32(e.etype, f"kv:{k}:etype")
                u64(len(e.value), f"kv:{k}:count")
                for i, item in enumerate(e.value):
                    b.at[f"kv:{k}:{i}"] = len(out)
                    scalar(e.etype, item)
            else:
                scalar(e.vtype, e.value)
        next_offset = 0
        data_end = 0
        for t in self._tensors:
            n = t.name if isinstance(t.name, str) else t.name.decode("latin-1")
            string(t.name, f"t:{n}:name")
            u32(len(t.shape) if t.n_dims is None else t.n_dims, f"t:{n}:n_dims")
            for d, dim in enumerate(t.shape):
                u64(dim, f"t:{n}:dim{d}")
            u32(t.ggml_type, f"t:{n}:type")
            offset = next_offset if t.offset is None else t.offset
            u64(offset, f"t:{n}:offset")
            nbytes = tensor_nbytes(t.shape, t.ggml_type)
            next_offset = gguf.GGUFWriter.ggml_pad(offset + nbytes, self.alignment)
            data_end = max(data_end, offset + nbytes)
        b.header_end = len(out)
        b.data_offset = gguf.GGUFWriter.ggml_pad(len(out), self.alignment)
        if self._tensors or data_size is not None:
            out.extend(bytes(b.data_offset - len(out)))
            size = gguf.GGUFWriter.ggml_pad(data_end, self.alignment) if data_size is None else data_size
            out.extend(bytes(size))
        b.data = bytes(out)
        return b
