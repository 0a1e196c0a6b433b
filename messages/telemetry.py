"""Node telemetry: what a node has and how it would run llama-server (`mesh.telemetry.<node>`).

The same message is the value of the node's key in the nodes KV bucket, whose per-key TTL makes a node
that stopped reporting disappear from the cluster view.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from messages.settings import ServingSettings, SettingsBounds

#: Sizes and counts a peer reports: never negative (a lying or broken peer is refused at decoding).
Bytes = Annotated[int, msgspec.Meta(ge=0, le=1 << 60)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One NVIDIA GPU as NVML reports it. `usable_bytes` is free memory capped by the node's memory limit."""

    index: Count
    name: str
    uuid: str
    total_bytes: Bytes
    free_bytes: Bytes
    used_bytes: Bytes
    usable_bytes: Bytes


class HostInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Host RAM and CPUs. `usable_bytes` is available RAM capped by the node's memory limit."""

    ram_total_bytes: Bytes
    ram_available_bytes: Bytes
    usable_bytes: Bytes
    cpu_count: Count
    # llama.cpp CPU backend features a native build has on this CPU, named as its `system_info` line names
    # them (AVX2, AVX512, NEON, DOTPROD, MATMUL_INT8, …); they decide which weights it repacks. None: unknown.
    cpu_features: tuple[Annotated[str, msgspec.Meta(max_length=32)], ...] | None = None


class LlamaServerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The llama-server this node would start, as `llama-server --version` describes itself."""

    path: str
    version: str  # e.g. "11434 (a1b2c3d)"
    build_info: str  # the rest of the version output (compiler, target, backends)


class SplitServing(msgspec.Struct, frozen=True, kw_only=True):
    """This node's part in split serving (llama.cpp RPC between nodes). Present only on a node that holds the
    cluster's certificates: it can head a split (its llama-server reaches members through mutual TLS). It lends
    its host memory to other nodes' splits when `lend_host` is set: for each part a `ggml-rpc-server` of its own
    on loopback, reached through a tunnel exit on `lend_host`, allocating in `lend_devices` (its host memory,
    "CPU", whose usable bytes are `host.usable_bytes`)."""

    lend_host: str | None = None
    lend_devices: tuple[str, ...] = ()


#: Model files one report lists at most (the names a node's catalogs and trusted registry entries give).
MAX_MODEL_FILES = 256


#: A held file's blake3 when the node has hashed that version (its runner verified it, a peer asked), else "".
HeldDigest = Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{64})?$")]


class ModelFiles(msgspec.Struct, frozen=True, kw_only=True):
    """The model files this node holds (its files actor's): each catalog or registry name found in its models
    dir, with its size and its blake3 when known; and how fast its last pull from a peer was. Placement prefers
    a node that holds a model's file (nothing to fetch before it starts; a known digest must be the model's)
    and says how many bytes another would fetch first."""

    held: Annotated[
        tuple[tuple[Annotated[str, msgspec.Meta(max_length=4096)], Bytes, HeldDigest], ...],
        msgspec.Meta(max_length=MAX_MODEL_FILES),
    ] = ()  # (relative name, size, blake3 or ""), sorted by name
    pull_bytes_per_s: Annotated[float, msgspec.Meta(gt=0)] | None = None  # the last pull's, None: none yet

    def version_of(self, path: str, digest: str | None) -> int | None:
        """The size of the file `path` held here, if it is that version (`digest`; None or "" on either side:
        not known, taken as the same); None when it is not held, or held in another version."""
        for name, size, held in self.held:
            if name == path and (not digest or not held or held == digest):
                return size
        return None


class NodeResources(msgspec.Struct, frozen=True, kw_only=True):
    """One node's telemetry report.

    `settings` is None when the node cannot serve (no llama-server found): such a node has not advertised
    serving settings, and placement refuses models whose footprint depends on them. `settings` are its
    defaults; `bounds` what it accepts of a model's own settings (None: a node that predates bounds accepts
    only its defaults).
    """

    node_id: str
    seq: Annotated[int, msgspec.Meta(ge=0)]  # increases with every report of this node process
    sent_at: float  # unix seconds
    started_at: float  # when this node process started, unix seconds
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=86400)]  # the report is stale after this many seconds
    host: HostInfo
    gpus: tuple[GpuInfo, ...] = ()
    nvml: str | None = None  # driver version when NVML answered, None otherwise
    nvml_error: str | None = None  # why there is no NVML (absent library, no device); not an error
    memory_limit_bytes: Bytes | None = None
    llama_server: LlamaServerInfo | None = None
    llama_server_error: str | None = None
    settings: ServingSettings | None = None
    bounds: SettingsBounds | None = None
    split: SplitServing | None = None  # None: it neither heads nor lends to a split (no cluster certificates)
    model_files: ModelFiles | None = None  # None: no files actor reports here
