"""nats-py's socket read size is raised by runtime/bus.py through the module constant nats-py reads at connect
and at every read; if an upgrade stops reading it, this fails instead of the tuning silently vanishing."""

from __future__ import annotations

import inspect

import nats.aio.client

from runtime.bus import NATS_READ_BYTES


def test_nats_py_reads_its_socket_in_the_size_the_bus_sets() -> None:
    assert nats.aio.client.DEFAULT_BUFFER_SIZE == NATS_READ_BYTES == 1 << 20
    assert "self._transport.read(DEFAULT_BUFFER_SIZE)" in inspect.getsource(nats.aio.client.Client._read_loop)
    assert "buffer_size=DEFAULT_BUFFER_SIZE" in inspect.getsource(nats.aio.client.Client)
