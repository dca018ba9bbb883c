"""Everything one proxy process needs, as one Struct (the `proxy` section of a run's configuration).

Each field's description is its flag's help (`harness-rl serve proxy`, `harness-rl train`); fields
marked `flag=None` are set by whoever starts the proxy, never by hand.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from proxy.sampling import SamplingPolicy


def default_store_dir() -> str:
    """Session logs live in the user's state directory, never in whatever folder the proxy was started from."""
    import os
    from pathlib import Path

    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(state) / "harness-rl" / "proxy-store")


def _meta(description: str, flag: str | None = "", *, internal: bool = False) -> msgspec.Meta:
    """A field's help text and constraints; `flag=None` hides it from the command line, a string renames it.

    `internal` fields are set by whoever starts the proxy (a training run sets its own upstream and store).
    """
    return msgspec.Meta(description=description, extra={"flag": flag, "internal": internal})


AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
AtLeastZero = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[float, msgspec.Meta(gt=0)]


class ProxyConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    upstream: Annotated[str, _meta("engine base URL (vLLM or `harness-rl serve engine`)", flag="--upstream",
                                   internal=True)] = ""
    host: Annotated[str, _meta("interface the proxy binds", flag="--proxy-host")] = "127.0.0.1"
    port: Annotated[Port, _meta("port the proxy binds; 0 for any free one", flag="--proxy-port")] = 0
    advertise_url: Annotated[str | None, _meta("proxy base URL handed to agents (needed for cloud sandboxes); "
                                               "default http://HOST:PORT")] = None
    store_dir: Annotated[str, _meta("directory of session logs", flag="--store", internal=True)] = msgspec.field(
        default_factory=default_store_dir)
    admin_token: Annotated[str | None, _meta("control-API token; none: a fresh random one", flag=None,
                                             internal=True)] = None
    upstream_model: Annotated[str | None, _meta("model name to ask the engine for; none: its first served model",
                                                internal=True)] = None
    sampling: SamplingPolicy = msgspec.field(default_factory=SamplingPolicy)
    max_body_mb: Annotated[Positive, _meta("largest agent request body, MB")] = 64.0
    max_reply_mb: Annotated[Positive, _meta("largest engine reply read, MB; a bigger one fails the call (502)")] = 64.0
    request_timeout_s: Annotated[Positive, _meta("deadline of one agent call at the engine, retries and their waits "
                                                 "included, seconds")] = 600.0
    retries: Annotated[AtLeastZero, _meta("engine retries on 429/5xx and lost connections, within the deadline")] = 3
    header_timeout_s: Annotated[Positive, _meta("a client must send a request's line and headers within this many "
                                                "seconds of connecting or of its previous answer, else its "
                                                "connection is closed")] = 30.0
    body_timeout_s: Annotated[Positive, _meta("a request body must arrive within this many seconds (else 408, "
                                              "connection closed)")] = 60.0
    max_connections: Annotated[AtLeastOne, _meta("open client connections in all; requests on any beyond are "
                                                 "answered 503")] = 4096
    max_connections_per_client: Annotated[AtLeastOne, _meta("open connections from one client address; requests "
                                                            "on any beyond are answered 503")] = 1024
    vocab_size: Annotated[AtLeastOne | None, _meta("the engine's vocabulary size: sampled or prompt ids at or above "
                                                   "it are refused (502); none: what the engine's /v1/models says, "
                                                   "if it does")] = None
    max_chain: Annotated[AtLeastOne | None, _meta("store a turn whole after this many delta-encoded turns in a row, "
                                                  "so one damaged log line costs at most this many later turns; "
                                                  "none: no bound")] = 32
    keepalive_s: Annotated[Positive, _meta("a streaming agent waiting this long gets SSE keep-alive comments",
                                           flag=None)] = 10.0
    stream_read_s: Annotated[Positive, _meta("a streaming agent's text is read from the engine's parsers at most "
                                             "this often (each read replays the answer so far), seconds")] = 0.05
    collect_on_pause: Annotated[bool, _meta("run the full garbage collection while agents are held for a weight "
                                            "sync", flag=None)] = True
    fsync: Annotated[bool, _meta("fsync every captured turn (survives power loss, slower)")] = False
    tito: Annotated[bool, _meta("token in, token out: send an agent's earlier replies back to the engine as the "
                                "ids it sampled (off: render every prompt from the messages)")] = True
    splice_check_tokens: Annotated[AtLeastZero | None, _meta(
        "a spliced turn renders only the messages after the agent's last reply; on about this many tokens of "
        "conversation per turn, the whole conversation is rendered too and must agree (every turn of a "
        "conversation this long, one in N of one N times longer; a disagreement renders that session whole from "
        "then on); 0: never; none: every turn")] = 4096
    local_render: Annotated[str | None, _meta(
        "render prompts in the proxy with the served model's tokenizer.json and chat template from this directory "
        "(one engine round trip fewer per call; checked against the engine's rendering as splices are, and "
        "turned off at the first disagreement); 'auto': the engine's own model directory when this machine can "
        "read it; none: the engine renders every prompt")] = "auto"
    accept_images: Annotated[bool, _meta("forward image parts to the engine (only for models that take them)")] \
        = False
    default_max_turns: Annotated[AtLeastOne | None, _meta("step budget of a session that sets none",
                                                          flag="--max-turns", internal=True)] = None
    default_max_tokens_per_turn: Annotated[AtLeastOne | None, _meta("max_tokens cap of a session that sets none",
                                                                    flag="--max-tokens-per-turn", internal=True)] \
        = None
