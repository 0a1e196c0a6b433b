"""`mesh-actor run`: wires one node together.

Starts the embedded NATS server unless URLs are configured, connects the bus, makes sure the journal
stream exists, starts this node's actors under a supervisor, and on SIGINT/SIGTERM stops them, records
`node_stopped`, flushes the journal and stops the embedded server last. Nothing else imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
import nats.errors
import nats.js.errors

from actors.dashboard.actor import DashboardActor
from actors.files.actor import FilesActor
from actors.frontdoor.actor import FrontDoorActor
from actors.frontdoor.catalog import CATALOG_FILE, Catalog, CatalogError, parse_catalog
from actors.handoff.actor import HandoffActor
from actors.handoff.restore import into_l3
from actors.l3.actor import L3Actor
from actors.metrics.actor import MetricsActor
from actors.placement.actor import PlacementActor
from actors.router.actor import RouterActor
from actors.runner.actor import RunnerActor
from actors.runner.engine import EngineNotFound, find_llama_server, probe_llama_server, rpc_server_beside
from actors.runner.lending import LendingConfig
from actors.runner.limits import RunnerLimits
from actors.telemetry.actor import TelemetryActor
from actors.telemetry.resources import NodeFacts
from messages.events import NodeStarted, NodeStopped
from messages.settings import ServingSettings, SettingsBounds
from messages.telemetry import LlamaServerInfo, SplitServing
from runtime import tls, tracing
from runtime.actor import Actor, ActorGaveUpError, Supervisor
from runtime.bus import Bus, ConnectFailed
from runtime.config import ConfigError, NatsOptions, NodeConfig
from runtime.creds import CredentialsError, with_creds_file
from runtime.datadir import lock_data_dir
from runtime.datapath import DataPathConfig
from runtime.embedded import ClusterSpec, EmbeddedNats
from runtime.journal import Journal, ensure_events_stream
from runtime.logging import get_logger
from runtime.model_files import FileDigests
from runtime.otlp import start_exporter, traces_endpoint
from runtime.tls import TlsFiles

VERSION = "0.1.0"
T = TypeVar("T")


async def describe_engine(config: NodeConfig) -> tuple[LlamaServerInfo | None, str | None]:
    try:
        return await probe_llama_server(find_llama_server(config.llama_server)), None
    except (EngineNotFound, OSError) as exc:
        return None, str(exc)


def split_serving(config: NodeConfig, engine: LlamaServerInfo | None) -> tuple[TlsFiles | None, LendingConfig | None]:
    """This node's part in split serving (llama.cpp RPC between nodes): its certificates under the cluster CA,
    derived from the cluster secret (None without one: it can neither head nor lend), and how it lends its
    memory (None: `--no-lend`, no certificates, or no `ggml-rpc-server` beside its llama-server)."""
    log = get_logger(node=config.node_id)
    if config.cluster_secret is None:
        return None, None
    host = config.lend_host or (config.cluster_listen[0] if config.cluster_listen else "127.0.0.1")
    bind = host
    if host in ("0.0.0.0", "::", ""):  # a wildcard listener: heads dial this host's name
        host = socket.getfqdn()
    names = sorted({*tls.local_names(bind), host})
    route_tls = tls.ensure_route_certificates(config.data_dir, config.cluster_secret, names)
    if not config.lend:
        return route_tls, None
    rpc_server = rpc_server_beside(engine.path) if engine else None
    if rpc_server is None or not os.access(rpc_server, os.X_OK):
        log.info("not_lending", reason="no ggml-rpc-server beside llama-server (the llama extra built without RPC)")
        return route_tls, None
    # the node's threads, or every core: ggml-rpc-server's own default is one thread
    threads = config.serving.threads or os.cpu_count() or 1
    return route_tls, LendingConfig(rpc_server=rpc_server, tls=route_tls, host=host, bind=bind, threads=threads)


def split_role(route_tls: TlsFiles | None, lending: LendingConfig | None) -> SplitServing | None:
    """What telemetry says of this node's part in split serving."""
    if route_tls is None:
        return None
    if lending is None:
        return SplitServing()
    return SplitServing(lend_host=lending.host, lend_devices=("CPU",))


class JetStreamUnavailable(RuntimeError):
    pass


class StartupInterrupted(Exception):
    """A stop signal arrived before the node was up."""


async def _unless_stopped(awaitable: Awaitable[T], stop: asyncio.Event) -> T:
    """Awaits `awaitable` unless `stop` is set first (then cancels it and raises StartupInterrupted)."""
    work = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not work.done():
            work.cancel()
            await _finish(work)
    if work.cancelled():
        raise StartupInterrupted("stopped while starting")
    return work.result()


async def _finish(task: asyncio.Future[T], deadline_s: float = 30.0) -> None:
    """Waits (bounded) for a task we cancelled to end. Our own cancellation is never swallowed: `asyncio.wait`
    does not propagate the task's outcome, and a cancellation of the caller still interrupts the wait."""
    done, _ = await asyncio.wait({task}, timeout=deadline_s)
    if not done:
        get_logger(component="node").error("shutdown_overdue", task=repr(task), deadline_s=deadline_s)


@contextlib.contextmanager
def _signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, reload: Callable[[], None]) -> Iterator[None]:
    """SIGINT/SIGTERM set `stop`, SIGHUP reloads; the handlers that were there before are put back after."""
    handled = {signal.SIGINT: stop.set, signal.SIGTERM: stop.set, signal.SIGHUP: reload}
    previous = {sig: signal.getsignal(sig) for sig in handled}
    for sig, handler in handled.items():
        loop.add_signal_handler(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, before)


class ServingSettingsHolder:
    """The node's serving settings and bounds now. SIGHUP reloads them (the operator edited config.toml);
    telemetry advertises the new ones, and instances admitted outside them are refused at start (drift)."""

    def __init__(
        self, settings: ServingSettings, bounds: SettingsBounds, reload: Callable[[], NodeConfig] | None
    ) -> None:
        self.settings = settings
        self.bounds = bounds
        self._reload = reload

    def get(self) -> ServingSettings:
        return self.settings

    def get_bounds(self) -> SettingsBounds:
        return self.bounds

    def reload(self) -> None:
        log = get_logger(component="config")
        if self._reload is None:
            log.warning("settings_reload_unavailable")
            return
        try:
            config = self._reload()
        except (ConfigError, OSError) as exc:
            log.error("settings_reload_failed", error=str(exc))  # keep running with the old settings
            return
        if (config.serving, config.bounds) != (self.settings, self.bounds):
            log.info("settings_reloaded", settings=msgspec.to_builtins(config.serving),
                     bounds=msgspec.to_builtins(config.bounds))  # fmt: skip
        self.settings, self.bounds = config.serving, config.bounds


def load_catalog(data_dir: Path) -> Catalog:
    """The front door's model catalog (`models.toml` in the data dir; none: an empty catalog)."""
    path = data_dir / CATALOG_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Catalog(models={})
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    try:
        return parse_catalog(text, str(path))
    except CatalogError as exc:
        raise ConfigError(str(exc)) from exc


async def run_node(
    config: NodeConfig,
    *,
    announce: Callable[[str], None],
    stop: asyncio.Event | None = None,
    reload_settings: Callable[[], NodeConfig] | None = None,
    handle_signals: bool = False,
) -> int:
    """Runs the node until `stop` is set; with `handle_signals` (the `mesh-actor run` process), SIGINT and
    SIGTERM stop it and SIGHUP reloads the serving settings, and the process's previous handlers are restored
    when it returns (an in-process node, e.g. in a test, installs none). Returns the process exit code."""
    log = get_logger(node=config.node_id)
    # --otlp without the extra stops the node here, before anything starts (`OtlpUnavailable`)
    exporter = start_exporter(config.otlp, node_id=config.node_id, version=VERSION) if config.otlp else None
    try:
        lock = lock_data_dir(config.data_dir)
    except BaseException:
        if exporter is not None:
            exporter.shutdown(0.0)  # nothing was exported yet: its thread ends at once
        raise
    stop = stop or asyncio.Event()
    tracing.set_enabled(config.trace_on)
    if exporter is not None:
        tracing.install(exporter)
        log.info("otlp_export", endpoint=traces_endpoint(config.otlp or ""))
    loop = asyncio.get_running_loop()
    serving = ServingSettingsHolder(config.serving, config.bounds, reload_settings)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if handle_signals:
                stack.enter_context(_signals(loop, stop, serving.reload))
            try:
                options = with_creds_file(config.nats)  # a credentials file may name the URLs
            except CredentialsError as exc:
                raise ConnectFailed(str(exc)) from exc
            embedded = not options.urls
            admin = options
            server: EmbeddedNats | None = None
            if embedded:
                cluster = _cluster_spec(config)
                server = EmbeddedNats(
                    config.data_dir,
                    preferred_port=config.nats_port,
                    host=config.nats_host,
                    prefix=config.prefix,
                    node_id=config.node_id,
                    cluster=cluster,
                    ready_timeout_s=120.0 if cluster else 20.0,  # a cluster's JetStream waits for a quorum
                )
                admin = (await _unless_stopped(server.start(), stop)).options()
                stack.push_async_callback(server.stop)
                assert server.node_credentials is not None
                options = server.node_credentials.options()  # the actors hold the rights of node:<id> only
            bus = await _unless_stopped(
                Bus.connect(options, name=f"mesh-actor node {config.node_id}", deadline_s=30.0), stop
            )
            stack.push_async_callback(bus.close)
            try:
                # The journal's limits are an admin's to change: the embedded server's owner sets them with
                # its admin user; a node on an external NATS creates the stream if it is missing (its role
                # may), and only warns when its limits differ.
                # a cluster that just formed may answer "temporarily unavailable" (or not yet) for a while
                settle_s = JOURNAL_SETTLE_S if embedded and config.cluster_listen is not None else 0.0
                await _unless_stopped(
                    _ensure_journal(config, bus if admin is options else None, admin, settle_s=settle_s), stop
                )
            except (nats.errors.NoRespondersError, TimeoutError) as exc:
                raise JetStreamUnavailable(_jetstream_off(options)) from exc
            except nats.js.errors.APIError as exc:
                if isinstance(exc, nats.js.errors.ServiceUnavailableError) and exc.err_code in _JETSTREAM_OFF:
                    raise JetStreamUnavailable(_jetstream_off(options)) from exc
                # a refusal: e.g. limits the server's storage cannot hold, replicas a cluster cannot place
                raise JetStreamUnavailable(
                    f"JetStream refused the journal stream on NATS at {','.join(options.urls)}: {exc.description} "
                    f"(error {exc.err_code})"
                ) from exc
            journal = Journal(bus, config.subjects, config.node_id)
            engine, engine_error = await _unless_stopped(describe_engine(config), stop)
            if engine_error:
                log.warning("no_llama_server", reason=engine_error)
            route_tls, lending = await asyncio.to_thread(split_serving, config, engine)
            # Bulk bytes beside the bus (docs/datapath.md): mutual TLS on the cluster address, else loopback only;
            # none with --no-direct-path (every byte over NATS).
            cluster_host = config.lend_host or (config.cluster_listen[0] if config.cluster_listen else None)
            data_path = DataPathConfig.for_node(route_tls, cluster_host) if config.direct_path else None
            facts = NodeFacts(
                node_id=config.node_id,
                started_at=time.time(),
                ttl_s=config.telemetry_ttl_s,
                memory_limit_bytes=config.memory_limit_bytes,
                llama_server=engine,
                llama_server_error=engine_error,
                settings=config.serving,
                split=split_role(route_tls, lending),
            )
            # Relative model names (registry entries) mean the same file to placement and to the runner.
            models_dir = config.models_dir or config.data_dir / "models"
            digests = FileDigests()  # one per node: placement and the runner hash each file version once
            l3 = L3Actor(config.node_id, config.data_dir, budget_bytes=config.l3_budget_bytes, datapath=data_path)
            handoff = HandoffActor(config.node_id, config.data_dir, restore=into_l3(l3), datapath=data_path)
            files = FilesActor(  # model files from peers (`mesh-actor models pull`)
                config.node_id,
                config.data_dir,
                models_dir=models_dir,
                digests=digests,
                trusted_registry_keys=tuple(config.registry_keys),
                datapath=data_path,
            )
            actors: list[Actor] = [
                TelemetryActor(
                    facts,
                    settings_source=serving.get,
                    bounds_source=serving.get_bounds,
                    files_source=lambda: files.holdings,  # placement prefers the nodes that hold a model's file
                    interval_s=config.telemetry_interval_s,
                ),
                PlacementActor(
                    trusted_registry_keys=config.registry_keys,
                    models_dir=models_dir,
                    digests=digests,
                    max_hold_s=config.max_hold_s,
                    client_share=config.client_share,  # what one client (its own NATS user) may hold booked
                    clients_share=config.clients_share,  # and every client together
                    model_roots=config.model_roots,  # with the models dir: no client names a file elsewhere
                ),
                RunnerActor(
                    config.node_id,
                    config.data_dir,
                    Path(engine.path) if engine else None,
                    lambda: serving.get() if engine is not None else None,  # what telemetry advertises
                    bounds_source=serving.get_bounds,
                    engine_version=engine.version if engine else None,
                    models_dir=models_dir,
                    digests=digests,
                    l3=l3,
                    handoff=handoff,
                    limits=RunnerLimits(
                        probe_interval_s=config.health_probe_interval_s,
                        probe_timeout_s=config.health_probe_timeout_s,
                    ),
                    route_tls=route_tls,
                    lending=lending,
                ),
                l3,
                RouterActor(),
                handoff,
                files,
            ]
            # Metrics are folded only where something serves them: the front door's listener, or --metrics.
            metrics = (
                MetricsActor(config.node_id, listen=config.metrics, api_key=config.api_key)
                if config.metrics_on and (config.http is not None or config.metrics is not None)
                else None
            )
            if metrics is not None:
                actors.append(metrics)
            if config.http is not None:
                catalog = load_catalog(config.data_dir)
                host, port = config.http
                dashboard = DashboardActor(api_key=config.api_key)  # /ui on the front door's listener
                actors.append(
                    FrontDoorActor(
                        host, port, catalog, models_dir=models_dir, api_key=config.api_key,
                        group_swaps=config.frontdoor_grouping, metrics=metrics.exposition if metrics else None,
                        dashboard=dashboard.register,
                    )
                )  # fmt: skip
                actors.append(dashboard)
            supervisor = Supervisor(bus=bus, journal=journal, subjects=config.subjects, node_id=config.node_id)
            url = ",".join(options.urls)
            journal.emit(
                NodeStarted,
                "node",
                version=VERSION,
                nats_url=url,
                embedded_nats=embedded,
                actors=tuple(a.name for a in actors),
            )
            return await _serve(
                config, journal, supervisor, actors, stop, announce, url, server.exited if server else None
            )
    finally:
        lock.close()
        tracing.set_enabled(True)
        if exporter is not None and tracing.uninstall() is exporter:
            await _stop_exporter(exporter, log)


async def _stop_exporter(exporter: tracing.SpanExporter, log: Any, deadline_s: float = 5.0) -> None:
    """Sends the spans still batched (the SDK's thread does; at most `deadline_s`)."""
    try:
        async with asyncio.timeout(deadline_s + 1):
            await asyncio.to_thread(exporter.shutdown, deadline_s)
    except TimeoutError:
        log.warning("otlp_shutdown_overdue", deadline_s=deadline_s)


def _cluster_spec(config: NodeConfig) -> ClusterSpec | None:
    if config.cluster_listen is None:
        return None
    host, port = config.cluster_listen
    if config.cluster_secret is None:
        get_logger(node=config.node_id).warning(
            "cluster_routes_unauthenticated", hint="give --cluster-secret-file (required beyond loopback)"
        )
    return ClusterSpec(
        name=config.prefix,
        host=host,
        port=port,
        routes=config.cluster_routes,
        secret=config.cluster_secret,
        server_name=config.node_id,
    )


# A 503 that means JetStream is off or not up: no error code (a disabled JetStream), 10008 ("JetStream system
# temporarily unavailable"), 10039 and 10076 (not enabled for the account, or at all). Other 503s (e.g. 10023,
# insufficient resources) are refusals of this stream.
_JETSTREAM_OFF = (None, 10008, 10039, 10076)


def _jetstream_off(options: NatsOptions) -> str:
    return (
        f"JetStream is not available on NATS at {','.join(options.urls)}; mesh-actor needs it "
        "for its journal and shared state (enable it on the server, e.g. nats-server -js)"
    )


#: How long an embedded cluster's node keeps asking for its journal while JetStream settles (its meta leader,
#: the stream's placement) before it says JetStream is not available.
JOURNAL_SETTLE_S: Final = 60.0
_SETTLE_RETRY_S: Final = 0.5


def _unsettled(exc: Exception) -> bool:
    """Whether JetStream's answer means "not up yet" rather than a refusal."""
    if isinstance(exc, nats.errors.NoRespondersError | TimeoutError):
        return True
    return isinstance(exc, nats.js.errors.ServiceUnavailableError) and exc.err_code in _JETSTREAM_OFF


async def _ensure_journal(config: NodeConfig, bus: Bus | None, admin: NatsOptions, *, settle_s: float = 0.0) -> None:
    """Creates (or checks) the journal stream; asks again for up to `settle_s` while JetStream is not up yet."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            await _ensure_journal_once(config, bus, admin)
            return
        except (nats.errors.Error, TimeoutError) as exc:
            if not _unsettled(exc) or time.monotonic() >= deadline:
                raise
            get_logger(node=config.node_id).info("journal_waits_for_jetstream", error=repr(exc))
            await asyncio.sleep(_SETTLE_RETRY_S)


async def _ensure_journal_once(config: NodeConfig, bus: Bus | None, admin: NatsOptions) -> None:
    if bus is not None:
        await ensure_events_stream(
            bus, config.subjects, max_age_s=config.journal_max_age_s, max_bytes=config.journal_max_bytes
        )
        return
    setup = await Bus.connect(admin, name=f"mesh-actor node {config.node_id} setup", deadline_s=30.0)
    try:
        await ensure_events_stream(
            setup, config.subjects, max_age_s=config.journal_max_age_s, max_bytes=config.journal_max_bytes
        )
    finally:
        await setup.close()


async def _serve(
    config: NodeConfig,
    journal: Journal,
    supervisor: Supervisor,
    actors: list[Actor],
    stop: asyncio.Event,
    announce: Callable[[str], None],
    url: str,
    nats_exited: Callable[[], Coroutine[Any, Any, int]] | None,
) -> int:
    """Runs until a stop signal, an actor that gives up, or (`nats_exited`: the embedded server's exit) the
    embedded NATS server's death: a node without its server cannot reach the bus again, and the others on that
    bus wait for it, so it stops with exit code 1 for its service manager to restart it (server included)."""
    log = get_logger(node=config.node_id)
    code, reason = 0, "signal"
    async with asyncio.TaskGroup() as tg:
        journal_task = tg.create_task(journal.run(), name="journal")
        supervised = tg.create_task(_supervise(supervisor, actors), name="supervisor")
        stopped = tg.create_task(stop.wait(), name="stop-signal")
        watched = {supervised, stopped}
        server_gone = tg.create_task(nats_exited(), name="embedded-nats") if nats_exited else None
        if server_gone is not None:
            watched.add(server_gone)
        where = "external" if nats_exited is None else "embedded"
        announce(f"mesh-actor node {config.node_id} running; NATS {url} ({where}); data dir {config.data_dir}")
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if supervised.done():
            code, reason = 1, supervised.result()
            log.error("node_stopping", reason=reason)
        elif server_gone is not None and server_gone.done() and not stopped.done():
            code, reason = 1, f"the embedded NATS server exited (code {server_gone.result()})"
            log.error("embedded_nats_exited", returncode=server_gone.result(), hint="restart the node")
        stopped.cancel()
        if server_gone is not None:
            server_gone.cancel()
        supervised.cancel()
        await _finish(supervised)
        journal.emit(NodeStopped, "node", reason=reason)
        if not await journal.flush(5.0):
            log.warning("journal_not_flushed", pending=journal.pending)
        journal_task.cancel()
    return code


async def _supervise(supervisor: Supervisor, actors: list[Actor]) -> str:
    """Runs the actors; returns why they all ended (an actor that gave up ends the node)."""
    try:
        await supervisor.run(actors)
    except ExceptionGroup as group:
        gave_up = group.subgroup(ActorGaveUpError)
        if gave_up is None:
            raise
        return str(gave_up.exceptions[0])
    return "every actor stopped"
