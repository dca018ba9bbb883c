"""Everything one proxy process needs, as one Struct (the `proxy` section of a run's configuration).

Each field's description is its flag's help (`harness-rl serve proxy`, `harness-rl train`); fields
marked `flag=None` are set by whoever starts the proxy, never by hand.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from harness_rl.settings import AtLeastOne, AtLeastZero, Port, Positive, setting
from proxy.sampling import SamplingPolicy


def default_store_dir() -> str:
    """Session logs live in the user's state directory, never in whatever folder the proxy was started from."""
    import os
    from pathlib import Path

    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(state) / "harness-rl" / "proxy-store")


class ProxyConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    upstream: Annotated[list[str], setting("engine base URL (vLLM or `harness-rl serve engine`); repeat for several "
                                         "engines: a session stays on one, a new one goes to the least loaded",
                                         flag="--upstream", internal=True)] = []
    host: Annotated[str, setting("interface the proxy binds", flag="--proxy-host")] = "127.0.0.1"
    port: Annotated[Port, setting("port the proxy binds; 0 for any free one", flag="--proxy-port")] = 0
    advertise_url: Annotated[str | None, setting("proxy base URL handed to agents (needed for cloud sandboxes); "
                                               "default http://HOST:PORT")] = None
    store_dir: Annotated[str, setting("directory of session logs", flag="--store", internal=True)] = msgspec.field(
        default_factory=default_store_dir)
    admin_token: Annotated[str | None, setting("control-API token; none: a fresh random one", flag=None,
                                             internal=True)] = None
    upstream_model: Annotated[str | None, setting("model name to ask the engine for; none: its first served model",
                                                internal=True)] = None
    sampling: SamplingPolicy = msgspec.field(default_factory=SamplingPolicy)
    max_body_mb: Annotated[Positive, setting("largest agent request body, MB")] = 64.0
    max_reply_mb: Annotated[Positive, setting("largest engine reply read, MB; a bigger one fails the call (502)")] \
        = 64.0
    request_timeout_s: Annotated[Positive, setting("deadline of one agent call at the engine, retries and their waits "
                                                 "included, seconds")] = 600.0
    retries: Annotated[AtLeastZero, setting("engine retries on 429/5xx and lost connections, within the deadline")] = 3
    header_timeout_s: Annotated[Positive, setting("a client must send a request's line and headers within this many "
                                                "seconds of connecting or of its previous answer, else its "
                                                "connection is closed")] = 30.0
    body_timeout_s: Annotated[Positive, setting("a request body must arrive within this many seconds (else 408, "
                                              "connection closed)")] = 60.0
    max_connections: Annotated[AtLeastOne, setting("open client connections in all; one beyond closes the oldest "
                                                 "idle one no key owns, else it is closed at accept")] = 4096
    max_connections_per_client: Annotated[AtLeastOne, setting(
        "open connections per client: per session key, per admin token, and per address for connections whose "
        "requests have shown no key yet; one more from an address closes its oldest idle one, else it is closed "
        "at accept; a request beyond a key's budget is answered 503")] = 1024
    vocab_size: Annotated[AtLeastOne | None, setting("the engine's vocabulary size: sampled or prompt ids at or above "
                                                   "it are refused (502); none: what the engine's /v1/models says, "
                                                   "if it does")] = None
    whole_turn_every: Annotated[AtLeastOne | None, setting(
        "log a turn whole, not as a delta, once this many turns rest on one whole turn (in a linear session, every "
        "Nth turn), so a damaged or missing log line costs at most this many turns; none: deltas only (smallest "
        "logs, no bound)")] = 8
    keepalive_s: Annotated[Positive, setting("a streaming agent waiting this long gets SSE keep-alive comments",
                                           flag=None)] = 10.0
    stream_read_s: Annotated[Positive, setting("a streaming agent's text is read from the engine's parsers at most "
                                             "this often (each read replays the answer so far), seconds")] = 0.05
    collect_on_pause: Annotated[bool, setting("run the full garbage collection while agents are held for a weight "
                                            "sync", flag=None)] = True
    fsync: Annotated[bool, setting("fsync every captured turn (survives power loss, slower)")] = False
    tito: Annotated[bool, setting("token in, token out: send an agent's earlier replies back to the engine as the "
                                "ids it sampled (off: render every prompt from the messages)")] = True
    splice_check_tokens: Annotated[AtLeastZero | None, setting(
        "a spliced turn renders only the messages after the agent's last reply; the whole conversation is rendered "
        "too and must agree on a session's first 4 spliced turns, then on one in 32, or one in N of a "
        "conversation N times this many tokens long (a disagreement renders that session whole from then on); "
        "0: never; none: every turn")] = 4096
    local_render: Annotated[str | None, setting(
        "render prompts in the proxy with the served model's tokenizer.json and chat template from this directory "
        "(one engine round trip fewer per call; checked against the engine's rendering as splices are, and "
        "turned off at the first disagreement); 'auto': the engine's own model directory when this machine can "
        "read it, or for a hub id (`vllm serve Qwen/Qwen3-8B`) its snapshot in this machine's Hugging Face cache; "
        "none: the engine renders every prompt")] = "auto"
    accept_images: Annotated[bool, setting("forward image parts to the engine (only for models that take them)")] \
        = False
    engine_check_s: Annotated[Positive, setting("how often each engine is probed (/health, and /weight_info while "
                                              "it is out); two failed probes in a row take it out, seconds")] = 5.0
    max_turns: Annotated[AtLeastOne | None, setting("model calls per session before the proxy stops the agent, for "
                                                   "sessions that set none", internal=True)] = None
    max_tokens_per_turn: Annotated[AtLeastOne | None, setting(
        "cap on each model call's max_tokens, for sessions that set none; none: up to the engine's context",
        internal=True)] = None

    def __post_init__(self) -> None:
        if isinstance(self.upstream, str):  # one engine, written as its URL alone
            self.upstream = [self.upstream] if self.upstream else []
        urls = [u.rstrip("/") for u in self.upstream]
        for url in urls:
            scheme, _, host = url.partition("://")
            if scheme not in ("http", "https") or not host:
                raise ValueError(f"engine {url!r} is not an http(s) URL: give the engine's base URL, "
                                 "e.g. http://127.0.0.1:8000")
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"engine {twice[0]} is given twice")
