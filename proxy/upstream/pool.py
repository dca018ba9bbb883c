"""Several engines behind one proxy: which engine serves a call, and which engines may serve at all.

A session stays on the engine that served its first call, whose prefix cache then holds its
conversation; a new session goes to the serving engine with the fewest open sessions (then the
fewest requests at it). An engine that stops answering (a refused or broken connection it cannot
explain with a healthy `/health`, or two failed health probes in a row) is taken out, and its
sessions' next requests go to another engine: their prompts are token ids (token in, token out), so
a conversation stays one exact chain whichever engine samples its next turn. Every engine is probed
every `check_s`, one engine as well as several, so `/health` says when none serves; a call that finds
none serving probes them all once more before it is answered 503, so an engine that is back serves
at once. A vLLM server with data parallelism (`--data-parallel-size N`) is N places a session can
stay: its samples carry the rank it stays on (`X-data-parallel-rank`), so vLLM does not spread one
conversation over its copies.

An engine serves only while it holds the weights the learner last announced. When a version is
announced, the engines that report it (`GET /weight_info`) serve and the others wait, `stale`,
until a sync reaches them; an engine that comes back after a crash waits the same way, so it never
samples with the weights it started with. An announcement no engine reports (a run that never
pushes weights) changes nothing. With one engine, a call's failure reaches the agent as the engine's
own error (there is no other engine to move the call to); only the probes take it out.

While `waiting` is set (`harness-rl serve proxy` waits for its engine and checks it), no call is
sent: each is answered 503 with that reason.

The session a request is made for rides in a context variable (`bind_session`, set by the agent
route), so every request made on a call's behalf — prompt rendering, sampling, the parsers' reads —
reaches the session's engine without the session threading through each signature.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp
import msgspec

from proxy.control_api import EngineHealth
from proxy.errors import ProxyError
from proxy.upstream.client import EngineClient, EngineUnreachable

log = logging.getLogger("harness_rl.proxy")

EngineState = Literal["serving", "stale", "down"]
SAMPLE_PATH = "/inference/v1/generate"
PROBE_TIMEOUT_S = 5.0
PROBE_FAILURES = 2  # failed health probes in a row that take a serving engine out
NO_ENGINE_RETRY_AFTER_S = "5"
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"  # vLLM's: which data-parallel copy samples the request


class Session(Protocol):
    """What the pool needs of a capture session (`capture.session.Session`): the engine side sits below capture."""

    closed: bool
    deleted: bool

    @property
    def id(self) -> str: ...


@dataclass
class Upstream:
    """One engine of the pool and what the proxy knows of it."""

    url: str
    state: EngineState = "serving"
    version: str | None = None  # what its /weight_info said last
    reason: str = ""  # why it is not serving
    in_flight: int = 0
    failed_probes: int = 0
    sessions: int = 0  # sessions ever bound to it
    samples: int = 0  # samples it answered
    ranks: int | None = None  # its data-parallel copies (vLLM's /get_world_size), once it said

    def health(self, open_sessions: int) -> EngineHealth:
        return EngineHealth(url=self.url, state=self.state, version=self.version, reason=self.reason or None,
                            open_sessions=open_sessions, sessions=self.sessions, samples=self.samples,
                            data_parallel=self.ranks or 1)


@dataclass(frozen=True)
class Place:
    """Where a session stays: an engine, and which of its data-parallel copies (None: the engine chooses)."""

    upstream: Upstream
    rank: int | None = None


@dataclass
class Route:
    """The engine of one agent call: where its requests go now, and which engine sampled its tokens."""

    session: Session | None
    upstream: Upstream | None = None
    sampled: Upstream | None = None


_ROUTE: contextvars.ContextVar[Route | None] = contextvars.ContextVar("harness_rl_engine_route", default=None)


def bind_session(session: Session) -> None:
    """Route every engine request of the current call (and the tasks it starts) to `session`'s engine."""
    _ROUTE.set(Route(session))


def sampled_by() -> str | None:
    """The URL of the engine that sampled the current call's tokens, if one did."""
    route = _ROUTE.get()
    return route.sampled.url if route is not None and route.sampled is not None else None


class WeightInfo(msgspec.Struct):
    weight_version: str | None = None


class WorldSize(msgspec.Struct):
    world_size: int


_WEIGHT_INFO = msgspec.json.Decoder(WeightInfo)
_WORLD_SIZE = msgspec.json.Decoder(WorldSize)


class EnginePool(EngineClient):
    """An `EngineClient` over several engines: each request goes to its session's engine (see the module).

    Everything an `EngineClient` checks and retries is inherited; only where a request goes is chosen
    here, request by request, with `url` naming the engine of the current call.
    """

    def __init__(self, urls: list[str], *, check_s: float, **client: Any) -> None:
        if not urls:
            raise ValueError("an engine pool needs at least one engine URL")
        self.upstreams = [Upstream(u.rstrip("/")) for u in urls]
        self.check_s = check_s
        self.fleet_version: str | None = None  # the announced version some engine reported
        self.waiting: str | None = None  # why no call is sent yet (see the module)
        self._bound: dict[str, tuple[Session, Place]] = {}
        self._tasks: list[asyncio.Task[None]] = []  # the health watch, learning the data-parallel copies
        super().__init__(self.upstreams[0].url, **client)

    @property
    def url(self) -> str:
        """The engine the current call's requests go to (the first engine outside a call)."""
        route = _ROUTE.get()
        return (route.upstream if route is not None and route.upstream is not None else self.upstreams[0]).url

    @url.setter
    def url(self, value: str) -> None:
        """Each engine keeps its own URL (`EngineClient.__init__` sets one)."""

    async def start(self) -> None:
        await super().start()
        self._tasks.append(asyncio.create_task(self._learn_ranks()))
        self._tasks.append(asyncio.create_task(self._watch()))

    async def open(self) -> None:
        """Send calls from now on (the wait is over), each engine's state fresh from a probe."""
        await self._probe_all()
        self.waiting = None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().close()

    def unavailable(self) -> str | None:
        """Why no call can be served now (None: an engine serves); what `/health` and a refused call say."""
        if self.waiting is not None:
            return self.waiting
        if any(u.state == "serving" for u in self.upstreams):
            return None
        why = "; ".join(f"{u.url} {u.state}: {u.reason}" for u in self.upstreams)
        return f"no engine is serving ({why})"

    def health(self) -> list[EngineHealth]:
        open_sessions = self._open_sessions()
        return [u.health(sum(n for (url, _), n in open_sessions.items() if url == u.url)) for u in self.upstreams]

    async def _send(self, method: str, path: str, payload: bytes | None, deadline: float | None = None,
                    stream: bool = False, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
        """One request, to the current call's engine; an engine found dead on the way is taken out and the
        request goes to the session's next engine at once."""
        route = _ROUTE.get()
        if route is None:  # a call of no session (token counts, the model's card): any serving engine
            route = Route(None)
            token = _ROUTE.set(route)
        else:
            token = None
        try:
            while True:
                if self.waiting is None and all(u.state != "serving" for u in self.upstreams):
                    await self._probe_all()  # none serves: ask them all once more before refusing the call
                place = self._place_for(route)
                upstream = route.upstream = place.upstream
                sent = dict(headers or {})
                if place.rank is not None and path == SAMPLE_PATH:  # the data-parallel copy the session stays on
                    sent[DATA_PARALLEL_RANK_HEADER] = str(place.rank)
                upstream.in_flight += 1
                try:
                    reply = await super()._send(method, path, payload, deadline, stream, sent)
                except EngineUnreachable as exc:
                    if len(self.upstreams) == 1 or await self._answers(upstream):
                        raise
                    self._take_out(upstream, "down", exc.message)
                    continue
                finally:
                    upstream.in_flight -= 1
                if path == SAMPLE_PATH and reply[0] == 200:
                    route.sampled = upstream
                    upstream.samples += 1
                return reply
        finally:
            if token is not None:
                _ROUTE.reset(token)

    def _place_for(self, route: Route) -> Place:
        """The session's place while its engine serves; else (a new session, or its engine out) the least loaded
        place (engine and data-parallel copy) of a serving engine. With one engine and no data parallelism, it.
        None serving (or the proxy still waiting for its engine): 503, with the reason."""
        unavailable = self.unavailable()
        if unavailable is not None:
            raise ProxyError(503, unavailable, headers={"Retry-After": NO_ENGINE_RETRY_AFTER_S})
        session = route.session
        if len(self.upstreams) == 1 and (self.upstreams[0].ranks or 1) == 1:
            return Place(self.upstreams[0])
        bound = self._bound.get(session.id) if session is not None else None
        if bound is not None and bound[1].upstream.state == "serving":
            return bound[1]
        serving = [u for u in self.upstreams if u.state == "serving"]
        if session is None:
            return Place(min(serving, key=lambda u: u.in_flight))
        open_sessions = self._open_sessions()
        places = [Place(u, rank if (u.ranks or 1) > 1 else None) for u in serving for rank in range(u.ranks or 1)]
        chosen = min(places, key=lambda p: (open_sessions.get((p.upstream.url, p.rank), 0), p.upstream.in_flight))
        if bound is not None:
            log.info("session %s moves from %s (%s) to %s", session.id, bound[1].upstream.url,
                     bound[1].upstream.state, chosen.upstream.url)
        self._bound[session.id] = (session, chosen)
        chosen.upstream.sessions += 1
        return chosen

    def _open_sessions(self) -> dict[tuple[str, int | None], int]:
        """Open sessions per place (closed or deleted ones are forgotten here)."""
        counts: dict[tuple[str, int | None], int] = {}
        for session_id, (session, place) in list(self._bound.items()):
            if session.closed or session.deleted:
                del self._bound[session_id]
            else:
                key = (place.upstream.url, place.rank)
                counts[key] = counts.get(key, 0) + 1
        return counts

    async def _learn_ranks(self) -> None:
        """Each engine's data-parallel copies, asked until it answers (sessions placed before that let the engine
        choose): vLLM's world size with and without them (dev mode); an engine that cannot say has one."""
        while True:
            for upstream in self.upstreams:
                if upstream.ranks is None:
                    with_dp, without = [await self._world_size(upstream, dp) for dp in ("true", "false")]
                    if with_dp is not None and without is not None:
                        upstream.ranks = max(1, with_dp // without) if without else 1
            if all(u.ranks is not None for u in self.upstreams):
                return
            await asyncio.sleep(self.check_s)

    async def _world_size(self, upstream: Upstream, include_dp: str) -> int | None:
        """vLLM's `/get_world_size` (0 when the engine has no such route; None when it did not answer)."""
        assert self._http is not None
        try:
            async with self._http.get(f"{upstream.url}/get_world_size", params={"include_dp": include_dp},
                                      timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as response:
                body, status = await response.read(), response.status
        except (aiohttp.ClientError, TimeoutError):
            return None
        try:
            return _WORLD_SIZE.decode(body).world_size if status == 200 else 0
        except msgspec.DecodeError:
            return 0

    def _take_out(self, upstream: Upstream, state: EngineState, reason: str) -> None:
        if upstream.state == "serving":
            log.warning("engine %s taken out (%s): %s", upstream.url, state, reason)
        upstream.state, upstream.reason = state, reason

    def _judge(self, upstream: Upstream) -> None:
        """A live engine serves if it holds the fleet's weights (or none were announced yet), else waits."""
        if self.fleet_version is None or upstream.version == self.fleet_version:
            if upstream.state != "serving":
                log.warning("engine %s serves again (version %s)", upstream.url, upstream.version)
            upstream.state, upstream.reason = "serving", ""
        else:
            self._take_out(upstream, "stale", f"holds version {upstream.version or 'unknown'}, the run is at "
                                              f"{self.fleet_version}; it serves once a weight sync reaches it")

    async def announce(self, version: int) -> None:
        """The learner's new version: engines that report it serve, the others wait for a sync to reach them."""
        if len(self.upstreams) == 1:
            return
        candidates = [u for u in self.upstreams if u.state != "down"]
        answered = await asyncio.gather(*(self._read_version(u) for u in candidates))
        alive = [u for u, ok in zip(candidates, answered, strict=True) if ok]
        if any(u.version == str(version) for u in alive):
            self.fleet_version = str(version)
        for upstream in alive:
            self._judge(upstream)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            if self.waiting is None:  # while waiting, whoever waits asks the engines (`open` probes them)
                await self._probe_all()

    async def _probe_all(self) -> None:
        """Probe every engine once, afresh (a probe begun earlier may predate an engine's return)."""
        await asyncio.gather(*(self._probe(u) for u in self.upstreams))

    async def _probe(self, upstream: Upstream) -> None:
        """Take a serving engine out after failed probes in a row; let a live one back in once it holds the
        fleet's weights."""
        if not await self._answers(upstream):
            upstream.failed_probes += 1
            if upstream.state != "down" and upstream.failed_probes >= PROBE_FAILURES:
                self._take_out(upstream, "down", f"{PROBE_FAILURES} health probes in a row failed")
            return
        upstream.failed_probes = 0
        if upstream.state != "serving" and await self._read_version(upstream):
            self._judge(upstream)

    async def _answers(self, upstream: Upstream) -> bool:
        """Whether the engine's `/health` answers 200 now, on a fresh connection."""
        assert self._http is not None
        try:
            async with self._http.get(upstream.url + "/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
                                      headers={"Connection": "close"}) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _read_version(self, upstream: Upstream) -> bool:
        """Read the engine's weight version (None when it cannot say); False, and the engine is down, when it
        does not answer."""
        assert self._http is not None
        try:
            async with self._http.get(upstream.url + "/weight_info",
                                      timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as response:
                body = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._take_out(upstream, "down", f"GET /weight_info failed: {exc!r}")
            return False
        try:
            upstream.version = _WEIGHT_INFO.decode(body).weight_version if status == 200 else None
        except msgspec.DecodeError:
            upstream.version = None
        return True
