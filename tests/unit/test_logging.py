"""Structured logging: where a logger's lines go, whenever the logger was made."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_a_logger_made_at_import_follows_the_configuration_made_later() -> None:
    # Modules keep a logger made at import (`_log = get_logger(component=...)`), before `mesh-actor run`
    # configures logging. Such loggers wrote their warnings to stdout, in the console format, whatever the
    # level (found by benchmarks/chaos.py: a full disk's failed slot saves were on the node's stdout only).
    # A fresh interpreter: the test session has configured logging already.
    script = textwrap.dedent(
        """
        from runtime.logging import configure_logging, get_logger
        early = get_logger(component="early")
        configure_logging("warning", json=True)
        early.info("not_shown")
        early.warning("shown", detail=1)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    record = json.loads(line)
    assert record["event"] == "shown" and record["component"] == "early" and record["level"] == "warning"
