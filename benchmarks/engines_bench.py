"""Several engines behind one proxy: what the engine pool costs per call, and what a crashed engine costs.

Two fast fake engines (tests/fake_engine.py, each its own process) and our proxy (in this process, on its
own loop thread), measured side by side in one run:

  routing    median latency of a call through a proxy with one engine and through one with two (sessions
             spread over both), interleaved round by round, and their ratio
  failover   a session's next call right after its engine was killed with SIGKILL (answered by the other
             engine: one refused connection and one refused health probe on the way), against the median
             call of the same round

Medians over the rounds, with the machine's load average beside them. Run:
`.venv/bin/python benchmarks/engines_bench.py [--rounds 15 --calls 40] [--quick]`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from conventions import load_average, parse_args

from harness_rl.background import BackgroundLoop
from harness_rl.run.stack import serve_proxy
from proxy.config import ProxyConfig
from proxy.server.app import RunningProxy

ROOT = Path(__file__).resolve().parent.parent
FAKE_ENGINE = ROOT / "tests" / "fake_engine.py"


def start_fake() -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen([sys.executable, str(FAKE_ENGINE)], stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, process.stdout.readline().decode().strip()


class Session:
    """One agent conversation through the proxy, each reply sent back (token in, token out)."""

    def __init__(self, http: httpx.Client, proxy: RunningProxy) -> None:
        created = http.post(f"{proxy.url}/sessions", headers={"Authorization": f"Bearer {proxy.admin_token}"},
                            json={}).json()
        self.http, self.url = http, created["openai_base_url"] + "/chat/completions"
        self.auth = {"Authorization": f"Bearer {created['key']}"}
        self.messages: list[dict] = [{"role": "user", "content": "list the files " * 40}]

    def call(self) -> float:
        began = time.perf_counter()
        got = self.http.post(self.url, headers=self.auth, json={"model": "policy", "messages": self.messages})
        took = time.perf_counter() - began
        assert got.status_code == 200, got.text
        self.messages += [got.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
        return took


def calls(http: httpx.Client, proxy: RunningProxy, count: int, sessions: int = 4) -> list[float]:
    opened = [Session(http, proxy) for _ in range(sessions)]
    return [opened[i % sessions].call() for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=40)
    args = parse_args(parser, {"rounds": 3, "calls": 8})
    fakes = [start_fake() for _ in range(2)]
    one_ms, two_ms, failover_ms, round_ms = [], [], [], []
    try:
        with tempfile.TemporaryDirectory() as store, BackgroundLoop("bench-proxies") as loop, \
                httpx.Client(timeout=30) as http:
            urls = [url for _, url in fakes]
            one = ProxyConfig(upstream=urls[:1], store_dir=f"{store}/one", engine_check_s=1.0)
            two = ProxyConfig(upstream=urls, store_dir=f"{store}/two", engine_check_s=1.0)
            with serve_proxy(one, loop) as single, serve_proxy(two, loop) as pooled:
                for _ in range(args.rounds):
                    one_ms.append(1e3 * statistics.median(calls(http, single, args.calls)))
                    two_ms.append(1e3 * statistics.median(calls(http, pooled, args.calls)))
            for _ in range(args.rounds):
                victim, victim_url = start_fake()
                config = ProxyConfig(upstream=[victim_url, urls[0]], store_dir=tempfile.mkdtemp(dir=store),
                                     engine_check_s=60.0)
                with serve_proxy(config, loop) as proxy:
                    session = Session(http, proxy)  # bound to the first engine: the victim
                    typical = [session.call() for _ in range(5)]
                    victim.kill()
                    victim.wait()
                    failover_ms.append(1e3 * session.call())
                    round_ms.append(1e3 * statistics.median(typical))
    finally:
        for process, _ in fakes:
            process.kill()
            process.wait()
    routing = statistics.median(t / o for t, o in zip(two_ms, one_ms, strict=True))
    failover = statistics.median(f / r for f, r in zip(failover_ms, round_ms, strict=True))
    print(f"{load_average()}; {args.rounds} rounds of {args.calls} calls, medians")
    print(f"routing   one engine {statistics.median(one_ms):.2f} ms, two engines {statistics.median(two_ms):.2f} ms"
          f" per call: x{routing:.2f}")
    print(f"failover  first call after its engine was killed {statistics.median(failover_ms):.2f} ms, a call before "
          f"{statistics.median(round_ms):.2f} ms: x{failover:.2f}")


if __name__ == "__main__":
    main()
