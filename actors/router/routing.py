"""Which ready instance serves a generation (router core, pure: the decision `mesh-actor replay` re-runs).

The cost of sending a prompt of `n_prompt` tokens to a candidate is counted in prompt tokens' worth of work:

* `new`: the tokens it must evaluate, `n_prompt - held` (the prefix it holds, resident in a slot or in L3,
  is reused);
* `restore`: bringing a stored prefix into a slot is cheap but not free: `held x l3_local_cost` from the
  node's own store, `held x l3_peer_cost` from a peer's (the bytes cross the network first); resident is free;
* `load`: each generation already running or queued there slows this one (`active_cost` each), and when no
  slot is free it waits for one (`wait_cost` per request ahead of it, itself included).

The lowest cost wins; ties go to the instance that holds more, then to the lowest instance id (natural
order), so the same inputs always give the same choice. Nothing here reads a clock or the bus.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from actors.handoff import cost
from messages.generate import Candidate, RouteDecision, RouteWeights, Scored

__all__ = ["DEFAULT_WEIGHTS", "ROUTER_VERSION", "Candidate", "RouteDecision", "RouteWeights", "Scored", "choose"]

#: Named in every routing event; bump it when `choose` or `place_phases` changes what it decides.
#: route-3: a prefill elsewhere is priced with what that instance holds, not with what the chosen one holds.
ROUTER_VERSION: Final = "route-3"
#: Open, commit and restore of one handoff, on top of the bytes moved (seconds), for a link whose own fixed
#: cost has not been measured (events recorded before links were fitted).
HANDOFF_FIXED_S: Final = 0.05


DEFAULT_WEIGHTS: Final = RouteWeights()


def _natural(text: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", text) if p)


def _score(c: Candidate, n_prompt: int, w: RouteWeights) -> Scored:
    held = min(c.held_tokens, n_prompt)
    per_token = {"resident": 0.0, "l3_local": w.l3_local_cost, "l3_peer": w.l3_peer_cost, "cold": 0.0}[c.source]
    active = max(c.busy + c.queued, c.inflight)
    waiting = max(0, active - c.slots + 1)  # requests ahead of this one, itself included, once slots are full
    load = w.active_cost * active + w.wait_cost * waiting
    restore = held * per_token
    new = n_prompt - held
    return Scored(instance_id=c.instance_id, cost=new + restore + load, new_tokens=new, restore=restore, load=load)


def choose(n_prompt: int, candidates: Sequence[Candidate], weights: RouteWeights = DEFAULT_WEIGHTS) -> RouteDecision:
    """The candidate with the lowest cost for a prompt of `n_prompt` tokens (0: unknown length)."""
    if not candidates:
        return RouteDecision(chosen=None, reason="no ready instance of the model")
    by_id = {c.instance_id: c for c in candidates}
    scores = sorted(
        (_score(c, n_prompt, weights) for c in candidates),
        key=lambda s: (s.cost, -by_id[s.instance_id].held_tokens, _natural(s.instance_id)),
    )
    best = by_id[scores[0].instance_id]
    if len(candidates) == 1:
        reason = "the only ready instance"
    elif best.held_tokens > 0:
        reason = f"holds {best.held_tokens} of {n_prompt} prompt tokens ({best.source}) at cost {scores[0].cost:g}"
    else:
        reason = f"lowest load (cost {scores[0].cost:g})"
    return RouteDecision(chosen=best.instance_id, reason=reason, scores=tuple(scores))


def link_key(src: str, dst: str) -> str:
    return f"{src}>{dst}"


def _held_for_prefill(c: Candidate, n_state: int) -> int:
    """What a prefill node need not compute: only a prefix resident in one of its slots (a prefill there reuses
    its slot's cache; it restores nothing from L3)."""
    return min(c.held_tokens, n_state) if c.source == "resident" else 0


def place_phases(
    n_prompt: int,
    decision: RouteDecision,
    candidates: Sequence[Candidate],
    links: Mapping[str, float],
    link_fixed_s: Mapping[str, float] | None = None,
) -> RouteDecision:
    """Whether to prefill elsewhere than the chosen instance: on another node's instance of the same identity,
    when the handoff cost model (`actors.handoff.cost`) says that strictly wins, with measured rates only (an
    unmeasured instance or link never disaggregates). `links`: each pair's handoff bytes/s; `link_fixed_s`: its
    fixed cost per handoff (`HANDOFF_FIXED_S` where not given).

    Each side is priced by what it would compute: here, the prompt less what the chosen instance holds; there,
    the prompt less what that instance holds resident, and the whole state crosses the link (the prefix held
    here is not used on that path: the decoding node restores the state it is sent)."""
    fixed = link_fixed_s or {}
    chosen = next((c for c in candidates if c.instance_id == decision.chosen), None)
    if chosen is None or chosen.identity is None or chosen.prefill_tokens_per_s <= 0:
        return decision
    n_state = n_prompt - 1  # the last token is always computed where it decodes
    held_here = min(chosen.held_tokens, n_prompt)
    if n_state - held_here <= 0:
        return decision
    size = cost.StateSize(bytes_per_token=chosen.state_bytes_per_token, floor_bytes=chosen.state_floor_bytes)
    best: tuple[float, str, cost.Decision] | None = None
    for c in candidates:
        link = links.get(link_key(c.node, chosen.node), 0.0)
        if c.node == chosen.node or c.identity != chosen.identity or c.prefill_tokens_per_s <= 0 or link <= 0:
            continue
        rates = cost.Rates(
            local_tokens_per_s=chosen.prefill_tokens_per_s,
            remote_tokens_per_s=c.prefill_tokens_per_s,
            link_bytes_per_s=link,
            fixed_s=fixed.get(link_key(c.node, chosen.node), HANDOFF_FIXED_S),
        )
        verdict = cost.decide(n_state, size, rates, local_held=held_here, remote_held=_held_for_prefill(c, n_state))
        if verdict.path == "disaggregated" and (best is None or (verdict.remote_s, c.node) < best[:2]):
            best = (verdict.remote_s, c.node, verdict)
    if best is None:
        return decision
    remote_s, node, verdict = best
    # Worded as before this change when both sides compute the same tokens, so older decisions replay alike.
    here = f"{verdict.local_s:.3f}s here"
    if verdict.local_tokens != verdict.remote_tokens:
        here = f"{verdict.local_s:.3f}s for the {verdict.local_tokens} tokens not held here"
    crossover = (
        f"break-even {verdict.breakeven} tokens"
        if verdict.breakeven is not None
        else f"{node} holds {verdict.n_tokens - verdict.remote_tokens} of them"
    )
    there = f"prefill {verdict.remote_tokens} tokens on {node}: {remote_s:.3f}s with the handoff"
    reason = f"{there} vs {here} ({crossover})"
    return msgspec.structs.replace(decision, prefill_node=node, prefill_reason=reason)


def route(
    n_prompt: int,
    candidates: Sequence[Candidate],
    weights: RouteWeights = DEFAULT_WEIGHTS,
    links: Mapping[str, float] | None = None,
    link_fixed_s: Mapping[str, float] | None = None,
) -> RouteDecision:
    """The whole routing decision: the instance (`choose`), then where to prefill (`place_phases`)."""
    return place_phases(n_prompt, choose(n_prompt, candidates, weights), candidates, links or {}, link_fixed_s)
