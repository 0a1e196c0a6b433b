"""The direct-get reader's parse of a stored message's timestamp (`Nats-Time-Stamp`, read from the network)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.direct_get import _timestamp


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-12-01T19:17:26.595340822Z", datetime(2026, 12, 1, 19, 17, 26, 595340, tzinfo=UTC)),  # nanoseconds
        ("2026-12-01T19:17:26Z", datetime(2026, 12, 1, 19, 17, 26, tzinfo=UTC)),
        ("2026-12-01T19:17:26.5Z", datetime(2026, 12, 1, 19, 17, 26, 500000, tzinfo=UTC)),
        ("2026-12-01T21:17:26.5+02:00", datetime(2026, 12, 1, 19, 17, 26, 500000, tzinfo=UTC)),
    ],
)
def test_a_servers_timestamp_is_an_aware_utc_time_to_the_microsecond(text: str, expected: datetime) -> None:
    assert _timestamp(text) == expected and _timestamp(text).tzinfo is UTC


@given(st.text(max_size=64))
def test_anything_else_is_a_value_error(text: str) -> None:
    try:
        stamp = _timestamp(text)
    except ValueError:
        return
    assert stamp.tzinfo is UTC
