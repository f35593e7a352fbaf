"""Flow-level network: links with a capacity per direction, shared max-min fairly.

Every transfer is a *flow* over a path of links (a storage node's egress and a
replica NIC's ingress for a read; the reverse for a write; optionally a staging
copy through CPU memory). Concurrent flows share each link's capacity by
**max-min fairness**, recomputed whenever a flow starts or ends or a capacity
changes — progressive filling, as flow-level simulators do (SimGrid's validated
fluid model is the reference point):

    repeat: the link with the smallest fair share  c_l / n_l  (remaining capacity
    over unfrozen flows crossing it) fixes that share for all its unfrozen flows;
    subtract it from every other link those flows cross.

A flow's rate is therefore its bottleneck share along its path; no flow ever
runs faster than the smallest link it crosses, and a link never carries more
than its capacity. Priority classes are strict: class 0 (loads) is filled
first, then class 1 (background publishes) shares whatever capacity is left.

What it leaves out, on purpose: packet loss and retransmission, TCP slow start
and incast collapse, RDMA queue-pair limits, propagation delay beyond a fixed
per-flow latency. Those shape the tail of real fabrics; the fluid model gives
the first-order effect — flows on a shared link slow each other down in
proportion, and traffic in the other direction does not.

Flows that share the same path and class always get the same rate, so they are
kept in a *group* with one service counter (bytes each of its flows has
received since the group was made); a flow finishes when the counter passes its
target. A recomputation costs O((links + groups) log links), not O(flows).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

#: bytes of slack when deciding that a flow has finished (float rounding of rate × time)
_EPS_BYTES = 1e-6


class Link:
    """One direction of a port: a storage node's egress, a NIC's ingress, a staging copy."""

    __slots__ = ("name", "capacity_bytes_per_s", "bytes_carried", "flows", "_rem", "_n")

    def __init__(self, name: str, capacity_bytes_per_s: float) -> None:
        if not capacity_bytes_per_s >= 0 or math.isinf(capacity_bytes_per_s):
            raise ConfigError("capacity_bytes_per_s", f"link {name!r} needs a finite capacity >= 0, got {capacity_bytes_per_s!r}")
        self.name = name
        self.capacity_bytes_per_s = float(capacity_bytes_per_s)
        self.bytes_carried = 0.0
        self.flows = 0  # flows moving bytes on it now
        self._rem = 0.0
        self._n = 0

    def __repr__(self) -> str:
        return f"Link({self.name!r}, {self.capacity_bytes_per_s:.3g} B/s)"


class Flow:
    """One transfer in flight. ``done_bytes()`` is exact at the network's current time."""

    __slots__ = ("fid", "group", "size_bytes", "target", "start_s", "active_s", "end_s", "payload", "on_done", "alive", "delivered", "_net")

    def __init__(self, fid: int, size_bytes: float, payload: Any, on_done: Callable[[Flow, float], None] | None, net: FlowNetwork) -> None:
        self.fid = fid
        self.group: _Group | None = None
        self.size_bytes = float(size_bytes)
        self.target = 0.0
        self.start_s = 0.0
        self.active_s = 0.0
        self.end_s: float | None = None
        self.payload = payload
        self.on_done = on_done
        self.alive = True
        self.delivered = 0.0  # bytes delivered, fixed when the flow ends or is cancelled
        self._net = net

    @property
    def rate_bytes_per_s(self) -> float:
        g = self.group
        return g.rate if g is not None and self.alive else 0.0

    def done_bytes(self) -> float:
        """Bytes this flow has delivered so far (its whole size once it has ended)."""
        g = self.group
        if not self.alive or g is None:
            return self.delivered
        self._net._sync(g)
        return min(max(self.size_bytes - (self.target - g.served), 0.0), self.size_bytes)

    def remaining_bytes(self) -> float:
        return self.size_bytes - self.done_bytes()


class _Group:
    __slots__ = ("links", "priority", "served", "rate", "t", "heap", "count")

    def __init__(self, links: tuple[Link, ...], priority: int, t: float) -> None:
        self.links = links
        self.priority = priority
        self.served = 0.0
        self.rate = 0.0
        self.t = t
        self.heap: list[tuple[float, int, Flow]] = []
        self.count = 0


class FlowNetwork:
    """Links, flows and max-min fair rates; the caller owns the clock and the event loop.

    Use: ``start`` / ``cancel`` / ``set_capacity`` at time t, then ask
    ``next_event_s()`` and call ``advance(t)`` at that time (completed flows call
    their ``on_done(flow, t)``). ``version`` changes whenever the next event
    time may have changed, so a caller's stale wake-ups can be ignored.
    """

    def __init__(self) -> None:
        self.links: dict[str, Link] = {}
        self._groups: dict[tuple[tuple[int, ...], int], _Group] = {}
        self._pending: list[tuple[float, int, Flow, tuple[Link, ...], int]] = []
        self._ids = 0
        self.t = 0.0
        self.version = 0
        self._listeners: list[Callable[[float], None]] = []

    # ------------------------------------------------------------------ topology

    def add_link(self, name: str, capacity_bytes_per_s: float) -> Link:
        if name in self.links:
            raise ConfigError("name", f"link {name!r} exists already")
        link = Link(name, capacity_bytes_per_s)
        self.links[name] = link
        return link

    def set_capacity(self, t: float, link: Link, capacity_bytes_per_s: float) -> None:
        if not capacity_bytes_per_s >= 0 or math.isinf(capacity_bytes_per_s):
            raise ConfigError("capacity_bytes_per_s", f"must be finite and >= 0, got {capacity_bytes_per_s!r}")
        self._advance_to(t)
        link.capacity_bytes_per_s = float(capacity_bytes_per_s)
        self._recompute()

    def on_rates_changed(self, fn: Callable[[float], None]) -> None:
        """Call ``fn(t)`` after every recomputation (a caller tracking a flow's progress)."""
        self._listeners.append(fn)

    # ------------------------------------------------------------------ flows

    def start(self, t: float, links: tuple[Link, ...] | list[Link], size_bytes: float, *, priority: int = 0, latency_s: float = 0.0,
              payload: Any = None, on_done: Callable[[Flow, float], None] | None = None) -> Flow:
        """A flow of ``size_bytes`` over ``links``; it starts moving bytes after ``latency_s``
        (per-transfer overhead: connection, request, first byte) and ends when all have arrived."""
        if not size_bytes >= 0 or math.isinf(size_bytes):
            raise ConfigError("size_bytes", f"must be finite and >= 0, got {size_bytes!r}")
        if not latency_s >= 0:
            raise ConfigError("latency_s", f"must be >= 0, got {latency_s!r}")
        if not links:
            raise ConfigError("links", "a flow crosses at least one link")
        if priority not in (0, 1):
            raise ConfigError("priority", f"must be 0 (foreground) or 1 (background), got {priority!r}")
        self._ids += 1
        f = Flow(self._ids, size_bytes, payload, on_done, self)
        f.start_s = t
        f.active_s = t + latency_s
        heapq.heappush(self._pending, (t + latency_s, f.fid, f, tuple(links), priority))
        self._advance_to(t)
        self.version += 1
        return f

    def cancel(self, t: float, flow: Flow) -> float:
        """Stop a flow now (abandoned, timed out); returns the bytes it delivered."""
        if not flow.alive:
            return flow.done_bytes()
        self._advance_to(t)
        done = flow.done_bytes()
        flow.alive = False
        flow.delivered = done
        g = flow.group
        if g is not None:
            for link in g.links:
                link.bytes_carried += done
                link.flows -= 1
            g.count -= 1
            if g.count == 0:
                self._drop(g)
            self._recompute()
        else:
            self.version += 1  # still pending: it will be skipped when its latency ends
        return done

    # ------------------------------------------------------------------ time

    def next_event_s(self) -> float:
        """When the next flow starts moving or finishes (inf if never, e.g. every link at 0)."""
        best = math.inf
        while self._pending and not self._pending[0][2].alive:
            heapq.heappop(self._pending)
        if self._pending:
            best = self._pending[0][0]
        for g in self._groups.values():
            while g.heap and not g.heap[0][2].alive:
                heapq.heappop(g.heap)
            if not g.heap:
                continue
            f = g.heap[0][2]
            self._sync(g)
            left = g.heap[0][0] - g.served
            if self._due(g, g.heap[0][0], f):
                when = self.t
            elif g.rate > 0:
                when = self.t + left / g.rate
            else:
                continue
            if when < best:
                best = when
        return best

    def sync(self, t: float) -> None:
        """Move the clock to ``t`` without starting or ending a flow (``t`` must not pass ``next_event_s()``): a flow's
        ``done_bytes()`` and ``flows_on`` then read the bytes moved by ``t``, not by the last event."""
        self._advance_to(t)

    def advance(self, t: float) -> list[Flow]:
        """Move to time t: activate flows whose latency has passed, finish flows whose bytes
        have all arrived (calling their ``on_done``), recompute rates. Returns the finished flows."""
        self._advance_to(t)
        finished: list[Flow] = []
        changed = False
        while self._pending and self._pending[0][0] <= t:
            _, _, f, links, prio = heapq.heappop(self._pending)
            if not f.alive:
                continue
            self._join(f, links, prio)
            changed = True
        for g in list(self._groups.values()):
            heap = g.heap
            while heap and (not heap[0][2].alive or self._due(g, heap[0][0], heap[0][2])):
                _, _, f = heapq.heappop(heap)
                if not f.alive:
                    continue
                f.alive = False
                f.end_s = t
                f.delivered = f.size_bytes
                g.count -= 1
                for link in g.links:
                    link.bytes_carried += f.size_bytes
                    link.flows -= 1
                finished.append(f)
                changed = True
            if g.count == 0:
                self._drop(g)
        if changed:
            self._recompute()
        for f in finished:
            if f.on_done is not None:
                f.on_done(f, t)
        return finished

    # ------------------------------------------------------------------ queries

    def flows_on(self, link: Link, priority: int | None = None) -> list[float]:
        """Remaining bytes of every flow moving on ``link`` now (of one class, or all)."""
        out: list[float] = []
        for g in self._groups.values():
            if link in g.links and (priority is None or g.priority <= priority):
                self._sync(g)
                out.extend(f.target - g.served for _, _, f in g.heap if f.alive)
        for _, _, f, links, prio in self._pending:
            if f.alive and link in links and (priority is None or prio <= priority):
                out.append(f.size_bytes)
        return out

    def flow_count(self, link: Link) -> int:
        return link.flows

    def link_state(self) -> dict[str, tuple[float, float, int]]:
        """Per link now: (capacity bytes/s, utilisation 0..1, flows on it)."""
        used: dict[int, float] = {}
        for g in self._groups.values():
            for link in g.links:
                used[id(link)] = used.get(id(link), 0.0) + g.rate * g.count
        out = {}
        for name, link in self.links.items():
            cap = link.capacity_bytes_per_s
            out[name] = (cap, min(used.get(id(link), 0.0) / cap, 1.0) if cap > 0 else (1.0 if link.flows else 0.0), link.flows)
        return out

    def active_flows(self) -> int:
        return sum(g.count for g in self._groups.values()) + sum(1 for p in self._pending if p[2].alive)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _due(g: _Group, target: float, f: Flow) -> bool:
        left = target - g.served
        return left <= _EPS_BYTES + 1e-9 * f.size_bytes or (g.rate > 0 and left / g.rate <= 1e-9)

    def _sync(self, g: _Group) -> None:
        if g.t != self.t:
            g.served += g.rate * (self.t - g.t)
            g.t = self.t

    def _advance_to(self, t: float) -> None:
        if t < self.t - 1e-9:
            raise ConfigError("t", f"time went backwards ({t} < {self.t})")
        if t > self.t:
            self.t = t
            for g in self._groups.values():
                self._sync(g)

    def _join(self, f: Flow, links: tuple[Link, ...], prio: int) -> None:
        key = (tuple(id(x) for x in links), prio)
        g = self._groups.get(key)
        if g is None:
            g = _Group(links, prio, self.t)
            self._groups[key] = g
        self._sync(g)
        f.group = g
        f.target = g.served + f.size_bytes
        heapq.heappush(g.heap, (f.target, f.fid, f))
        g.count += 1
        for link in links:
            link.flows += 1

    def _drop(self, g: _Group) -> None:
        self._groups.pop((tuple(id(x) for x in g.links), g.priority), None)
        g.rate = 0.0

    def _recompute(self) -> None:
        """Max-min fair rates by progressive filling, class 0 first, then class 1 on what is left."""
        self.version += 1
        for link in self.links.values():
            link._rem = link.capacity_bytes_per_s
        for prio in (0, 1):
            groups = [g for g in self._groups.values() if g.priority == prio and g.count > 0]
            if not groups:
                continue
            touched: dict[int, Link] = {}
            by_link: dict[int, list[_Group]] = {}
            for g in groups:
                for link in g.links:
                    if id(link) not in touched:
                        touched[id(link)] = link
                        link._n = 0
                        by_link[id(link)] = []
                    link._n += g.count
                    by_link[id(link)].append(g)
            heap = [(max(link._rem, 0.0) / link._n, i, link) for i, link in enumerate(touched.values())]
            heapq.heapify(heap)
            frozen: set[int] = set()
            while heap:
                share, i, link = heapq.heappop(heap)
                if link._n <= 0:
                    continue
                cur = max(link._rem, 0.0) / link._n
                if cur > share * (1 + 1e-12) + 1e-12:  # stale: shares only grow as other links freeze
                    heapq.heappush(heap, (cur, i, link))
                    continue
                for g in by_link[id(link)]:
                    if id(g) in frozen:
                        continue
                    frozen.add(id(g))
                    g.rate = cur
                    for other in g.links:
                        other._rem -= cur * g.count
                        other._n -= g.count
        for fn in self._listeners:
            fn(self.t)
