"""Telemetry probes (shell): host RAM and CPUs from the kernel, NVIDIA GPUs through NVML.

NVML being absent (no driver, no GPU, CPU-only CI) is a normal reading with a reason, not an error.
Host memory honours a cgroup v2 memory limit, since a container's llama-server is bound by it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any

from actors.telemetry.resources import GpuReading, HostReading, NvmlReading

_CGROUP = Path("/sys/fs/cgroup")


def _meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return values


def _cgroup_headroom() -> int | None:
    """Bytes the cgroup may still allocate, when a cgroup v2 memory limit applies."""
    with contextlib.suppress(OSError, ValueError):
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            current = int((_CGROUP / "memory.current").read_text().strip())
            return max(0, int(limit) - current)
    return None


@functools.cache
def _cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The first CPU's flags (x86 `flags`, Arm `Features`, s390x `features`); None when not readable.
    They do not change while the process runs, so the file is read once."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return frozenset(rest.split())
    return None


def read_host() -> HostReading:
    info = _meminfo()
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", info.get("MemFree", 0))
    headroom = _cgroup_headroom()
    if headroom is not None:
        available = min(available, headroom)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return HostReading(ram_total_bytes=total, ram_available_bytes=available, cpu_count=cpus, cpu_flags=_cpu_flags())


class Nvml:
    """An NVML session: `open` once, `read` per report, `close` at the end."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._driver: str | None = None
        self.error: str | None = None

    def open(self) -> None:
        try:
            import pynvml  # absent driver is normal

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            self._driver = driver.decode() if isinstance(driver, bytes) else str(driver)
            self._lib = pynvml
        except Exception as exc:  # NVMLError subclasses, ImportError, OSError: all mean "no NVML here"
            self.error = f"NVML unavailable: {exc}"

    def read(self) -> NvmlReading:
        lib = self._lib
        if lib is None:
            return NvmlReading(driver=None, error=self.error)
        gpus = []
        try:
            for index in range(lib.nvmlDeviceGetCount()):
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                memory = lib.nvmlDeviceGetMemoryInfo(handle)
                name = lib.nvmlDeviceGetName(handle)
                uuid = lib.nvmlDeviceGetUUID(handle)
                gpus.append(
                    GpuReading(
                        index=index,
                        name=name.decode() if isinstance(name, bytes) else str(name),
                        uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                        total_bytes=int(memory.total),
                        free_bytes=int(memory.free),
                        used_bytes=int(memory.used),
                    )
                )
        except Exception as exc:  # a GPU fell off the bus mid-read: report what NVML says
            return NvmlReading(driver=self._driver, error=f"NVML read failed: {exc}")
        return NvmlReading(driver=self._driver, gpus=tuple(gpus))

    def close(self) -> None:
        if self._lib is not None:
            with contextlib.suppress(Exception):
                self._lib.nvmlShutdown()
            self._lib = None
