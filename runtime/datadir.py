"""The data dir's lock: one `mesh-actor run` per data dir, and offline commands (`l3 gc`) that refuse a live one.

Its own module so that client commands need not import the launcher (which imports every actor).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

__all__ = ["DataDirBusy", "lock_data_dir"]


class DataDirBusy(RuntimeError):
    pass


def lock_data_dir(data_dir: Path) -> IO[str]:
    """Holds an exclusive lock on the data dir for this process's lifetime (one node per data dir)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = (data_dir / "run.lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise DataDirBusy(f"{data_dir} is in use by mesh-actor run (pid {owner}); use another --data-dir") from exc
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
