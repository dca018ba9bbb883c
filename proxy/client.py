"""`ProxyClient`: the one typed client of the proxy's control API, used by rollouts and weight sync."""

from __future__ import annotations

from typing import Any, TypeVar

import aiohttp
import msgspec

from harness_rl.trace import TrainingTrace
from proxy.control_api import (
    ErrorReply,
    Health,
    Paused,
    PolicyVersion,
    SessionCreate,
    SessionInfo,
    SessionList,
    SessionSummary,
)

T = TypeVar("T")


class ProxyClientError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"proxy answered HTTP {status}: {message}")
        self.status = status


class ProxyClient:
    """Control-API calls over one keep-alive connection pool; use as `async with ProxyClient(...)`."""

    def __init__(self, url: str, admin_token: str, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ProxyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def create_session(self, metadata: dict[str, Any] | None = None, max_turns: int | None = None,
                             max_tokens_per_turn: int | None = None, seed: int | None = None) -> SessionInfo:
        body = SessionCreate(metadata=metadata or {}, max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn,
                             seed=seed)
        return await self._call("POST", "/sessions", SessionInfo, body)

    async def get_trace(self, session_id: str) -> TrainingTrace:
        """The session's validated trace (fetched in the compact delta form)."""
        data = await self._call("GET", f"/sessions/{session_id}/trace?format=delta", bytes)
        return TrainingTrace.from_json(data)

    async def close_session(self, session_id: str) -> SessionSummary:
        return await self._call("POST", f"/sessions/{session_id}/close", SessionSummary)

    async def delete_session(self, session_id: str) -> None:
        await self._call("DELETE", f"/sessions/{session_id}", bytes)

    async def list_sessions(self) -> list[SessionSummary]:
        return (await self._call("GET", "/sessions", SessionList)).sessions

    async def set_policy_version(self, version: int) -> None:
        await self._call("POST", "/admin/policy_version", PolicyVersion, PolicyVersion(version))

    async def pause(self, drain: bool = True) -> Paused:
        """Hold new agent calls; returns once calls already at the engine are recorded (or at once, undrained)."""
        return await self._call("POST", "/admin/pause" + ("" if drain else "?drain=false"), Paused)

    async def resume(self) -> None:
        await self._call("POST", "/admin/resume", Paused)

    async def health(self) -> Health:
        """The proxy's report, also while it answers 503 (no call can be served now: `reason` says why)."""
        return await self._call("GET", "/health", Health, also=503)

    async def _call(self, method: str, path: str, reply: type[T], body: msgspec.Struct | None = None,
                    also: int | None = None) -> T:
        """One control call; its reply decoded (an error status raises, except `also`, whose reply is `reply` too)."""
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=self._timeout)
        data = msgspec.json.encode(body) if body is not None else None
        async with self._http.request(method, self.url + path, data=data, headers=self._headers) as resp:
            payload = await resp.read()
            if resp.status >= 400 and resp.status != also:
                raise ProxyClientError(resp.status, _message(payload))
            if reply is bytes:
                return payload  # type: ignore[return-value]
            try:
                return msgspec.json.decode(payload, type=reply)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ProxyClientError(resp.status, f"unreadable {reply.__name__} reply: {exc}") from None


def _message(payload: bytes) -> str:
    try:
        return msgspec.json.decode(payload, type=ErrorReply).error.message
    except (msgspec.DecodeError, msgspec.ValidationError):
        return payload[:300].decode("utf-8", "replace")
