"""The runner's deadlines and bounds, in one place (the lifecycle's own deadlines are `instance_lifecycle.Timings`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.runner.instance_lifecycle import Timings
from runtime.restart import RestartPolicy

__all__ = ["RunnerLimits", "default_restart_policy"]


def default_restart_policy() -> RestartPolicy:
    return RestartPolicy(max_restarts=5, window_s=600.0, backoff_initial_s=1.0, backoff_max_s=60.0)


@dataclass(frozen=True)
class RunnerLimits:
    timings: Timings = field(default_factory=Timings)
    status_ttl_s: float = 30.0  # a live instance's record outlives a dead runner by at most this
    final_ttl_s: float = 600.0  # how long a stopped/failed/rejected instance stays visible
    max_instances: int = 64
    http_timeout_s: float = 5.0  # one /health, /props or /slots exchange
    probe_interval_s: float = 30.0  # a ready, idle server with no successful completion this long is probed
    probe_timeout_s: float = 30.0  # a probe (one token, nothing cached) must answer within this
    health_interval_s: float = 0.1
    log_max_bytes: int = 16 << 20  # per instance; one rotated file is kept besides
    kept_instance_dirs: int = 32  # directories (logs, slot files) of ended instances kept for post-mortems
    kv_timeout_s: float = 5.0
    # A start answers within the request deadline (30 s): reading the ledger (kv_timeout_s), the model file
    # (file_budget_s: header and blake3; a longer hash keeps running for the retry), the memory check and
    # claim (claim_budget_s), then the spawn (spawn_ack_s): 5 + 12 + 6 + 2 s at most.
    file_budget_s: float = 12.0
    claim_budget_s: float = 6.0
    claim_attempts: int = 8  # compare-and-set conflicts on the node's ledger before a start gives up
    spawn_ack_s: float = 2.0  # spawning takes milliseconds; the ack says where it stands after this
    #: What a stop waits for the server to be gone before it answers with the state it reached.
    stop_answer_s: float = 25.0
