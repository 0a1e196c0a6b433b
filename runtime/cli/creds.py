"""`mesh-actor creds issue`: a user of one role on the embedded server of this data dir.

The user goes into the server's users file (mode 0600) with a random password; the running server reloads
its config (SIGHUP, connections stay) and enforces the role's permissions (`runtime.roles`). The
credentials file written (0600) or printed is what `--nats-creds FILE` and `nats-env --creds FILE` take.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import Any

from runtime.cli.common import EXIT_USAGE, CliError, add_data_dir, data_dir
from runtime.creds import CredentialsError, CredsFile, issue, write_private
from runtime.embedded import EmbeddedNatsError, read_credentials, read_server_record, reload
from runtime.roles import ROLE_KINDS, Role


def register(sub: argparse._SubParsersAction[Any]) -> None:
    creds = sub.add_parser("creds", help="credentials with roles for the embedded NATS server")
    verbs = creds.add_subparsers(dest="verb", required=True, metavar="VERB")
    issue_cmd = verbs.add_parser("issue", help="issue a client, node or admin user; the server reloads")
    add_data_dir(issue_cmd)
    issue_cmd.add_argument("--role", required=True, choices=ROLE_KINDS)
    issue_cmd.add_argument("--node", metavar="ID", help="the node a node role acts for (required with --role node)")
    issue_cmd.add_argument("--out", metavar="FILE", help="write the credentials file there (0600); default stdout")
    issue_cmd.add_argument(
        "--url", action="append", metavar="URL", help="URL(s) the holder dials (default: where this server listens)"
    )
    issue_cmd.set_defaults(func=cmd_issue)


def _default_urls(directory: Path) -> tuple[tuple[str, ...], str | None]:
    admin = read_credentials(directory)
    server = read_server_record(directory)
    if admin is None or server is None:
        raise CliError(f"{directory} has no embedded server: start `mesh-actor run` there first")
    if server.host in ("0.0.0.0", "::", ""):  # reachable by name; the server certificate names it
        scheme = "tls" if server.tls else "nats"
        return (f"{scheme}://{socket.getfqdn()}:{server.port}",), admin.tls_ca
    return (admin.url,), admin.tls_ca


def cmd_issue(args: argparse.Namespace) -> int:
    if (args.role == "node") != (args.node is not None):
        raise CliError("--node ID goes with --role node, and only with it", EXIT_USAGE)
    try:
        role = Role(args.role, args.node)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    directory = data_dir(args)
    try:
        urls, ca = _default_urls(directory)
        user = issue(directory, role)
        pid = reload(directory)
    except (CredentialsError, EmbeddedNatsError, OSError) as exc:
        raise CliError(str(exc)) from exc
    record = CredsFile(tuple(args.url) if args.url else urls, user.user, user.password, str(role), ca)
    if args.out:
        try:
            write_private(Path(args.out), record.to_json())
        except OSError as exc:
            raise CliError(f"cannot write {args.out}: {exc}") from exc
        where = f"server pid {pid} reloaded" if pid else "no server runs: the next start loads it"
        print(f"issued {user.user} ({role}) to {args.out}; {where}", file=sys.stderr)
    else:
        sys.stdout.write(record.to_json())
    return 0
