"""Proxy overhead, side by side in one run: the engine directly, OpenEnv's capture proxy, and ours.

All three talk to the same fast fake engine (tests/fake_engine.py, its own process) with agent-sized
requests: ~20 messages, ~16 KB, 10 tool schemas, ~6.7k prompt tokens. The fake renders with the tiny
model's real tokenizer and chat template (about a millisecond a conversation) and names that model
directory, as a vLLM on the same machine does, so our proxy renders prompts itself. Each proxy runs in
its own process under the same small wrapper that times every garbage collection. Figures printed:

  one agent      p50/p99 latency over the first 50 sequential turns of a session, and what is added:
                 each target alone, and all three interleaved turn by turn, their order turned each turn
                 (outside load falls on each alike; each proxy's background work slows the others, and no
                 target always runs after the same one); and the engine calls our
                 proxy made per agent call (render, generate, derender; the chat route for the others)
  streamed       the same with `stream: true`, to the answer's last byte (OpenEnv asks the engine for a
                 whole answer and replays it as events; ours streams from the engine)
  session length one session of 400 turns per target, alone: mean latency of turns 1-50 vs 351-400,
                 the slope per 100 turns held, and the proxy's CPU per request early and late
  proxy CPU      user+system CPU the proxy process spent per request (unaffected by other load)
  memory         RSS growth per captured turn over those 400 turns
  16 agents      requests/s and p99 latency with 16 agents sending back to back for a few seconds
  64 agents      p50/p99 latency, 64 agents with 500 ms think time between turns, and what is added
  collector      gen-2 collections and the longest collector pause (wall, and the collector's own CPU)
  echo           bytes the agent receives per answer, and whether capture fields leak to it
  splice         an agent that sends its own replies back (a conversation growing to 400 turns), through
                 our proxy with token in/token out on and off, interleaved: what splicing adds per turn,
                 early and late, and the proxy CPU per turn in each mode
  hub id         the engine serving a hub id (`vllm serve org/tiny`: its model root no directory here), the
                 tokenizer and template in this machine's Hugging Face cache: our engine calls per JSON call
                 over the session, and the streamed one-agent p50s, all three targets interleaved

Run: `.venv/bin/python benchmarks/proxy_bench.py [--quick]` (about five minutes on a 2-core machine; other load on
the machine moves the latency figures, the CPU-per-request figures much less; the load average is printed
beside each phase).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp
from conventions import load_average, parse_args
from processes import (
    Target,
    cpu_s,
    rss_kb,
    start_engine,
    start_openenv,
    start_ours,
    stop,
    stopping_all,
    tiny_model,
)


def tool_schemas() -> list[dict]:
    names = ["bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "webfetch", "write"]
    return [{"type": "function", "function": {
        "name": name, "description": f"The {name} tool. " + "Use it carefully and only when needed. " * 3,
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Absolute path of the file to work on."},
            "content": {"type": "string", "description": "Text to write, or the pattern to look for."},
            "timeout": {"type": "integer", "description": "Seconds before giving up."}},
            "required": ["path"]}}} for name in names]


def history() -> list[dict]:
    """An agent's conversation of 19 messages (~15 KB) before its latest user message."""
    out: list[dict] = [{"role": "system", "content": "You are a careful coding agent. " * 60},
                       {"role": "user", "content": "Fix the failing test in the repository. " * 20}]
    for i in range(8):
        call_id = f"call_{i}"
        out.append({"role": "assistant", "content": f"Step {i}: let me inspect the code.",
                    "tool_calls": [{"id": call_id, "type": "function",
                                    "function": {"name": "read", "arguments": json.dumps({"path": f"/src/m{i}.py"})}}]})
        out.append({"role": "tool", "tool_call_id": call_id, "content": f"def f{i}(x):\n    return x + {i}\n" * 30})
    out.append({"role": "assistant", "content": "I have read enough to propose a fix. " * 10})
    return out


HISTORY, TOOLS = history(), tool_schemas()


def agent_body(turn: int, stream: bool = False) -> bytes:
    messages = HISTORY + [{"role": "user", "content": f"Continue with step {turn}."}]
    return json.dumps({"model": "policy", "messages": messages, "tools": TOOLS, "stream": stream}).encode()


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60))


async def post(http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes) -> tuple[float, bytes]:
    """(seconds to the answer's last byte, the answer); a streamed answer is read to its end."""
    started = time.perf_counter()
    async with http.post(url, data=body, headers=headers) as resp:
        data = await resp.read()
        if resp.status != 200 or b'"error"' in data[-400:]:
            raise RuntimeError(f"{url} answered {resp.status}: {data[-300:]!r}")
    return time.perf_counter() - started, data


def engine_calls(engine: str) -> dict[str, int]:
    """Requests the fake engine has answered, by route."""
    import urllib.request

    with urllib.request.urlopen(f"{engine}/stats") as resp:
        return json.loads(resp.read())


async def one_agent(targets: list[Target], turns: int, stream: bool = False) -> dict[str, dict]:
    """One session of `turns` sequential turns per target, interleaved turn by turn so that load from
    anything else on the machine falls on all targets alike."""
    async with client() as http:
        for target in targets:  # warm-up in a throwaway session
            url, headers = await target.session(http)
            for i in range(20):
                await post(http, url, headers, agent_body(i, stream))
        sessions = [await target.session(http) for target in targets]
        before = [rss_kb(t.process.pid) if t.process else 0 for t in targets]
        cpu_before = [cpu_s(t.process.pid) if t.process else 0.0 for t in targets]
        latencies: list[list[float]] = [[] for _ in targets]
        sizes: list[list[int]] = [[] for _ in targets]
        last: list[bytes] = [b""] * len(targets)
        cpu_marks: dict[int, list[float]] = {}
        for turn in range(turns):
            if turn in (min(100, turns // 2), max(turns - 100, turns // 2)):
                cpu_marks[turn] = [cpu_s(t.process.pid) if t.process else 0.0 for t in targets]
            body = agent_body(turn, stream)
            for k in rotated(range(len(targets)), turn):  # each target follows each other one as often
                url, headers = sessions[k]
                latency, last[k] = await post(http, url, headers, body)
                latencies[k].append(latency)
                sizes[k].append(len(last[k]))
        after = [rss_kb(t.process.pid) if t.process else 0 for t in targets]
        cpu_after = [cpu_s(t.process.pid) if t.process else 0.0 for t in targets]
    out = {}
    for k, target in enumerate(targets):
        leaked: list[str] = []
        if not stream:
            answer = json.loads(last[k])
            choice = answer["choices"][0]
            leaked = sorted({"prompt_token_ids", "token_ids"} & (set(answer) | set(choice))
                            | ({"logprobs"} if choice.get("logprobs") is not None else set()))
        lat = latencies[k]
        out[target.name] = {
            "p50": statistics.median(lat[:50]), "p99": quantile(lat[:50], 0.99), "p50_all": statistics.median(lat),
            "first50": statistics.fmean(lat[:50]), "last50": statistics.fmean(lat[-50:]),
            "slope_per_100": statistics.linear_regression(range(turns), lat).slope * 100,
            "kb_per_turn": (after[k] - before[k]) / turns, "cpu": (cpu_after[k] - cpu_before[k]) / turns,
            "cpu_first100": (cpu_marks[min(100, turns // 2)][k] - cpu_before[k]) / min(100, turns // 2),
            "cpu_last100": (cpu_after[k] - cpu_marks[max(turns - 100, turns // 2)][k]) / min(100, turns - turns // 2),
            "bytes": statistics.fmean(sizes[k]), "leaked": leaked}
    return out


def rotated(items: Sequence[int], turn: int) -> list[int]:
    """The order of one turn: turned by one place each turn, so no target always runs in the wake of another's
    background work (a proxy storing its capture after it answered)."""
    shift = turn % len(items)
    return [*items[shift:], *items[:shift]]


async def warm(http: aiohttp.ClientSession, target: Target) -> None:
    """A few calls through a throwaway session, so a freshly started target's one-time work is not measured."""
    url, headers = await target.session(http)
    for i in range(10):
        await post(http, url, headers, agent_body(i))


async def saturate(target: Target, agents: int, seconds: float) -> tuple[float, list[float]]:
    """Requests/s with `agents` sending back to back, and each request's latency."""
    async with client() as http:
        await warm(http, target)
        sessions = [await target.session(http) for _ in range(agents)]
        bodies = [agent_body(i) for i in range(50)]
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def agent(url: str, headers: dict[str, str]) -> None:
            i = 0
            while time.perf_counter() < deadline:
                try:
                    latencies.append((await post(http, url, headers, bodies[i % 50]))[0])
                except (TimeoutError, aiohttp.ClientError, RuntimeError):
                    pass
                i += 1

        started = time.perf_counter()
        await asyncio.gather(*(agent(u, h) for u, h in sessions))
        return len(latencies) / (time.perf_counter() - started), latencies


async def thinking_agents(target: Target, agents: int, think_s: float, seconds: float) -> list[float]:
    async with client() as http:
        await warm(http, target)
        sessions = [await target.session(http) for _ in range(agents)]
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def agent(k: int, url: str, headers: dict[str, str]) -> None:
            await asyncio.sleep(think_s * k / agents)  # spread the arrivals
            turn = 0
            while time.perf_counter() < deadline:
                try:
                    latency, _ = await post(http, url, headers, agent_body(turn))
                except (TimeoutError, aiohttp.ClientError, RuntimeError):
                    latency = 60.0  # counted as a 60 s answer
                latencies.append(latency)
                turn += 1
                await asyncio.sleep(think_s)

        await asyncio.gather(*(agent(k, u, h) for k, (u, h) in enumerate(sessions)))
        return latencies


async def splicing(targets: list[Target], turns: int) -> dict[str, dict[str, float]]:
    """One agent per target sending its own replies back, the conversation growing every turn; targets
    interleaved turn by turn. Per target: mean latency and proxy CPU of turns 1-50 and the last 50."""
    async with client() as http:
        sessions = [await target.session(http) for target in targets]
        conversations: list[list[dict]] = [[{"role": "system", "content": "You are a careful coding agent. " * 60},
                                            {"role": "user", "content": "Fix the failing test."}] for _ in targets]
        latencies: list[list[float]] = [[] for _ in targets]
        cpu: list[list[float]] = [[] for _ in targets]
        for turn in range(turns):
            for k, (url, headers) in enumerate(sessions):
                before = cpu_s(targets[k].process.pid) if targets[k].process else 0.0
                body = json.dumps({"model": "policy", "messages": conversations[k], "tools": TOOLS}).encode()
                latency, data = await post(http, url, headers, body)
                cpu[k].append((cpu_s(targets[k].process.pid) if targets[k].process else 0.0) - before)
                latencies[k].append(latency)
                reply = json.loads(data)["choices"][0]["message"]
                conversations[k] += [{key: reply[key] for key in ("role", "content", "tool_calls") if key in reply},
                                     {"role": "user", "content": f"Result of step {turn}: " + "ok " * 40}]
    return {t.name: {"first50": statistics.median(latencies[k][:50]), "last50": statistics.median(latencies[k][-50:]),
                     "cpu_first50": statistics.fmean(cpu[k][:50]), "cpu_last50": statistics.fmean(cpu[k][-50:]),
                     "slope_per_100": statistics.linear_regression(range(turns), latencies[k]).slope * 100}
            for k, t in enumerate(targets)}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f} ms"


ROUTES = ("/v1/chat/completions", "/v1/chat/completions/render", "/inference/v1/generate",
          "/v1/chat/completions/derender")


def alone(name: str, fresh: Callable[[str], Target], engine: str, turns: int, stream: bool,
          pauses: list[tuple[int, float, float]]) -> dict:
    """One session of `turns` turns (after 20 warm-up turns) through a freshly started target alone, and the
    engine calls it made per agent call."""
    target = fresh(name)
    since, before = time.time(), engine_calls(engine)
    out = asyncio.run(one_agent([target], turns, stream))[name]  # alone: nobody else's growth leaks in
    after = engine_calls(engine)
    pauses += stop(target, since)
    out["calls"] = sum(after.get(r, 0) - before.get(r, 0) for r in ROUTES) / (turns + 20)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=400, help="turns of the one-agent session (at least 200)")
    parser.add_argument("--stream-turns", type=int, default=200, help="turns of the streaming one-agent session")
    parser.add_argument("--interleaved-turns", type=int, default=200,
                        help="turns of the JSON one-agent session, all three targets interleaved")
    parser.add_argument("--saturation-s", type=float, default=5.0)
    parser.add_argument("--think-s", type=float, default=10.0, help="duration of the 64-agent run")
    parser.add_argument("--openenv", action=argparse.BooleanOptionalAction, default=True,
                        help="OpenEnv's capture proxy beside ours (it takes seconds to start, once per phase)")
    args = parse_args(parser, {"turns": 12, "stream_turns": 8, "interleaved_turns": 8, "saturation_s": 0.5,
                               "think_s": 1.0, "openenv": False})
    body = agent_body(0)
    print(f"request: {len(json.loads(body)['messages'])} messages, {len(body) / 1024:.1f} KB, {len(TOOLS)} tools")

    engine_process, engine = start_engine(tiny_model())
    with tempfile.TemporaryDirectory() as tmp, stopping_all():
        work = Path(tmp)
        starters = {"direct to engine": None, "OpenEnv capture proxy": start_openenv, "harness-rl proxy": start_ours}
        if not args.openenv:
            del starters["OpenEnv capture proxy"]

        def fresh(name: str) -> Target:
            """Each phase gets freshly started proxies, so no phase pays for another's backlog."""
            start = starters[name]
            return start(engine, work) if start else Target(name, None, engine, "direct")

        pauses: dict[str, list[tuple[int, float, float]]] = {name: [] for name in starters}
        loads: list[str] = []
        results: dict[str, dict] = {}
        for stream in (False, True):  # interleaved: the one-agent latencies compare fairly
            targets = [fresh(name) for name in starters]
            since = time.time()
            got = asyncio.run(one_agent(targets, args.stream_turns if stream else args.interleaved_turns, stream))
            loads.append(load_average())
            for target in targets:
                pauses[target.name] += stop(target, since)
                mode = "streamed" if stream else "JSON"
                print(f"{target.name}: one agent {mode} p50 {ms(got[target.name]['p50'])} ({loads[-1]})", flush=True)
                results.setdefault(target.name, {}).update(
                    {f"{k}_stream": v for k, v in got[target.name].items()} if stream else got[target.name])
        for name, r in results.items():
            one = alone(name, fresh, engine, args.turns, False, pauses[name])
            for key in ("p50_all", "first50", "last50", "slope_per_100", "kb_per_turn", "cpu", "cpu_first100",
                        "cpu_last100", "calls"):
                r[key] = one[key]
            r["p50_alone"], r["p99_alone"] = one["p50"], one["p99"]
            streamed = alone(name, fresh, engine, args.stream_turns, True, pauses[name])
            r["p50_alone_stream"], r["cpu_stream"], r["calls_stream"] = streamed["p50"], streamed["cpu"], \
                streamed["calls"]
            print(f"{name}: {args.turns}-turn session, {r['kb_per_turn']:.1f} KB/turn ({load_average()})", flush=True)
            target = fresh(name)
            since = time.time()
            lat = asyncio.run(thinking_agents(target, 64, 0.5, args.think_s))
            pauses[name] += stop(target, since)
            r["think_p50"], r["think_p99"] = statistics.median(lat), quantile(lat, 0.99)
            print(f"{name}: 64 agents p50 {ms(r['think_p50'])} p99 {ms(r['think_p99'])} ({load_average()})", flush=True)
            target = fresh(name)
            since = time.time()
            r["rps"], lat = asyncio.run(saturate(target, 16, args.saturation_s))
            r["sat_p50"], r["sat_p99"] = statistics.median(lat), quantile(lat, 0.99)
            pauses[name] += stop(target, since)
            print(f"{name}: 16 agents {r['rps']:.0f} req/s, p99 {ms(r['sat_p99'])} ({load_average()})", flush=True)
            r["gen2"] = sum(1 for g, _, _ in pauses[name] if g == 2)
            r["max_pause"] = max((wall for _, wall, _ in pauses[name]), default=0.0)
            r["max_pause_cpu"] = max((cpu for _, _, cpu in pauses[name]), default=0.0)
        spliced = start_ours(engine, work)
        rendered = start_ours(engine, work, "--no-tito")
        rendered.name = "harness-rl proxy, --no-tito"
        splice = asyncio.run(splicing([spliced, rendered], args.turns))
        stop(spliced, time.time())
        stop(rendered, time.time())
        prompt_tokens = json.loads(direct_probe(engine))["usage"]["prompt_tokens"]
        hub = hub_id(work, args, starters)
    engine_process.terminate()
    report(results, splice, args.turns, prompt_tokens, loads)
    report_hub(hub)


HUB_ID = "org/tiny"


def hub_id(work: Path, args: argparse.Namespace, starters: dict[str, Callable[[str, Path], Target] | None]) -> dict:
    """The engine serving a hub id; the tokenizer and template where `hf download` leaves them."""
    model_dir = tiny_model()
    cache = work / "hf-hub"
    snapshot = cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots" / "0"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (snapshot / name).write_bytes((model_dir / name).read_bytes())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0")
    process, engine = start_engine(model_dir, served_root=HUB_ID)
    try:
        def fresh(name: str) -> Target:
            start = starters[name]
            if start is start_ours:
                return start_ours(engine, work, env={"HF_HUB_CACHE": str(cache)})
            return start(engine, work) if start else Target(name, None, engine, "direct")

        out: dict = {"calls": alone("harness-rl proxy", fresh, engine, args.turns, False, [])["calls"]}
        targets = [fresh(name) for name in starters]
        since = time.time()
        got = asyncio.run(one_agent(targets, args.stream_turns, True))
        for target in targets:
            stop(target, since)
        out["p50_stream"] = {name: r["p50"] for name, r in got.items()}
        out["load"] = load_average()
    finally:
        process.terminate()
    return out


def report_hub(hub: dict) -> None:
    p50 = hub["p50_stream"]
    direct = p50["direct to engine"]
    line = (f"\nhub id ({HUB_ID}, tokenizer from the Hugging Face cache): engine calls per JSON call "
            f"{hub['calls']:.3f}; streamed one agent p50 added: ours {ms(p50['harness-rl proxy'] - direct)}")
    if "OpenEnv capture proxy" in p50:
        theirs = p50["OpenEnv capture proxy"] - direct
        line += f", OpenEnv {ms(theirs)}, ratio {(p50['harness-rl proxy'] - direct) / theirs:.2f}x"
    print(f"{line} ({hub['load']})")


def report(results: dict[str, dict], splice: dict[str, dict[str, float]], turns: int, prompt_tokens: int,
           loads: list[str]) -> None:
    print(f"prompt: {prompt_tokens} tokens; {load_average()} (interleaved runs: JSON {loads[0]}, "
          f"streamed {loads[1]})\n")
    direct = results["direct to engine"]
    names = list(results)
    rows = [
        ("one agent p50, alone", lambda r: ms(r["p50_alone"])),
        ("  added p50", lambda r: ms(r["p50_alone"] - direct["p50_alone"])),
        ("one agent p99, alone", lambda r: ms(r["p99_alone"])),
        ("one agent p50, interleaved", lambda r: ms(r["p50"])),
        ("  added p50", lambda r: ms(r["p50"] - direct["p50"])),
        ("one agent p99, interleaved", lambda r: ms(r["p99"])),
        ("  engine calls per call", lambda r: f"{r['calls']:7.3f}"),
        ("streamed p50, alone", lambda r: ms(r["p50_alone_stream"])),
        ("  added p50", lambda r: ms(r["p50_alone_stream"] - direct["p50_alone_stream"])),
        ("streamed p50, interleaved", lambda r: ms(r["p50_stream"])),
        ("  added p50", lambda r: ms(r["p50_stream"] - direct["p50_stream"])),
        ("  engine calls per call", lambda r: f"{r['calls_stream']:7.3f}"),
        ("  proxy CPU per call", lambda r: ms(r["cpu_stream"])),
        (f"one agent p50 (1-{turns})", lambda r: ms(r["p50_all"])),
        ("turns 1-50 mean", lambda r: ms(r["first50"])),
        (f"turns {max(1, turns - 49)}-{turns} mean", lambda r: ms(r["last50"])),
        ("  growth per 100 turns", lambda r: ms(r["slope_per_100"])),
        ("proxy CPU per request", lambda r: ms(r["cpu"])),
        ("  turns 1-100", lambda r: ms(r["cpu_first100"])),
        (f"  turns {max(1, turns - 99)}-{turns}", lambda r: ms(r["cpu_last100"])),
        ("  one-core ceiling", lambda r: f"{1 / r['cpu']:7.0f} req/s" if r["cpu"] else "      -"),
        ("memory per captured turn", lambda r: f"{r['kb_per_turn']:7.1f} KB"),
        ("16 agents back to back", lambda r: f"{r['rps']:7.0f} req/s"),
        ("  p99", lambda r: ms(r["sat_p99"])),
        ("  added p99", lambda r: ms(r["sat_p99"] - direct["sat_p99"])),
        ("64 agents p50", lambda r: ms(r["think_p50"])),
        ("  added p50", lambda r: ms(r["think_p50"] - direct["think_p50"])),
        ("64 agents p99", lambda r: ms(r["think_p99"])),
        ("  added p99", lambda r: ms(r["think_p99"] - direct["think_p99"])),
        ("gen-2 collections", lambda r: f"{r['gen2']:7d}"),
        ("longest collector pause", lambda r: ms(r["max_pause"])),
        ("longest collector CPU time", lambda r: ms(r["max_pause_cpu"])),
        ("answer size to agent", lambda r: f"{r['bytes'] / 1024:7.1f} KB"),
    ]
    width = max(len(n) for n in names) + 2
    print(f"{'':28}" + "".join(f"{n:>{width}}" for n in names))
    for label, cell in rows:
        print(f"{label:28}" + "".join(f"{cell(results[n]):>{width}}" for n in names))
    for name in names:
        print(f"capture fields the agent receives via {name}: {', '.join(results[name]['leaked']) or 'none'}")
    on, off = splice["harness-rl proxy"], splice["harness-rl proxy, --no-tito"]
    print(f"\nsplice: an agent sending its own replies back, {turns} turns, token in/out on vs off, interleaved")
    print(f"{'':28}{'on (spliced)':>16}{'off (rendered)':>16}{'added':>12}")
    for label, key in (("p50 latency, turns 1-50", "first50"), ("p50 latency, last 50", "last50"),
                       ("proxy CPU, turns 1-50", "cpu_first50"), ("proxy CPU, last 50", "cpu_last50"),
                       ("latency growth per 100", "slope_per_100")):
        print(f"{label:28}{ms(on[key]):>16}{ms(off[key]):>16}{ms(on[key] - off[key]):>12}")
    if "OpenEnv capture proxy" not in results:
        return
    ours, theirs = results["harness-rl proxy"], results["OpenEnv capture proxy"]

    def added(r: dict, key: str) -> float:
        return r[key] - direct[key]

    print("\nours / OpenEnv, added p50 alone: JSON "
          f"{added(ours, 'p50_alone') / added(theirs, 'p50_alone'):.2f}x, streamed "
          f"{added(ours, 'p50_alone_stream') / added(theirs, 'p50_alone_stream'):.2f}x; interleaved: JSON "
          f"{added(ours, 'p50') / added(theirs, 'p50'):.2f}x, streamed "
          f"{added(ours, 'p50_stream') / added(theirs, 'p50_stream'):.2f}x; "
          f"16 agents {ours['rps'] / theirs['rps']:.1f}x req/s; "
          f"memory per turn {ours['kb_per_turn'] / max(theirs['kb_per_turn'], 1e-9):.2f}x; "
          f"answer size {ours['bytes'] / theirs['bytes']:.2f}x")


def direct_probe(engine: str) -> str:
    import urllib.request

    request = urllib.request.Request(f"{engine}/v1/chat/completions", data=json.dumps(
        {**json.loads(agent_body(0)), "return_token_ids": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as resp:
        return resp.read().decode()


if __name__ == "__main__":
    main()
