"""Connection budgets: one client flooding the proxy with connections never locks the others out.

Every open connection counts against one client. Until one of its requests presents a key, a
connection is its address's; once a request presents a session key or the admin token, it is that
key's. So the local agents (one session key each), the trainer's control calls (the admin token) and
a misbehaving client on the same loopback address each have a budget of their own.

An address may hold `max_per_client` connections not yet known by a key, and the proxy `max_total`
in all. A connection beyond either is dealt with at accept: the oldest idle one of the address (or
of all) that no key owns is closed to make room, and if every such one is in the middle of a request,
the new one is closed at once. Idle unknown connections are what a flood is made of (silent, or a
request head never finished); a client that sends its request at once, as every agent does, is under
way before it could be the oldest. A request presenting a key whose budget is full is answered 503
and its connection closed.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

from proxy.errors import ProxyError

RETRY_AFTER_S = "1"
HEAD_END = b"\r\n\r\n"

Transport = asyncio.BaseTransport


class ConnectionGuard:
    """Counts open connections per client; makes room for a new one, or refuses it, at accept."""

    def __init__(self, max_total: int, max_per_client: int) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.open = 0
        self.refused = 0  # connections closed at accept (every unknown one of their address under way)
        self.evicted = 0  # idle unknown connections closed to make room for a new one
        self._owner: dict[Transport, str] = {}  # an address, or "key <who>" once a request presents a key
        self._count: dict[str, int] = {}
        self.idle: OrderedDict[Transport, None] = OrderedDict()  # unknown and between requests, oldest first
        self._idle_from: dict[str, OrderedDict[Transport, None]] = {}  # the same, per address

    def protocol_factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A factory for `loop.create_server` whose connections are counted by this guard."""
        return lambda: _Counted(self, inner)

    def admit(self, transport: Transport) -> bool:
        """Count a new connection, making room for it; False: close it at once, nothing had room to give."""
        address = _address(transport)
        if self._count.get(address, 0) >= self.max_per_client and not self._evict(self._idle_from.get(address)):
            self.refused += 1
            return False
        if self.open >= self.max_total and not self._evict(self.idle):
            self.refused += 1
            return False
        self.open += 1
        self._join(transport, address)
        self.finished(transport)
        return True

    def closed(self, transport: Transport) -> None:
        if transport in self._owner:
            self._leave(transport)
            self.open -= 1

    def under_way(self, transport: Transport) -> None:
        """A request's head arrived on an unknown connection: it is not idle (never closed to make room)."""
        owner = self._owner.get(transport)
        if owner is not None and transport in self.idle:
            del self.idle[transport]
            del self._idle_from[owner][transport]

    def finished(self, transport: Transport | None) -> None:
        """A request on the connection is answered: an unknown one is idle again, the newest."""
        owner = self._owner.get(transport) if transport is not None else None
        if transport is None or owner is None or owner.startswith("key "):
            return
        self.idle[transport] = None
        self.idle.move_to_end(transport)
        self._idle_from.setdefault(owner, OrderedDict())[transport] = None
        self._idle_from[owner].move_to_end(transport)

    def identify(self, transport: Transport | None, who: str) -> None:
        """Count the connection against the key its request presented (`who`: "admin", "session <id>").

        Raises a 503 (closing the connection) when that key's budget is full.
        """
        owner = self._owner.get(transport) if transport is not None else None
        key = "key " + who
        if transport is None or owner is None or owner == key:
            return
        if self._count.get(key, 0) >= self.max_per_client:
            raise ProxyError(503, f"the proxy is at its connection limit: {self.max_per_client} open connections "
                                  f"for {who}; retry shortly", headers={"Retry-After": RETRY_AFTER_S},
                             close_connection=True)
        self._leave(transport)
        self._join(transport, key)

    def _join(self, transport: Transport, owner: str) -> None:
        self._owner[transport] = owner
        self._count[owner] = self._count.get(owner, 0) + 1

    def _leave(self, transport: Transport) -> None:
        owner = self._owner.pop(transport)
        count = self._count[owner] - 1
        if count:
            self._count[owner] = count
        else:
            del self._count[owner]
        if transport in self.idle:
            del self.idle[transport]
            idle = self._idle_from[owner]
            del idle[transport]
            if not idle:
                del self._idle_from[owner]

    def _evict(self, idle: OrderedDict[Transport, None] | None) -> bool:
        """Close the oldest of these idle connections; False if there is none."""
        if not idle:
            return False
        victim = next(iter(idle))
        self.closed(victim)
        victim.close()
        self.evicted += 1
        return True


def _address(transport: Transport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


class _Counted(asyncio.Protocol):
    """One connection's HTTP protocol, made only once the guard admits the connection, and reported to it."""

    __slots__ = ("_guard", "_inner", "_make", "_tail", "_transport")

    def __init__(self, guard: ConnectionGuard, make: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make = make
        self._inner: asyncio.Protocol | None = None
        self._transport: Transport | None = None
        self._tail = b""  # the last bytes of an unfinished request head on an idle unknown connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._guard.admit(transport):
            transport.close()
            return
        self._transport = transport
        self._inner = self._make()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is None:
            return
        if self._transport is not None:
            self._guard.closed(self._transport)
            self._transport = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is None or self._transport is None:
            return
        if self._transport in self._guard.idle:  # watch for the end of a request head
            seen = self._tail + data
            if HEAD_END in seen:
                self._guard.under_way(self._transport)
                self._tail = b""
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
