"""The one way tests POST a JSON body to a server (an engine, the proxy, one of its dialects)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx


def post(base: str, path: str, body: Any, headers: Mapping[str, str] | None = None, timeout: float = 120,
         **kw: Any) -> httpx.Response:
    """`body` as JSON to `base + path`; the timeout leaves the tiny model room on a busy machine."""
    return httpx.post(f"{base}{path}", json=body, headers=dict(headers or {}), timeout=timeout, **kw)
