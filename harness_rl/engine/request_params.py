"""Request fields → `SamplingParams`, with vLLM's validation messages and 400/404 statuses."""

from harness_rl.engine.errors import ApiError
from harness_rl.engine.protocol import SamplingFields
from harness_rl.engine.sampling import SamplingParams
from harness_rl.engine.token_protocol import GenerateSampling


def check_model(requested: str | None, served: str) -> None:
    """`model` may be absent; otherwise it must name the served model (404 like vLLM)."""
    if requested is not None and requested != served:
        raise ApiError(404, f"The model `{requested}` does not exist. Valid aliases: {served}.", param="model")


# Sampling knobs vLLM honours but this engine does not, with their neutral values. A non-neutral value
# is refused rather than ignored: ignoring it would make the returned logprobs silently wrong.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "include_stop_str_in_output": (None, False),
}


def _refuse_unsupported(request: SamplingFields | GenerateSampling) -> None:
    for name, neutral in _NEUTRAL.items():
        if getattr(request, name, None) not in neutral:
            raise ApiError(400, f"{name} is not supported by the embedded engine; leave it unset.", param=name)


def sampling_params(
    request: SamplingFields | GenerateSampling,
    *,
    stream: bool,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    """Validate the sampling fields and the length budget of one request.

    As in vLLM 0.32: a prompt that fills the context or `max_tokens` above `max_model_len` is a
    400; otherwise generation is capped at the room left after the prompt (finish "length").
    """
    _refuse_unsupported(request)
    if request.n not in (None, 1):
        raise ApiError(400, f"n={request.n} is not supported by this engine (only n=1).", param="n")
    temperature = 1.0 if request.temperature is None else request.temperature
    if temperature < 0:
        raise ApiError(400, f"temperature must be non-negative, got {temperature}.", param="temperature")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    top_k = 0 if request.top_k is None else request.top_k
    if top_k < -1:
        raise ApiError(400, f"top_k must be -1 (disable), or at least 1, got {top_k}.", param="top_k")
    if request.prompt_logprobs is not None and (request.prompt_logprobs < -1 or stream):
        raise ApiError(
            400,
            "prompt_logprobs must be -1 (whole vocabulary) or >= 0, and cannot be streamed.",
            param="prompt_logprobs",
        )
    if logprobs is not None and logprobs < 0:
        raise ApiError(400, f"logprobs must be non-negative, got {logprobs}.", param="logprobs")
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"at least {prompt_len} input tokens, which exceeds this limit even without any output tokens. "
            f"Please reduce the length of the input prompt. (parameter=input_tokens, value={prompt_len})",
            param="input_tokens",
        )
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(
            400,
            f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )
    if max_tokens is not None and max_tokens > max_model_len:
        raise ApiError(
            400,
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. Please request "
            f"fewer output tokens. (parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )
    budget = max_model_len - prompt_len
    requested = max_tokens if max_tokens is not None else default_max_tokens
    chosen = min(requested, budget) if requested is not None else budget
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    return SamplingParams(
        max_tokens=chosen,
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        seed=request.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs,
    )
