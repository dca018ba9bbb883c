"""aider (PyPI `aider-chat` 0.86.2, in its own virtualenv under the tools dir): OpenAI Chat through
litellm, streaming, no tools: the model edits files by writing them out in its reply.

Wiring (measured against a scripted server): `--model openai/<policy>` with `OPENAI_API_BASE` and
`OPENAI_API_KEY` (sent as `Authorization: Bearer`); `--message` runs one request-and-apply round
and exits; `--yes-always` answers every question. The `whole` edit format (the file's full new
text in a fence after its name) is the one a small policy can learn first. aider fetches litellm's
model price list at start unless its cache holds one, so the launch seeds that cache and a
metadata file with the policy's limits; update checks, analytics, release notes, lint runs and
auto-commits are off. Like Harbor, the launch snapshots a workdir that is not yet a git repository
into one (aider's repository map and file discovery need git), under an identity from a private
`~/.gitconfig`.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath

from adapters.harnesses.base import Endpoint, Harness, Launch, Package, ToolReport, isolated_env
from adapters.sandboxes.base import ExecResult, Sandbox

SNAPSHOT_THEN_RUN = (
    "if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then "
    "git init -q && git add -A && git commit -q --no-verify --allow-empty -m 'Task files before agent run' "
    "|| echo 'aider: could not snapshot the workdir into git' >&2; fi; "
    'exec "$@"'
)
APPLIED = re.compile(r"^Applied edit to (.+)$", re.MULTILINE)
MALFORMED = re.compile(r"^(The LLM did not conform to the edit format|Failed to apply edit)", re.MULTILINE)


class AiderHarness(Harness):
    name = "aider"
    dialect = "openai-chat"
    package = Package("pypi", "aider-chat", "0.86.2", "aider", venv="aider")

    def __init__(self, edit_format: str = "whole", context_tokens: int = 65536, output_tokens: int = 8192) -> None:
        self.edit_format = edit_format
        self.context_tokens = context_tokens
        self.output_tokens = output_tokens

    def model_metadata(self, endpoint: Endpoint) -> str:
        limits = {"max_input_tokens": self.context_tokens, "max_output_tokens": self.output_tokens,
                  "max_tokens": self.output_tokens, "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
                  "litellm_provider": "openai", "mode": "chat"}
        return json.dumps({f"openai/{endpoint.model}": limits, endpoint.model: limits})

    def chat_history_path(self, sandbox: Sandbox) -> str:
        return str(PurePosixPath(sandbox.logs_dir) / "agent" / "aider.chat.history.md")

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        home = PurePosixPath(sandbox.home)
        metadata_path = home / ".aider.model.metadata.json"
        env = isolated_env(sandbox, OPENAI_API_BASE=endpoint.openai_base_url, OPENAI_API_KEY=endpoint.api_key,
                           LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1")
        argv = [
            "bash", "-c", SNAPSHOT_THEN_RUN, "aider", self.binary(sandbox),
            f"--model=openai/{endpoint.model}", f"--edit-format={self.edit_format}",
            f"--model-metadata-file={metadata_path}", f"--chat-history-file={self.chat_history_path(sandbox)}",
            f"--input-history-file={home / '.aider.input.history'}",
            "--yes-always", "--no-auto-commits", "--no-dirty-commits", "--no-auto-lint", "--no-check-update",
            "--no-analytics", "--no-show-release-notes", "--no-pretty", "--no-fancy-input",
            "--no-show-model-warnings", "--no-detect-urls", "--no-gitignore",
            f"--message={instruction}",
        ]
        files = {
            str(metadata_path): self.model_metadata(endpoint),
            str(home / ".aider" / "caches" / "model_prices_and_context_window.json"): self.model_metadata(endpoint),
            str(home / ".gitconfig"): "[user]\n\tname = harness-rl agent\n\temail = agent@localhost\n",
        }
        return Launch(argv=argv, env=env, files=files)

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        """aider has no tools; each file it writes is one `edit`, a reply it could not apply a failure."""
        edits = len(APPLIED.findall(result.stdout))
        failures = len(MALFORMED.findall(result.stdout))
        return ToolReport({"edit": edits} if edits else {}, failures, "")
