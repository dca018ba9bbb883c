"""Streaming from the engine: when a streaming agent gets its first text, and what streaming costs.

One proxy in front of the embedded engine (the tiny model, in this process), one agent asking for a
256-token answer (a forced completion, so every answer is the same tokens), interleaved: streamed
(`stream: true`, text as the engine samples it) and whole (`stream: false`). Printed per mode, medians
over the repeats, with the machine's load average:
- first text: when the first content bytes reach the agent, as a share of the whole answer's time;
- whole answer: time from the request to the last byte.

    python benchmarks/stream_bench.py [--repeats 9] [--tokens 256] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from conventions import load_average, parse_args

from harness_rl.engine import Engine, build_tiny_model, serve_in_thread
from harness_rl.run.stack import serve_proxy
from proxy.config import ProxyConfig


def ask(session: dict[str, Any], tokens: int, stream: bool) -> tuple[float, float]:
    """(seconds to the first content bytes, seconds to the last byte) of one answer."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count."}], "max_tokens": tokens,
            "stream": stream}
    sent = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{session['openai_base_url']}/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {session['key']}"}) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter()
            elif first is None and line.startswith("{"):
                first = time.perf_counter()  # the whole answer's single body
    ended = time.perf_counter()
    return (first or ended) - sent, ended - sent


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=256)
    args = parse_args(parser, {"repeats": 3, "tokens": 32}, argv)
    text = " ".join(f"word{i}" for i in range(args.tokens * 2))
    with tempfile.TemporaryDirectory() as work:
        engine = Engine.from_pretrained(build_tiny_model(Path(work) / "tiny", seed=0), served_model_name="tiny")
        with serve_in_thread(engine, forced_completions=True) as server, \
                serve_proxy(ProxyConfig(upstream=server.url, store_dir=str(Path(work) / "store"))) as proxy:
            session = httpx.post(f"{proxy.url}/sessions", headers={"Authorization": f"Bearer {proxy.admin_token}"},
                                 json={}).json()
            results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            print(load_average())
            for _ in range(args.repeats + 1):  # the first round warms up and is not counted
                for stream in (True, False):
                    httpx.post(f"{server.url}/forced_completions", json={"tools": [], "no_tools": [text]})
                    results[stream].append(ask(session, args.tokens, stream))
            for stream in (True, False):
                results[stream] = results[stream][1:]
        engine.close()
    print(load_average())
    out = {}
    print(f"{args.tokens}-token answers, medians of {args.repeats}: streamed / whole")
    for stream in (True, False):
        first = statistics.median(f / t for f, t in results[stream])
        total = statistics.median(t for _, t in results[stream])
        out[f"first_text_share_{'streamed' if stream else 'whole'}"] = first
        out[f"total_s_{'streamed' if stream else 'whole'}"] = total
    print(f"first text at          {out['first_text_share_streamed']:6.1%} / {out['first_text_share_whole']:6.1%} "
          "of the answer's time")
    print(f"whole answer           {out['total_s_streamed'] * 1000:6.0f} / {out['total_s_whole'] * 1000:6.0f} ms "
          f"({out['total_s_streamed'] / out['total_s_whole']:.2f}x)")
    return out


if __name__ == "__main__":
    main()
