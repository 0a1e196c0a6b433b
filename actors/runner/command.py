"""The llama-server command line of an admitted instance (runner core).

This module owns turning a reservation into an argument list. Every setting that changes what the server
allocates is pinned from the reservation's stamp, including the ones equal to llama-server's defaults, so a
different engine build (or an environment variable) cannot silently change the allocation: context (`-c`),
slots (`-np`), unified KV or not (`-kvu`/`-no-kvu`), cache types (`-ctk`/`-ctv`, and `-ctkd`/`-ctvd` of the
draft context), flash attention (`-fa`), batch sizes (`-b`/`-ub`), sliding-window cache (`--swa-full`),
speculation (`--spec-type`, `--spec-draft-n-max`), what the server is for and how it pools (`--embeddings` or
`--rerank`, `--pooling`), GPU layers and split (`-ngl`, `-ts`, and a split's members, `--rpc`), host extras
(`--ctx-checkpoints`, `--cache-ram`) and `--fit off` (llama-server's own fitting would change `-c`). The
stamp's companion files are passed as admitted: a draft model (`--model-draft`, its layers offloaded as the
model's: `-ngld` equal to `-ngl`, since its default "auto" would fit them by llama-server's own rule) and a
multimodal projector (`--mmproj`, on the first GPU exactly when the model's layers are offloaded:
`--mmproj-offload` or `--no-mmproj-offload`, since the server's default offloads it whenever it finds a GPU).

The rest serves supervision: loopback only on the given port, `-lv 4` so the allocation lines are logged,
`--slot-save-path` for slot state, `--metrics` (its `/metrics`, which the node's metrics re-export), and
`--no-warmup` (a warmup run allocates nothing the reservation does
not already hold; it only delays readiness). llama-server also reads `LLAMA_ARG_*` environment variables for
flags that are not given, so `server_environment` removes them. The result is an argument list, never a
shell string. Pure core: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from actors.placement.projector import projector_device
from messages.placement import Reservation

__all__ = ["LOOPBACK", "build_command", "server_environment", "with_files"]

LOOPBACK = "127.0.0.1"
#: llama-server's verbosity that logs the allocation lines (`llama_kv_cache: size = …` and friends).
LOG_VERBOSITY = 4
#: What makes a server an embedding server or a reranker (`--rerank` is `--embeddings` with rank pooling).
_KIND_FLAGS = {"embedding": "--embeddings", "rerank": "--rerank"}


def _split(weights: tuple[float, ...]) -> str:
    # repr of a float is the shortest text that reads back as the same value
    return ",".join(repr(float(w)) for w in weights)


def build_command(
    engine: str, reservation: Reservation, *, port: int, slot_save_dir: str, rpc: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The argv that runs `reservation` exactly as stamped, listening on `LOOPBACK:port`. A split instance's
    members are reached at `rpc` (`HOST:PORT` of each member's link, in the stamp's member order)."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port")
    stamp = reservation.stamp
    if len(rpc) != len(stamp.rpc):
        raise ValueError(f"the stamp names {len(stamp.rpc)} split members, {len(rpc)} RPC endpoints were given")
    s = stamp.settings
    argv = [
        engine,
        "-m", reservation.model_path,
        "--host", LOOPBACK,
        "--port", str(port),
        "-c", str(stamp.ctx),
        "-np", str(s.slots),
        "-kvu" if s.kv_unified else "-no-kvu",
        "-ctk", s.cache_type_k,
        "-ctv", s.cache_type_v,
        "-fa", s.flash_attn,
        "-b", str(s.batch),
        "-ub", str(s.ubatch),
        "--spec-type", s.spec_type,
        "--spec-draft-n-max", str(s.spec_draft_n_max),
        "-ctkd", s.spec_draft_type_k,
        "-ctvd", s.spec_draft_type_v,
        "-ngl", str(stamp.n_gpu_layers),
        "--ctx-checkpoints", str(s.ctx_checkpoints),
        "--cache-ram", str(s.cache_ram_mib),
        "--fit", "off",
        "--no-warmup",
        "-lv", str(LOG_VERBOSITY),
        "--slot-save-path", slot_save_dir,
        "--metrics",
    ]  # fmt: skip
    if s.threads:
        argv += ["-t", str(s.threads), "-tb", str(s.threads)]
    if s.kind in _KIND_FLAGS:  # an embedding or rerank server, pooling as stamped (its -b/-ub: a whole input)
        argv.append(_KIND_FLAGS[s.kind])
    if s.pooling is not None:
        argv += ["--pooling", s.pooling]
    if s.swa_full:
        argv.append("--swa-full")  # llama-server has no negative form; its default is a window-sized cache
    if rpc:  # the members' RPC devices come first in llama.cpp's device order, then the head's GPUs
        argv += ["--rpc", ",".join(rpc)]
    if stamp.gpu_split:
        argv += ["-ts", _split(stamp.gpu_split)]
    if stamp.draft is not None:
        argv += ["--model-draft", stamp.draft.path, "-ngld", str(stamp.n_gpu_layers)]
    if stamp.mmproj is not None:
        offload = projector_device(stamp.n_gpu_layers, stamp.gpu_split) >= 0
        argv += ["--mmproj", stamp.mmproj.path, "--mmproj-offload" if offload else "--no-mmproj-offload"]
    return tuple(argv)


def with_files(
    reservation: Reservation, model: str, *, draft: str | None = None, mmproj: str | None = None
) -> Reservation:
    """`reservation` naming the files this node runs (relative names resolved inside its models dir); the
    companions' digests stay as admission stamped them."""
    stamp = reservation.stamp
    if draft is not None and stamp.draft is not None:
        stamp = msgspec.structs.replace(stamp, draft=msgspec.structs.replace(stamp.draft, path=draft))
    if mmproj is not None and stamp.mmproj is not None:
        stamp = msgspec.structs.replace(stamp, mmproj=msgspec.structs.replace(stamp.mmproj, path=mmproj))
    return msgspec.structs.replace(reservation, model_path=model, stamp=stamp)


def server_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for llama-server: ours without `LLAMA_ARG_*`, which would set unpinned flags."""
    return {name: value for name, value in environ.items() if not name.startswith("LLAMA_ARG_")}
