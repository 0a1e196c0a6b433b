"""llama-server allocation log parsing (runner core).

This module owns reading what llama-server says it allocated: model buffers per buffer type (the model's, and a
draft model's, which the server loads second), and for each
llama context it creates (the serving context first, then an MTP/draft context if any) its resolved
parameters (n_ctx, n_ctx_seq, n_seq_max, n_ubatch, n_rs_seq, …), its KV caches (one line per cache; a
sliding-window model has a non-SWA and a SWA cache), its recurrent state, output and compute buffers, and
the `fit_memory_breakdown` JSON record that `--log-jsonl` adds at shutdown, and the speculative
implementations the server set up (type and draft length), which its `/props` does not report, the
CPU backend's features from its `system_info` line (they decide which weights it repacks), and a multimodal
projector's lines (`--mmproj`: which backend its CLIP context uses, its type, its tensors' size, and its
compute buffer once an image reserved it).
A split over llama.cpp's RPC backend (`--rpc`) names each remote device's buffers `RPC<d>[HOST:PORT]` (`d`: the
device's index on that server); `remote_devices` gathers them per endpoint.

Input is the log text as the server wrote it: plain lines with or without the `M.SS.mmm.uuu L ` time and
level prefix, ANSI colours, or `--log-jsonl` records (whose `msg` is parsed the same way). Anything else is
ignored, so a log with unrelated or garbled lines still parses. MiB figures are kept as printed (`Decimal`
with two places) together with the exact integers of the same line (cells, layers, seqs); `printed_mib`
reproduces llama.cpp's own formatting so a predicted byte count can be compared with a printed figure
exactly. Pure core: it takes text and returns values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np

__all__ = [
    "AllocationLog",
    "BreakdownRow",
    "ContextAllocation",
    "KvCacheLine",
    "ProjectorAllocation",
    "RecurrentLine",
    "RemoteDevice",
    "SpeculativeImpl",
    "parse_allocation_log",
    "printed_mib",
    "printed_mib_f32",
    "remote_devices",
]

MIB = 1 << 20


def printed_mib(n_bytes: int) -> Decimal:
    """`%.2f` of bytes/1024.0/1024.0 in double precision, as the buffer-size lines print it."""
    return Decimal(f"{n_bytes / 1024.0 / 1024.0:.2f}")


def printed_mib_f32(n_bytes: int) -> Decimal:
    """`%.2f` of `(float)bytes / (1024.0f*1024.0f)`, as the cache `size =` lines print it (float32)."""
    value = np.float32(n_bytes) / np.float32(1024.0 * 1024.0)
    return Decimal(f"{float(value):.2f}")


@dataclass(frozen=True)
class KvCacheLine:
    """One `llama_kv_cache: size = …` line. `swa` is None outside an interleaved-SWA cache pair."""

    size_mib: Decimal
    cells: int
    layers: int
    seqs: int
    streams: int
    k_type: str
    k_mib: Decimal
    v_type: str
    v_mib: Decimal
    swa: bool | None = None
    buffers: tuple[tuple[str, Decimal], ...] = ()  # (buffer name, MiB) from the preceding "KV buffer" lines


@dataclass(frozen=True)
class RecurrentLine:
    """One `llama_memory_recurrent: size = …` line. `layers` is the model's trunk layer count."""

    size_mib: Decimal
    cells: int
    layers: int
    seqs: int
    rs_seq: int
    r_type: str
    r_mib: Decimal
    s_type: str
    s_mib: Decimal
    p_mib: Decimal
    buffers: tuple[tuple[str, Decimal], ...] = ()


@dataclass
class ContextAllocation:
    """Everything one llama context reported, in order of appearance."""

    n_seq_max: int | None = None
    n_ctx: int | None = None
    n_ctx_seq: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    n_rs_seq: int | None = None
    n_outputs_max: int | None = None  # outputs one batch may have: its whole batch on an embedding server
    flash_attn: str | None = None
    kv_unified: bool | None = None
    kv: list[KvCacheLine] = field(default_factory=list)
    recurrent: list[RecurrentLine] = field(default_factory=list)
    output_buffers: dict[str, Decimal] = field(default_factory=dict)
    # buffer name -> largest size reported: a context may reserve its graph more than once and ggml keeps
    # the largest allocation
    compute_buffers: dict[str, Decimal] = field(default_factory=dict)

    def kv_mib(self) -> Decimal:
        return sum((line.size_mib for line in self.kv), Decimal(0))


@dataclass(frozen=True)
class BreakdownRow:
    """One row of the `fit_memory_breakdown` JSON record (whole MiB, rounded down by llama.cpp)."""

    kind: str
    name: str
    self_mib: int
    model_mib: int
    context_mib: int
    compute_mib: int


@dataclass
class SpeculativeImpl:
    """One `adding speculative implementation '<type>'` line and the draft length printed after it."""

    type: str
    n_max: int | None = None


@dataclass
class ProjectorAllocation:
    """What llama-server printed about a multimodal projector (`clip_ctx`, `load_hparams`)."""

    backend: str | None = None  # "CPU", or the GPU backend's name ("CUDA0")
    projector_type: str | None = None
    model_mib: Decimal | None = None  # the sum of the file's tensors
    # buffer name -> largest size reported: reserved at the first image when the server started without warm-up
    compute_buffers: dict[str, Decimal] = field(default_factory=dict)


@dataclass
class AllocationLog:
    """The parsed allocation facts of one llama-server run."""

    model_buffers: dict[str, Decimal] = field(default_factory=dict)
    # a draft model's buffers (`--model-draft`: the second model the server loads)
    draft_model_buffers: dict[str, Decimal] = field(default_factory=dict)
    contexts: list[ContextAllocation] = field(default_factory=list)
    breakdown: list[BreakdownRow] | None = None
    build_info: str | None = None
    unused_tensors: list[str] = field(default_factory=list)
    speculative: list[SpeculativeImpl] = field(default_factory=list)
    # the CPU backend's features from the `system_info` line ("AVX2", "REPACK", …), None when not logged
    cpu_features: frozenset[str] | None = None
    projector: ProjectorAllocation | None = None  # None when no projector was loaded

    @property
    def target(self) -> ContextAllocation | None:
        """The serving context (the first one created)."""
        return self.contexts[0] if self.contexts else None

    @property
    def draft(self) -> ContextAllocation | None:
        """The MTP/draft context, when the server created one."""
        return self.contexts[1] if len(self.contexts) > 1 else None


@dataclass
class RemoteDevice:
    """What a split's server printed for one RPC device (a member's `ggml-rpc-server`), MiB as printed: its model
    buffer, each cache's buffer in order (KV caches, a sliding-window model's SWA cache second, then the
    recurrent state), and its compute buffer (the largest the serving context reserved)."""

    endpoint: str  # HOST:PORT as given to --rpc
    device: int  # the device's index on that server
    model_mib: Decimal = Decimal(0)
    cache_mib: list[Decimal] = field(default_factory=list)
    compute_mib: Decimal | None = None

    @property
    def caches_mib(self) -> Decimal:
        return sum(self.cache_mib, Decimal(0))


_RPC_BUFFER = re.compile(r"^RPC(\d+)\[([^\]\s]+)\]$")


def remote_devices(log: AllocationLog) -> dict[str, RemoteDevice]:
    """The RPC devices of a split, by buffer name (`RPC0[127.0.0.1:50052]`), from the model's buffers and the
    serving context's caches and compute buffers; a draft or MTP context is not counted here."""
    out: dict[str, RemoteDevice] = {}

    def device(name: str) -> RemoteDevice | None:
        m = _RPC_BUFFER.match(name)
        if m is None:
            return None
        return out.setdefault(name, RemoteDevice(endpoint=m.group(2), device=int(m.group(1))))

    for name, mib in log.model_buffers.items():
        if (remote := device(name)) is not None:
            remote.model_mib += mib
    target = log.target
    if target is not None:
        buffers = [line.buffers for line in target.kv] + [line.buffers for line in target.recurrent]
        for name, mib in (buffer for line in buffers for buffer in line):
            if (remote := device(name)) is not None:
                remote.cache_mib.append(mib)
        for name, mib in target.compute_buffers.items():
            if (remote := device(name)) is not None:
                remote.compute_mib = mib
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFIX = re.compile(r"^\s*\d+\.\d{2}\.\d{3}\.\d{3}\s+[IWEDT]\s+")
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_MODEL_BUF = re.compile(rf"^load_tensors:\s+(\S+) model buffer size\s*=\s*{_NUM} MiB")
_MODEL_LOADER = re.compile(r"^llama_model_loader: loaded meta data with")
_CTX_START = re.compile(r"^llama_context: constructing llama_context")
_CTX_PARAM = re.compile(
    r"^llama_context: (n_seq_max|n_ctx|n_ctx_seq|n_batch|n_ubatch|n_rs_seq|n_outputs_max)\s+=\s+(\d+)\s*$"
)
_CTX_FLAG = re.compile(r"^llama_context: (flash_attn|kv_unified)\s+=\s+(\S+)\s*$")
_OUTPUT_BUF = re.compile(rf"^llama_context:\s+(\S+)\s+output buffer size\s*=\s*{_NUM} MiB")
_ISWA = re.compile(r"^llama_kv_cache_iswa: creating\s+(non-SWA|SWA) KV cache")
_KV_BUF = re.compile(rf"^llama_kv_cache:\s+(\S+) KV buffer size\s*=\s*{_NUM} MiB")
_KV_SIZE = re.compile(
    rf"^llama_kv_cache: size =\s*{_NUM} MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\), "
    rf"K \((\w+)\):\s*{_NUM} MiB, V \((\w+)\):\s*{_NUM} MiB"
)
_RS_BUF = re.compile(rf"^llama_memory_recurrent:\s+(\S+) RS buffer size\s*=\s*{_NUM} MiB")
_RS_SIZE = re.compile(
    rf"^llama_memory_recurrent: size =\s*{_NUM} MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+) seqs\s+(\d+) rs_seq\), "
    rf"R \((\w+)\):\s*{_NUM} MiB, S \((\w+)\):\s*{_NUM} MiB(?:, P \(\w+\):\s*{_NUM} MiB)?"
)
_COMPUTE = re.compile(rf"^sched_reserve:\s+(\S+) compute buffer size\s*=\s*{_NUM} MiB")
_BUILD = re.compile(r"common_params_print_info: (build .*)$")
_UNUSED = re.compile(r"model has unused tensor (\S+)")
_SPEC_IMPL = re.compile(r"adding speculative implementation '([A-Za-z0-9_-]+)'")
_SPEC_N_MAX = re.compile(r": - n_max=(\d+)")
_CLIP_BACKEND = re.compile(r"^clip_ctx: CLIP using (\S+) backend")
_CLIP_TYPE = re.compile(r"^load_hparams: projector:\s+(\S+)\s*$")
_CLIP_SIZE = re.compile(rf"^load_hparams: model size:\s+{_NUM} MiB")
_CLIP_COMPUTE = re.compile(rf"^reserve_compute_meta:\s+(\S+) compute buffer size\s*=\s*{_NUM} MiB")
_SYSTEM_INFO = re.compile(r"system_info: .*?\| CPU : (.*)$")
_FEATURE = re.compile(r"([A-Z0-9_]+) = 1\b")


def _messages(text: str) -> Iterable[tuple[str | None, object]]:
    """Yields (message line, None) for log lines and (None, record) for JSON records that are not logs."""
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).strip()
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                if record.get("type") == "log" and isinstance(record.get("msg"), str):
                    for sub in record["msg"].splitlines():
                        yield sub.strip(), None
                else:
                    yield None, record
                continue
        yield _PREFIX.sub("", line), None


def _breakdown(record: object) -> list[BreakdownRow] | None:
    if not isinstance(record, dict) or record.get("type") != "fit_memory_breakdown":
        return None
    data = record.get("data")
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        return None
    out: list[BreakdownRow] = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        sizes = [row.get(key, 0) for key in ("self", "model", "context", "compute")]
        # llama.cpp writes whole MiB; anything else (floats, overflowing numbers, strings) is not its record
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            continue
        out.append(
            BreakdownRow(
                kind=str(row.get("kind", "")),
                name=str(row.get("name", "")),
                self_mib=sizes[0],
                model_mib=sizes[1],
                context_mib=sizes[2],
                compute_mib=sizes[3],
            )
        )
    return out


def parse_allocation_log(text: str) -> AllocationLog:
    """Parses a llama-server log; never raises on unrelated or malformed lines."""
    reader = _Reader()
    for line, record in _messages(text):
        if line is None:
            reader.record(record)
        else:
            reader.line(line)
    return reader.result


@dataclass
class _Reader:
    """What a log says so far, and what the next lines complete: the context being reported (lines before its
    first parameter open one), the cache buffer lines waiting for their cache's size line, whether the next
    cache is a sliding-window pair's, and how many models began loading (the first is the model, the second a
    draft). Each kind of line has its method; `_LINES` says which line is which, in the order tried."""

    result: AllocationLog = field(default_factory=AllocationLog)
    ctx: ContextAllocation | None = None
    pending_swa: bool | None = None
    kv_buffers: list[tuple[str, Decimal]] = field(default_factory=list)
    rs_buffers: list[tuple[str, Decimal]] = field(default_factory=list)
    models_loaded: int = 0

    def line(self, line: str) -> None:
        for find, read in _LINES:
            if m := find(line):
                read(self, m)
                return

    def record(self, record: object) -> None:
        rows = _breakdown(record)
        if rows is not None:
            self.result.breakdown = rows

    def current(self) -> ContextAllocation:
        if self.ctx is None:
            self.ctx = ContextAllocation()
            self.result.contexts.append(self.ctx)
        return self.ctx

    def projector(self) -> ProjectorAllocation:
        if self.result.projector is None:
            self.result.projector = ProjectorAllocation()
        return self.result.projector

    # --- models and contexts ---

    def model_buffer(self, m: re.Match[str]) -> None:
        buffers = self.result.draft_model_buffers if self.models_loaded > 1 else self.result.model_buffers
        buffers[m.group(1)] = buffers.get(m.group(1), Decimal(0)) + Decimal(m.group(2))

    def model_loader(self, m: re.Match[str]) -> None:
        self.models_loaded += 1

    def context_start(self, m: re.Match[str]) -> None:
        self.ctx = ContextAllocation()
        self.result.contexts.append(self.ctx)
        self.pending_swa = None

    def context_param(self, m: re.Match[str]) -> None:
        c = self.current()
        if m.group(1) == "n_seq_max" and c.n_seq_max is not None:
            # a second context whose "constructing" line was lost
            self.ctx = None
            c = self.current()
        setattr(c, m.group(1), int(m.group(2)))

    def context_flag(self, m: re.Match[str]) -> None:
        c = self.current()
        if m.group(1) == "flash_attn":
            c.flash_attn = m.group(2)
        else:
            c.kv_unified = m.group(2) == "true"

    def output_buffer(self, m: re.Match[str]) -> None:
        self.current().output_buffers[m.group(1)] = Decimal(m.group(2))

    def compute_buffer(self, m: re.Match[str]) -> None:
        c = self.current()
        size = Decimal(m.group(2))
        c.compute_buffers[m.group(1)] = max(size, c.compute_buffers.get(m.group(1), Decimal(0)))

    # --- caches: buffer lines first, then the cache's size line ---

    def iswa(self, m: re.Match[str]) -> None:
        self.pending_swa = m.group(1) == "SWA"

    def kv_buffer(self, m: re.Match[str]) -> None:
        self.kv_buffers.append((m.group(1), Decimal(m.group(2))))

    def kv_size(self, m: re.Match[str]) -> None:
        self.current().kv.append(
            KvCacheLine(
                size_mib=Decimal(m.group(1)),
                cells=int(m.group(2)),
                layers=int(m.group(3)),
                seqs=int(m.group(4)),
                streams=int(m.group(5)),
                k_type=m.group(6),
                k_mib=Decimal(m.group(7)),
                v_type=m.group(8),
                v_mib=Decimal(m.group(9)),
                swa=self.pending_swa,
                buffers=tuple(self.kv_buffers),
            )
        )
        self.kv_buffers = []
        self.pending_swa = None

    def rs_buffer(self, m: re.Match[str]) -> None:
        self.rs_buffers.append((m.group(1), Decimal(m.group(2))))

    def rs_size(self, m: re.Match[str]) -> None:
        self.current().recurrent.append(
            RecurrentLine(
                size_mib=Decimal(m.group(1)),
                cells=int(m.group(2)),
                layers=int(m.group(3)),
                seqs=int(m.group(4)),
                rs_seq=int(m.group(5)),
                r_type=m.group(6),
                r_mib=Decimal(m.group(7)),
                s_type=m.group(8),
                s_mib=Decimal(m.group(9)),
                p_mib=Decimal(m.group(10) or "0"),
                buffers=tuple(self.rs_buffers),
            )
        )
        self.rs_buffers = []

    # --- a projector ---

    def clip_backend(self, m: re.Match[str]) -> None:
        self.projector().backend = m.group(1)

    def clip_type(self, m: re.Match[str]) -> None:
        self.projector().projector_type = m.group(1)

    def clip_size(self, m: re.Match[str]) -> None:
        self.projector().model_mib = Decimal(m.group(1))

    def clip_compute(self, m: re.Match[str]) -> None:
        buffers = self.projector().compute_buffers
        buffers[m.group(1)] = max(Decimal(m.group(2)), buffers.get(m.group(1), Decimal(0)))

    # --- the server: its CPU backend, build, unused tensors, speculation ---

    def system_info(self, m: re.Match[str]) -> None:
        self.result.cpu_features = frozenset(_FEATURE.findall(m.group(1)))

    def build(self, m: re.Match[str]) -> None:
        self.result.build_info = m.group(1).strip()

    def unused(self, m: re.Match[str]) -> None:
        self.result.unused_tensors.append(m.group(1))

    def speculative(self, m: re.Match[str]) -> None:
        self.result.speculative.append(SpeculativeImpl(type=m.group(1)))

    def speculative_n_max(self, m: re.Match[str]) -> None:
        # the draft length printed after an implementation's line, once
        if self.result.speculative and self.result.speculative[-1].n_max is None:
            self.result.speculative[-1].n_max = int(m.group(1))


_Find = Callable[[str], re.Match[str] | None]

#: Which line is which: the first pattern that finds a line reads it (anchored at the message's start, or,
#: for lines other components print around, anywhere in it).
_LINES: tuple[tuple[_Find, Callable[[_Reader, re.Match[str]], None]], ...] = (
    (_MODEL_BUF.match, _Reader.model_buffer),
    (_MODEL_LOADER.match, _Reader.model_loader),
    (_CTX_START.match, _Reader.context_start),
    (_CTX_PARAM.match, _Reader.context_param),
    (_CTX_FLAG.match, _Reader.context_flag),
    (_OUTPUT_BUF.match, _Reader.output_buffer),
    (_ISWA.match, _Reader.iswa),
    (_KV_BUF.match, _Reader.kv_buffer),
    (_KV_SIZE.match, _Reader.kv_size),
    (_RS_BUF.match, _Reader.rs_buffer),
    (_RS_SIZE.match, _Reader.rs_size),
    (_COMPUTE.match, _Reader.compute_buffer),
    (_CLIP_BACKEND.match, _Reader.clip_backend),
    (_CLIP_TYPE.match, _Reader.clip_type),
    (_CLIP_SIZE.match, _Reader.clip_size),
    (_CLIP_COMPUTE.match, _Reader.clip_compute),
    (_SYSTEM_INFO.search, _Reader.system_info),
    (_BUILD.search, _Reader.build),
    (_UNUSED.search, _Reader.unused),
    (_SPEC_IMPL.search, _Reader.speculative),
    (_SPEC_N_MAX.search, _Reader.speculative_n_max),
)
