"""A run's first contact with an engine URL: whether anything there is an inference engine, and whether it is ours.

Light (stdlib and msgspec): preflight asks it before anything starts, and `doctor` words its own first check
the same way (`no_engine`).
"""

from __future__ import annotations

import urllib.error
import urllib.request

import msgspec

from harness_rl.wire import MODELS_ROUTE, POLICY_VERSION_HEADER


class NotAnEngine(RuntimeError):
    """Nothing at the URL answers as an inference engine; the message says what answered, on which route."""


class _Card(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[_Card]


def no_engine(url: str, status: int, detail: str) -> str:
    """Why `url` is not an inference engine, from its answer to GET /v1/models (`status` 0: no answer, `detail`
    why; 200: an answer that is no model list)."""
    asked = f"GET {MODELS_ROUTE}"
    if status == 0:
        return f"{url} is not reachable ({asked}: {detail}): start the engine there, or correct the URL"
    if status >= 500:
        return f"{url} answered HTTP {status} on {asked}: the engine there is not serving ({detail})"
    what = f"{asked} without a model list" if status == 200 else f"HTTP {status} on {asked}"
    return f"{url} answered {what}: not an inference engine (is it the proxy, or a wrong port?)"


def reach_engine(url: str, timeout_s: float = 10.0) -> bool:
    """First contact with the engine at `url`: whether it is `harness-rl serve engine` (whose every reply carries
    the policy version; vLLM's do not). Raises `NotAnEngine` when nothing answers, or something that is no engine."""
    url = url.rstrip("/")
    try:
        with urllib.request.urlopen(url + MODELS_ROUTE, timeout=timeout_s) as response:
            ours = response.headers.get(POLICY_VERSION_HEADER) is not None
            body = response.read()
    except urllib.error.HTTPError as error:
        raise NotAnEngine(no_engine(url, error.code, str(error.reason))) from None
    except urllib.error.URLError as error:
        raise NotAnEngine(no_engine(url, 0, str(error.reason))) from None
    except OSError as error:  # a reset or a timeout while reading
        raise NotAnEngine(no_engine(url, 0, str(error) or type(error).__name__)) from None
    try:
        if msgspec.json.decode(body, type=_ModelList).data:
            return ours
    except msgspec.DecodeError:
        pass
    raise NotAnEngine(no_engine(url, 200, ""))
