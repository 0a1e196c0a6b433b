"""Model commands (`inspect`, `fit`): offline, no bus. Owned by the memory-model work."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Adds this family's subcommands (none yet)."""
