"""Models on demand: what to stop to make room, and what has been idle too long (front-door core, pure).

Rules this module keeps:

* Room is made on one node, from placement's own figures: for each device placement found short, `need`
  (what the model needs there) and `have` (what is free). Stopping an instance frees what its reservation
  holds on each device.
* Never stopped: a pinned instance, one that is generating or has requests waiting, one used within
  `min_idle_s` (so two models that take turns do not unload each other per request: requests for the model
  just loaded are served first). Among the rest, the lowest priority goes first, then the least recently used,
  then the lowest instance id.
* Request classes (a tenant key's `priority`): a request of a higher class than the last request an idle
  instance served may stop it within its `min_idle_s` too; a lower or equal class waits that grace out. Among
  the stoppable, the catalog's priority still goes first, then the lower class of the last use. Pinned
  instances and running generations stay whatever the class.
* The node whose shortfall is covered by the fewest stops wins (then the fewest bytes stopped, then the node id).
* When no node could ever hold the model (its need exceeds a device's size less what pinned instances and
  reservations that are not ours hold), it never fits: refused at once with need and have. Anything else that
  cannot be covered now (busy instances, a view that lags a stop) is a wait: placement is asked again. The
  sizes come from the nodes' telemetry, so a placement decision made on a ledger a moment older than ours can
  never turn into a false "never fits".
* Idle: an unpinned instance of a model with an `idle_ttl_s`, not in use, unused for longer than that, stops.
* Grouping (the default) is what the rules above give: a model's requests share one start, and the model just
  loaded serves its requests before it can be stopped. With grouping off (for comparison), `ArrivalOrder`
  serves requests in the order they came: a request may look for an instance only when no earlier one still
  waits for another model, so two models asked for in turns swap once per change of model.
* No clock and no I/O: `now` is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec

from messages.placement import DeviceShortfall

__all__ = ["ArrivalOrder", "NeverFits", "Running", "Stop", "Wait", "idle_expired", "plan_room"]


class Running(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    node: str
    model: str | None  # its catalog name (None: started by someone else)
    held: dict[str, int]  # device -> bytes its reservation holds
    last_used: float
    priority: int = 0
    pinned: bool = False
    in_use: bool = False  # generating, or requests waiting for it
    used_class: int = 0  # the class of the last request it served
    idle_ttl_s: float | None = None


class Stop(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    instances: tuple[str, ...]
    frees: dict[str, int]  # device -> bytes the stops free


class Wait(msgspec.Struct, frozen=True, kw_only=True):
    reason: str


class NeverFits(msgspec.Struct, frozen=True, kw_only=True):
    need: dict[str, int]  # on the node that came closest: device -> bytes
    have: dict[str, int]  # free there with every unpinned instance stopped
    node: str | None


def _covered(shortfalls: Sequence[DeviceShortfall], freed: Mapping[str, int]) -> bool:
    return all(s.have_bytes + freed.get(s.device, 0) >= s.need_bytes for s in shortfalls)


def _add(total: dict[str, int], held: Mapping[str, int]) -> dict[str, int]:
    out = dict(total)
    for device, size in held.items():
        out[device] = out.get(device, 0) + size
    return out


def plan_room(
    shortfalls: Mapping[str, Sequence[DeviceShortfall]],
    running: Iterable[Running],
    *,
    now: float,
    min_idle_s: float = 1.0,
    sizes: Mapping[str, Mapping[str, int]] | None = None,
    requester_class: int = 0,
) -> Stop | Wait | NeverFits:
    """What to do for a model placement refused on the nodes of `shortfalls` for want of memory. `sizes`: each
    node's device sizes (capped by its memory limit); without them, "never" is judged from `shortfalls`.
    `requester_class`: the highest class among the requests waiting for the model."""
    by_node: dict[str, list[Running]] = {}
    for r in running:
        by_node.setdefault(r.node, []).append(r)
    best: tuple[tuple[int, int, str], Stop] | None = None
    could_later = False
    closest: tuple[int, NeverFits] | None = None
    for node, short in sorted(shortfalls.items()):
        if not short:
            continue
        here = by_node.get(node, [])
        unpinned = [r for r in here if not r.pinned]
        everything: dict[str, int] = {}
        for r in unpinned:
            everything = _add(everything, r.held)
        node_sizes = sizes.get(node) if sizes is not None else None
        if node_sizes is not None:
            kept: dict[str, int] = {}
            for r in here:
                if r.pinned:
                    kept = _add(kept, r.held)
            ever = {s.device: max(0, node_sizes.get(s.device, 0) - kept.get(s.device, 0)) for s in short}
        else:
            ever = {s.device: s.have_bytes + everything.get(s.device, 0) for s in short}
        if any(s.need_bytes > ever[s.device] for s in short):
            missing = sum(max(0, s.need_bytes - ever[s.device]) for s in short)
            fits = NeverFits(need={s.device: s.need_bytes for s in short}, have=ever, node=node)
            if closest is None or missing < closest[0]:
                closest = (missing, fits)
            continue
        if not _covered(short, everything):
            could_later = True  # our view lags (a stop not yet released everywhere): ask placement again
            continue
        free_now = sorted(
            (
                r
                for r in unpinned
                if not r.in_use and (now - r.last_used >= min_idle_s or r.used_class < requester_class)
            ),
            key=lambda r: (r.priority, r.used_class, r.last_used, r.instance_id),
        )
        freed: dict[str, int] = {}
        chosen: list[str] = []
        for r in free_now:
            if _covered(short, freed):
                break
            freed = _add(freed, r.held)
            chosen.append(r.instance_id)
        if not _covered(short, freed):
            could_later = True  # the busy or just-used ones would make room once they are done
            continue
        stop = Stop(node=node, instances=tuple(chosen), frees=freed)
        key = (len(chosen), sum(freed.values()), node)
        if best is None or key < best[0]:
            best = (key, stop)
    if best is not None:
        return best[1]
    if could_later:
        return Wait(reason="the instances that would make room are in use; waiting for them to finish")
    if closest is not None:
        return closest[1]
    return NeverFits(need={}, have={}, node=None)


def idle_expired(running: Iterable[Running], *, now: float) -> list[str]:
    """The instances to stop for idleness, oldest first."""
    idle = [
        r
        for r in running
        if r.idle_ttl_s is not None and not r.pinned and not r.in_use and now - r.last_used > r.idle_ttl_s
    ]
    return [r.instance_id for r in sorted(idle, key=lambda r: (r.last_used, r.instance_id))]


class ArrivalOrder:
    """Requests in arrival order across models (grouping off). A ticket is taken on arrival and given back
    once its request has an instance (or gave up)."""

    def __init__(self) -> None:
        self._waiting: dict[int, str] = {}  # ticket -> model, in arrival order
        self._next = 0

    def arrive(self, model: str) -> int:
        ticket = self._next
        self._next += 1
        self._waiting[ticket] = model
        return ticket

    def may_go(self, ticket: int) -> bool:
        """Whether every request that came before `ticket` and still waits is for the same model."""
        model = self._waiting[ticket]
        for earlier, other in self._waiting.items():
            if earlier >= ticket:
                return True
            if other != model:
                return False
        return True

    def leave(self, ticket: int) -> None:
        self._waiting.pop(ticket, None)

    def __len__(self) -> int:
        return len(self._waiting)
