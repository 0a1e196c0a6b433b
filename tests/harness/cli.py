"""Running the `mesh-actor` CLI in-process and the NATS flags that point it at a test server."""

from __future__ import annotations

import argparse

from runtime.cli import runner as runner_cli
from tests.conftest import NatsServer


async def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mesh-actor")
    runner_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(await args.func(args))


def nats_flags(server: NatsServer) -> list[str]:
    options = server.options
    assert options.user and options.password
    secret = server.data_dir / "client-password"
    secret.write_text(options.password + "\n")  # never in argv
    return ["--nats", server.url, "--nats-user", options.user, "--nats-password-file", str(secret)]
