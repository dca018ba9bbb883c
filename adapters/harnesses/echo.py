"""The built-in `echo` harness: ask the model once and write its answer to a file in the workdir.

It is the smallest possible agent (a few lines of stdlib Python run inside the sandbox) and the
harness of the CPU learning demo: one call through the session's OpenAI base URL, no tools, so a
tiny model's GRPO signal comes from nothing but what it writes.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from adapters.harnesses.base import Endpoint, Harness, Launch, ToolReport, isolated_env
from adapters.sandboxes.base import ExecResult, Sandbox

ECHO_AGENT = """\
import json, os, sys, urllib.request

request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps({
        "model": os.environ["ECHO_MODEL"],
        "messages": [{"role": "user", "content": sys.argv[1]}],
        "max_tokens": int(os.environ["ECHO_MAX_TOKENS"]),
    }).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
)
with urllib.request.urlopen(request, timeout=float(os.environ["ECHO_HTTP_TIMEOUT"])) as response:
    answer = json.load(response)["choices"][0]["message"].get("content") or ""
with open(os.environ["ECHO_ANSWER_FILE"], "w", encoding="utf-8", errors="replace") as file:
    file.write(answer)
print(json.dumps({"answer": answer}))
"""


class EchoHarness(Harness):
    """One model call; the answer goes to `answer_file` in the workdir."""

    name = "echo"
    dialect = "openai-chat"

    def __init__(self, answer_file: str = "answer.txt", max_tokens: int = 64, http_timeout_s: float = 600.0) -> None:
        self.answer_file = answer_file
        self.max_tokens = max_tokens
        self.http_timeout_s = http_timeout_s

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        script = str(PurePosixPath(sandbox.home) / "echo_agent.py")
        env = isolated_env(
            sandbox,
            OPENAI_BASE_URL=endpoint.openai_base_url,
            OPENAI_API_KEY=endpoint.api_key,
            ECHO_MODEL=endpoint.model,
            ECHO_MAX_TOKENS=str(self.max_tokens),
            ECHO_HTTP_TIMEOUT=str(self.http_timeout_s),
            ECHO_ANSWER_FILE=str(PurePosixPath(sandbox.workdir) / self.answer_file),
        )
        return Launch(argv=[sandbox.python, script, instruction], env=env, files={script: ECHO_AGENT})

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        for line in reversed(result.stdout.splitlines()):
            try:
                return ToolReport(completion=str(json.loads(line)["answer"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        return ToolReport()
