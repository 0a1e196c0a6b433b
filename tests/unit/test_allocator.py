"""The node process's allocator policy (runtime/allocator.py): a buffer of a handoff's size comes from the heap
and stays there for the next one, instead of a fresh mapping each time. Each case runs in its own process: the
policy is process-wide."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# How many bytes glibc holds in mmapped blocks (mallinfo2's hblkhd) while a 16 MiB buffer lives.
PROBE = textwrap.dedent(
    """
    import ctypes, sys
    from runtime.allocator import keep_large_buffers
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "policy":
        assert keep_large_buffers().applied
    before = libc.mallinfo2().hblkhd
    buffer = bytearray(16 << 20)
    print(libc.mallinfo2().hblkhd - before)
    """
)


def _mapped_while_held(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt")
def test_a_large_buffer_comes_from_the_heap_under_the_policy_and_from_a_fresh_mapping_without() -> None:
    assert _mapped_while_held("default") >= 16 << 20
    assert _mapped_while_held("policy") == 0
